"""`flex`: PyTorch FlexAttention under torch.compile, the peer users would pick instead of our kernels.

The BlockMask comes from the pattern's block-sparse view (`block_sparse(bs)`: which key blocks each query
block needs, and which of them are fully allowed), and its `mask_mod` is the pattern's own predicate
`allowed(i, j)`, applied inside partially allowed blocks. Both are built in prepare, and the first call
compiles, so BlockMask building and compilation land in `setup_s`.

Compiled graphs are reused across shapes and parameters: flex_attention is compiled once per process with
dynamic shapes, and the predicate reads the pattern's fields (window, density, seed, ...) from 0-dim
tensors rather than Python numbers, so they are graph inputs, not constants. One graph then serves every
size and parameter value of a pattern kind, per dtype; compiling anew for each (pattern, N) would cost
seconds each.

FlexAttention has no backward on CPU (torch raises NotImplementedError for CPU inputs that require grad),
so mode fwd_bwd is skipped on CPU with that reason; on CUDA it is differentiable.
"""

from __future__ import annotations

import functools
import math
from typing import Any, ClassVar

import torch

from bench.registry import Impl, register, setup_phase
from bench.selection import TakesSelections
from impls.common import softmax_scale

# Compiled graphs kept per compiled function: one per (pattern kind, dtype, device) at least; torch's
# default of 8 would fall back to eager (uncompiled, O(N^2) memory) after the eighth pattern kind.
RECOMPILE_LIMIT = 128

CPU_NO_BACKWARD = ("FlexAttention has no backward on CPU in this torch (flex_attention raises "
                   "NotImplementedError for CPU inputs that require grad)")

_compiled: Any = None
COMPILED = "torch.compile(dynamic=True)"


def compiled_flex() -> Any:
    """flex_attention under torch.compile with dynamic shapes, one per process."""
    global _compiled
    if _compiled is None:
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention

        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, RECOMPILE_LIMIT * 4)
        _compiled = torch.compile(flex_attention, dynamic=True)
    return _compiled


def eager_flex() -> Any:
    """flex_attention uncompiled: PyTorch's reference path (scores materialised), the last resort where Inductor
    cannot compile the mask_mod at all; correct, but not FlexAttention's speed or memory."""
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention


def compile_failures() -> tuple[type[BaseException], ...]:
    """What a failed torch.compile of FlexAttention raises: Dynamo's tracing errors and Inductor's (wrapped as
    BackendCompilerFailed, both TorchDynamoException), a lowering error, or a C++ build of the compiled code that
    fails outside them when its module is loaded at the first call (seen on an AMD CPU)."""
    from torch._dynamo.exc import TorchDynamoException
    from torch._inductor.exc import CppCompileError, LoweringException

    return (TorchDynamoException, CppCompileError, LoweringException)


def kernel_options(block_size: int, device: torch.device, q_len: int) -> dict[str, int] | None:
    """Tile sizes for blocks under 128 on a GPU: Inductor's one default forward tile on Hopper is 128 query rows
    (bfloat16 and float16 at head_dim 64 and 128, float32 at 64), which must divide the BlockMask's block, so a
    64-token block would fail to compile and run uncompiled. The forward then tiles by the block itself. (The
    backward has no such override: its default tiles on Hopper need 128-token blocks at head_dim 128, and
    torch skips a config that does not divide before reading these options, so fwd_bwd falls back there.)
    Decode (fewer than 128 query rows) takes FlexAttention's decoding kernel, whose tiles are its own."""
    if device.type != "cuda" or block_size >= 128 or q_len < 128:
        return None
    return {"BLOCK_M": block_size, "BLOCK_N": block_size}


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:160]}"


def first_call_falls_back(attempts, extras: dict[str, object]):
    """The call of the first attempt whose first run works; each attempt `(name, make)` makes a zero-argument
    call, and a compiled one's first run (compilation) is timed as setup. Where compiling fails, the next
    attempt; the record's config says which ran and why (`mask_mod`, `compiled`). Raises what the last raises."""
    failures = compile_failures()
    state: dict[str, object] = {"run": None}
    why: list[str] = []

    def call():
        run = state["run"]
        if run is not None:
            return run()
        for index, (name, make) in enumerate(attempts):
            last = index == len(attempts) - 1
            try:
                candidate = make()
                with setup_phase("compile"):  # torch.compile traces and compiles on the first call
                    out = candidate()
            except failures as exc:
                if last:
                    raise
                why.append(f"{name}: {_first_line(exc)}")
                continue
            if name == "tabulated":
                extras["mask_mod"] = f"tabulated (the predicate did not compile: {why[0].split(': ', 1)[1]})"
            elif name == "uncompiled":
                extras["compiled"] = f"uncompiled (torch.compile failed: {'; '.join(why)})"
                extras["fallback"] = {"path": "uncompiled", "reason": f"torch.compile failed: {'; '.join(why)}"}
            state["run"] = candidate
            return out
        raise AssertionError("no attempt")

    return call


def tensor_fields(pattern, device: torch.device):
    """A copy of `pattern` whose fields are 0-dim tensors (see `Pattern.with_tensor_fields`)."""
    return pattern.with_tensor_fields(device)


def tabulated_mask_mod(pattern, block_size: int, device: torch.device):
    """A mask_mod that looks pairs up in the pattern's block-sparse view instead of evaluating its predicate.

    The same matrix as the predicate (full blocks, and the bitmask of each partial block), for predicates
    whose compiled code Inductor cannot build (see `Flex.prepare`).
    """
    sparse = pattern.block_sparse(block_size)
    nqb, nkb = sparse.num_blocks, math.ceil(pattern.seq_len / block_size)
    slot = torch.full((nqb, nkb), -1, dtype=torch.int64)
    full = torch.zeros(nqb, nkb, dtype=torch.bool)
    used = torch.arange(sparse.kv_indices.shape[1])[None, :] < sparse.kv_counts[:, None].to(torch.int64)
    rows = torch.arange(nqb)[:, None].expand_as(sparse.kv_indices)[used]
    cols = sparse.kv_indices[used].to(torch.int64)
    full[rows, cols] = sparse.full[used]
    slot[rows, cols] = sparse.mask_index[used].to(torch.int64)
    masks = sparse.masks  # (P, bs, bs); at least one, so that the lookup of slot -1 (clamped to 0) stays in
    # bounds where no block is partial (an empty table is an out-of-bounds read: a device-side assert on a GPU)
    if masks.shape[0] == 0:
        masks = torch.zeros(1, block_size, block_size, dtype=torch.bool)
    slot, full, masks = slot.to(device), full.to(device), masks.to(device)

    def mask_mod(b, h, q_idx, kv_idx):
        qb = (q_idx // block_size).clamp(0, nqb - 1)  # FlexAttention also asks about padding
        kb = (kv_idx // block_size).clamp(0, nkb - 1)
        s = slot[qb, kb]
        inside = masks[s.clamp(min=0), q_idx % block_size, kv_idx % block_size]
        return full[qb, kb] | ((s >= 0) & inside)

    return mask_mod


def block_mask_for(pattern, block_size: int, device: torch.device, tabulated: bool = False):
    """FlexAttention BlockMask of `pattern`: partial and full key blocks per query block, and mask_mod.

    Over the pattern's q_len x seq_len matrix (its query rows are the last q_len positions, which the
    mask_mod's q_idx counts from 0, as FlexAttention passes them); documents are part of the predicate.
    `tabulated`: the mask_mod looks pairs up in the block view (`tabulated_mask_mod`).
    """
    from torch.nn.attention.flex_attention import BlockMask

    sparse = pattern.block_sparse(block_size)
    nqb = sparse.num_blocks
    nkb = math.ceil(pattern.seq_len / block_size)
    slot = torch.arange(sparse.kv_indices.shape[1])[None, :]
    used = slot < sparse.kv_counts[:, None].to(torch.int64)  # (nqb, max_kv)

    def compact(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(counts (1, 1, nqb), indices (1, 1, nqb, nkb)) of the kept key blocks, in increasing order."""
        counts = keep.sum(dim=1).to(torch.int32)
        indices = torch.zeros(nqb, nkb, dtype=torch.int32)
        order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)  # kept slots first, in order
        width = sparse.kv_indices.shape[1]
        if width:
            indices[:, :width] = torch.gather(sparse.kv_indices, 1, order).clamp(min=0)
        return counts.view(1, 1, nqb).to(device), indices.view(1, 1, nqb, nkb).to(device)

    partial_counts, partial_indices = compact(used & ~sparse.full)
    full_counts, full_indices = compact(used & sparse.full)
    if tabulated:
        mask_mod = tabulated_mask_mod(pattern, block_size, device)
    else:
        params = tensor_fields(pattern, device)

        def mask_mod(b, h, q_idx, kv_idx):
            return params._matrix(q_idx, kv_idx)

    return BlockMask.from_kv_blocks(partial_counts, partial_indices, full_counts, full_indices,
                                    BLOCK_SIZE=block_size, mask_mod=mask_mod,
                                    seq_lengths=(pattern.q_len, pattern.seq_len))


def selection_block_mask(selection, classes: torch.Tensor, base_mask_mod, nq: int, n: int, block_size: int,
                         heads: int, kv_heads: int):
    """FlexAttention BlockMask of a selection under the base pattern, per (batch, head): `classes` (QB, KB) int8
    of the base's blocks (0 none, 1 partial, 2 full), `base_mask_mod(q_idx, kv_idx)` its predicate.

    A block selection per query block maps onto FlexAttention's block lists directly (full where the base block is
    full); any other (per row, tokens, pages) lists the blocks some row of a query block touches as partial and
    looks each pair up in the selection's unit table in the mask_mod."""
    from torch.nn.attention.flex_attention import BlockMask

    device = classes.device
    nqb, nkb = classes.shape
    heads_of = selection.head_index(heads, kv_heads).to(device)
    kv_units = math.ceil(n / selection.kv_unit)
    units = selection.unit_mask(kv_units).to(device)  # (B, H_sel, U, KU)
    b = units.shape[0]
    if selection.q_unit == block_size and selection.kv_unit == block_size:
        chosen = units[:, heads_of]  # (B, H, QB, KB)
        full, partial = chosen & (classes == 2), chosen & (classes == 1)

        def mask_mod(bi, hi, q_idx, kv_idx):
            return base_mask_mod(q_idx, kv_idx)
    else:
        # key units -> the key blocks they touch (a unit spans [u * kv_unit, (u + 1) * kv_unit))
        first = (torch.arange(kv_units, device=device) * selection.kv_unit) // block_size
        last = ((torch.arange(kv_units, device=device) + 1) * selection.kv_unit - 1).clamp(max=n - 1) // block_size
        touches = (torch.arange(nkb, device=device)[None, :] >= first[:, None]) & (
            torch.arange(nkb, device=device)[None, :] <= last[:, None])  # (KU, KB)
        per_unit = (units.to(torch.float32) @ touches.to(torch.float32)) > 0  # (B, H_sel, U, KB)
        rows_per_qb = max(1, block_size // selection.q_unit) if selection.q_unit <= block_size else 1
        padded = torch.nn.functional.pad(per_unit, (0, 0, 0, nqb * rows_per_qb - per_unit.shape[2]))
        per_qb = padded.view(b, -1, nqb, rows_per_qb, nkb).any(dim=3)
        full = torch.zeros(b, heads, nqb, nkb, dtype=torch.bool, device=device)
        partial = per_qb[:, heads_of] & (classes > 0)
        q_unit, kv_unit = selection.q_unit, selection.kv_unit
        n_units, h_sel = units.shape[2], units.shape[1]
        table = units.reshape(-1)  # (B * H_sel * U * KU,): flat, which Inductor's CPU template compiles (a 4-D
        # lookup by (b, h) made it emit an undeclared variable in torch 2.13)

        def mask_mod(bi, hi, q_idx, kv_idx):
            unit = (q_idx // q_unit).clamp(max=n_units - 1)
            key_unit = (kv_idx // kv_unit).clamp(max=kv_units - 1)
            keep = table[((bi * h_sel + heads_of[hi]) * n_units + unit) * kv_units + key_unit]
            return keep & base_mask_mod(q_idx, kv_idx)

    def compact(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        counts = keep.sum(dim=-1).to(torch.int32)
        order = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return counts, order

    partial_counts, partial_indices = compact(partial)
    full_counts, full_indices = compact(full)
    return BlockMask.from_kv_blocks(partial_counts, partial_indices, full_counts, full_indices,
                                    BLOCK_SIZE=block_size, mask_mod=mask_mod, seq_lengths=(nq, n))


@register
class Flex(Impl):
    name = "flex"
    description = "FlexAttention (torch.compile), BlockMask from the pattern's blocks and predicate; no CPU backward"
    fwd_bwd = True  # on CUDA; CPU fwd_bwd is unsupported (see unsupported)
    score_mods = frozenset({"softcap", "alibi", "relative_bias", "custom"})  # its own score_mod argument
    selections: ClassVar[TakesSelections] = {"q_unit": (1, "block"), "kv_unit": ("token", "block", "page")}

    def unavailable(self) -> str | None:
        try:
            import torch.nn.attention.flex_attention
        except ImportError as exc:
            return f"torch {torch.__version__} has no FlexAttention ({exc})"
        return None

    def unsupported(self, case) -> str | None:
        reason = super().unsupported(case)
        if reason is None and case.mode == "fwd_bwd" and case.device == "cpu":
            reason = CPU_NO_BACKWARD
        if reason is None and case.score_mod == "relative_bias" and case.device == "cpu":
            reason = ("flex on CPU does not take T5's relative bias: Inductor's CPU flex template fails to compile "
                      "its table lookup, by bucket or by distance alike (CppCompileError, undeclared variables, "
                      "torch 2.13)")
        return reason

    def prepare(self, case, pattern, q, k, v):
        with setup_phase("mask"):
            block_mask = block_mask_for(pattern, case.block_size, q.device)
        scale = softmax_scale(case.head_dim)
        gqa = k.shape[1] != q.shape[1]  # FlexAttention's native grouped-query attention: no K/V copies
        mod = case.make_score_mod()
        # the modification's tables in float32, as FlexAttention computes scores (captured as buffers)
        score_mod = None if mod is None else mod.for_device(q.device, torch.float32).fn
        self._extras = {"block_size": case.block_size, "compiled": COMPILED, "mask_mod": "predicate"}

        options = kernel_options(case.block_size, q.device, pattern.q_len)

        def over(fn, mask):
            fn = fn if score_mod is None else functools.partial(fn, score_mod=score_mod)
            return lambda: fn(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa, kernel_options=options)

        def tabulated():
            with setup_phase("mask"):
                mask = block_mask_for(pattern, case.block_size, q.device, tabulated=True)
            return over(compiled_flex(), mask)

        # Inductor's CPU flex template cannot compile some predicates (torch 2.13 emits undeclared variables for
        # several of attention-gym's mask_mods): the same matrix looked up in the block view often compiles; where
        # that fails too (attention-gym's block diffusion: a LoweringException), FlexAttention runs uncompiled.
        return first_call_falls_back([("predicate", lambda: over(compiled_flex(), block_mask)),
                                      ("tabulated", tabulated),
                                      ("uncompiled", lambda: over(eager_flex(), block_mask))], self._extras)

    def unsupported_selection(self, case, q_unit, kv_unit, shared):
        reason = super().unsupported_selection(case, q_unit, kv_unit, shared)
        if reason is None and case.device == "cpu" and (q_unit, kv_unit) != ("block", "block"):
            reason = ("flex on CPU takes block selections per query block only: Inductor's CPU flex template "
                      "fails to compile a mask_mod that looks up a per-row table (CppCompileError, torch 2.13)")
        return reason

    def prepare_selected(self, case, pattern, q, k, v):
        """Attention over a selection: a BlockMask built from the selection in each call (the base pattern's
        predicate inside partial blocks), FlexAttention with its log-sum-exp."""
        bs = case.block_size
        with setup_phase("mask"):
            sparse = pattern.block_sparse(bs)
            nqb, nkb = sparse.num_blocks, math.ceil(pattern.seq_len / bs)
            classes = torch.zeros(nqb, nkb, dtype=torch.int8)
            used = torch.arange(sparse.kv_indices.shape[1])[None, :] < sparse.kv_counts[:, None].to(torch.int64)
            rows = torch.arange(nqb)[:, None].expand_as(sparse.kv_indices)[used]
            classes[rows, sparse.kv_indices[used].to(torch.int64)] = torch.where(sparse.full[used], 2, 1).to(
                torch.int8)
            classes = classes.to(q.device)
            params = tensor_fields(pattern, q.device)
        scale = softmax_scale(case.head_dim)
        h, hkv = q.shape[1], k.shape[1]
        nq, n = pattern.q_len, pattern.seq_len
        self._extras = {"block_size": bs, "compiled": COMPILED, "mask_mod": "predicate"}
        state = {"fn": None}

        # Inductor's CPU flex template returns no log-sum-exp ("return_lse is not supported yet" in torch 2.13)
        with_lse = q.device.type != "cpu"
        options = kernel_options(bs, q.device, nq)

        def attend(selection):
            mask = selection_block_mask(selection, classes, params._matrix, nq, n, bs, h, hkv)
            if state["fn"] is None:  # the first call compiles, or falls back to FlexAttention uncompiled
                chosen = {}

                def over(fn):
                    chosen["fn"] = fn
                    return lambda: fn(q, k, v, block_mask=mask, scale=scale, enable_gqa=h != hkv,
                                      return_lse=with_lse, kernel_options=options)

                run = first_call_falls_back([("predicate", lambda: over(compiled_flex())),
                                             ("uncompiled", lambda: over(eager_flex()))], self._extras)
                result = run()
                state["fn"] = chosen["fn"]
                return result
            return state["fn"](q, k, v, block_mask=mask, scale=scale, enable_gqa=h != hkv, return_lse=with_lse,
                               kernel_options=options)

        return attend

    def record_extras(self) -> dict[str, object]:
        return dict(self._extras)
