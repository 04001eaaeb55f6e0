"""`blocked`: dense matrix products over the pattern's block layout, pure PyTorch, the fast CPU path.

Query rows (the pattern's q_len x seq_len matrix) are cut into blocks of `block_size` rows; each query
block gets every key it may see in one batch and is computed by dense GEMMs: sliding windows of K for
banded patterns (Longformer's sliding chunks), gathered key blocks otherwise (`plan`), masked only where
blocks are partially allowed, with an exact softmax over the batch (`compute`). Grouped-query attention
stacks the G query heads of a KV head as rows of the same products (K and V are never repeated). Memory
never grows as N^2: the forward holds one step's scores per thread besides its output, and the backward
(an autograd.Function walking the same steps) the saved probabilities of the allowed blocks. bfloat16 and
float16 inputs are computed in their own dtype: the products on the low-precision GEMMs (float32
accumulation inside), the softmax statistics and the key-gradient sums in float32 (`compute`, `backward`).
Inference on CPU in float32 and bfloat16 goes through a C++ kernel over the pattern's block table (`kernel`,
measured fastest on every plan); where it cannot (float16, float64, shapes it does not take, no compiler),
through torch's fused flash kernel on low-precision bands (`fused`), else through the steps above.
"""

from __future__ import annotations

from typing import ClassVar

from bench.errors import Unavailable
from bench.registry import Impl, register, setup_phase
from bench.selection import TakesSelections
from bench.spec.case import DTYPES
from impls.blocked.attention import blocked_attention
from impls.blocked.decode import (
    DECODE_ROWS,
    HEAD_DIM_MULTIPLE,
    decode_attention,
    decode_engine,
    decode_module,
    decode_unavailable,
    masks_plan,
    pattern_plan,
)
from impls.blocked.fused import FUSED_ROWS, fused_available
from impls.blocked.kernel import (
    BlockTable,
    block_table,
    dot_tile_rows,
    gemm_engine,
    kernel_attention_lse,
    kernel_attention_tables,
    kernel_module,
    kernel_products,
    kernel_score_mod,
    kernel_wanted,
    unavailable_reason,
)
from impls.blocked.pages import page_rows_attention, page_rows_unavailable, tokens_of_pages
from impls.blocked.plan import BandPlan, GatherPlan, make_plan
from impls.blocked.selected import base_slots, gathered_attention, head_tables, tasks_of
from impls.blocked.tokens import rows_as_sequences_unavailable, token_attention, token_rows_attention
from impls.common import apply_sinks, softmax_scale


def _computed(shown, table: BlockTable | None, case, pattern, q, n: int, group: int,
              modified: bool) -> dict[str, object]:
    """The record's computed pairs per query head (of the q_len x seq_len matrix, padding included) and, on the
    kernel, which code ran its products: through its dot tiles each register tile computes the keys its rows see."""
    computed, extras = shown.computed_pairs, {}
    if table is not None:
        extras["products"] = kernel_products(q.dtype, case.block_size, q.shape[-1], modified)
        if extras["products"] == "dot_tiles":
            computed = table.dot_tile_pairs(q.shape[2], n, group, dot_tile_rows(q.dtype))
    return {"computed_pairs_per_head": computed, "computed_over_allowed": computed / max(1, pattern.nnz), **extras}


@register
class Blocked(Impl):
    name = "blocked"
    description = "dense matmuls over the block layout: sliding windows for bands, gathered blocks otherwise"
    fwd_bwd = True
    score_mods = frozenset({"softcap", "alibi", "relative_bias"})  # in the CPU kernel only (unsupported_score_mod)
    selections: ClassVar[TakesSelections] = {"q_unit": (1, "block"), "kv_unit": ("token", "block", "page")}
    applies_sinks = True  # through its kernels' log-sum-exp where they run; its torch-op steps refuse in prepare

    def build_ahead(self, devices):
        if "cpu" in devices:  # both C++ kernels; each is cached per machine and loads in a second once built
            kernel_module()
            decode_module()

    def unsupported(self, case):
        reason = super().unsupported(case)
        if reason is None and case.sinks is not None and case.page_size is not None:
            reason = "blocked does not apply learned sinks over a paged cache yet"
        return reason

    def unsupported_score_mod(self, case):
        reason = super().unsupported_score_mod(case)
        if reason is None and not (case.mode == "fwd" and case.device == "cpu" and case.dtype in ("float32",
                                                                                                  "bfloat16")):
            reason = (f"blocked applies score_mod {case.score_mod} in its CPU kernel (inference in float32 and "
                      "bfloat16) only; its torch-op steps (fwd_bwd, float16, CUDA) do not apply it yet")
        return reason

    def prepare(self, case, pattern, q, k, v):
        b, h, nq, d = q.shape
        hkv, n = k.shape[1], k.shape[2]
        group = h // hkv
        scale = softmax_scale(case.head_dim)
        mod = kernel_score_mod(case)  # None without one; the decode kernel applies none: the block kernel does
        sinks = case.sink_logits()
        # decode: K/V read in place (impls/blocked/decode.py)
        decode_missing: str | None = None  # why the decode kernel, wanted for this case, cannot run it
        if nq <= DECODE_ROWS and case.mode == "fwd" and mod is None:
            with setup_phase("compile"):
                missing = decode_unavailable(q, case.mode)
            if missing is None:
                with setup_phase("mask"):
                    plan = pattern_plan(pattern.dense_mask(), b * hkv, case.block_size)
                self._extras = self._decode_extras(case, plan, pattern)
                return lambda: apply_sinks(*decode_attention(plan, q, k, v, scale), sinks)
            decode_missing = missing if self.decode_ready(case) else None
        table: BlockTable | None = None  # inference through the CPU kernel (`kernel`): the pattern's block table
        kernel_missing: str | None = None  # why the kernel, wanted, cannot run
        if case.mode == "fwd" and kernel_wanted(q.dtype, q.device):
            with setup_phase("compile"):  # built on first use on this machine, then loaded from its cache
                kernel_missing = unavailable_reason(q, case.block_size)
            if kernel_missing is None:
                with setup_phase("mask"):
                    table = block_table(pattern, case.block_size)
        plan: BandPlan | GatherPlan | None = None  # the torch-op steps, where the kernel does not run
        fused = None  # inference in low precision on a band: the fused kernel's plan, of FUSED_ROWS rows
        if table is None:
            with setup_phase("mask"):  # the plan: which keys each step reads, and its masks
                plan = make_plan(pattern, case.block_size, b * hkv, group, scale, q.device, q.dtype)
                if case.mode == "fwd" and isinstance(plan, BandPlan) and fused_available(q):
                    wide = plan if plan.rows >= FUSED_ROWS else \
                        make_plan(pattern, FUSED_ROWS, b * hkv, group, scale, q.device, q.dtype)
                    fused = wide if isinstance(wide, BandPlan) else None  # wider blocks may fit the gather plan
        if sinks is not None and table is None and kernel_missing is None:
            raise Unavailable("blocked applies learned sinks through its kernels' log-sum-exp (inference in float32 "
                              "and bfloat16 on CPU, and every path over a selection); its torch-op steps for a "
                              "static pattern keep none")
        shown = table if table is not None else fused if fused is not None else plan
        self._extras = {"path": "band_fused" if shown is fused else shown.path,
                        "gemm": gemm_engine(q.dtype, kernel=shown is table),
                        "block_size": case.block_size,
                        "query_block_rows": case.block_size if shown is table else shown.rows,
                        "group_size": group, **_computed(shown, table, case, pattern, q, n, group, mod is not None)}
        self._note_fallback(case, decode_missing, kernel_missing)

        def call():
            # (B, H, q_len, D) -> (B*Hkv, G, q_len, D): the G query heads of each KV head together, and
            # (B, Hkv, N, D) -> (B*Hkv, N, D); views, products in the inputs' dtype
            grouped = q.reshape(b * hkv, group, nq, d)
            keys, values = (t.reshape(b * hkv, n, d) for t in (k, v))
            if table is not None:
                out, lse = kernel_attention_lse(table, grouped, keys, values, scale, mod=mod)
                return apply_sinks(out.reshape(q.shape), lse.reshape(b, h, nq), sinks)
            return blocked_attention(plan, grouped, keys, values, fused).reshape(q.shape)

        return call

    def _note_fallback(self, case, decode_missing: str | None, kernel_missing: str | None) -> None:
        """Say in the record which kernel wanted for this case could not run, and which path ran instead."""
        if decode_missing is not None:
            self._extras["fallback"] = {"path": self._extras["path"], "reason": f"the decode kernel: {decode_missing}"}
        if kernel_missing is not None:
            self._extras["kernel_unavailable"] = kernel_missing
            self._extras["fallback"] = {"path": self._extras["path"], "reason": f"the CPU kernel: {kernel_missing}"}
            needs = (f"score_mod {case.score_mod}" if kernel_score_mod(case) is not None else
                     "learned sinks" if case.sinks is not None else None)
            if needs is not None:
                raise Unavailable(f"blocked applies {needs} in its CPU kernel only, which cannot run here: "
                                  f"{kernel_missing}")

    def _decode_extras(self, case, plan, pattern) -> dict[str, object]:
        listed = plan.listed_keys // max(1, plan.blocks.shape[0])
        return {"path": "decode", "engine": decode_engine(DTYPES[case.dtype]), "block_size": plan.block,
                "group_size": case.group_size,
                "listed_keys_per_kv_head": listed, "computed_over_allowed": listed * case.n_queries / max(
                    1, pattern.nnz / max(1, case.batch))}

    def decode_ready(self, case) -> bool:
        """Whether the decode path serves this case (a few rows, inference, CPU, float32 or bfloat16)."""
        return (case.n_queries <= DECODE_ROWS and case.mode == "fwd" and case.device == "cpu"
                and case.dtype in ("float32", "bfloat16") and case.head_dim % HEAD_DIM_MULTIPLE == 0)

    def unsupported_selection(self, case, q_unit, kv_unit, shared):
        if self.decode_ready(case):  # the decode path reads any selection through its mask
            return None
        return super().unsupported_selection(case, q_unit, kv_unit, shared)

    def paged_native(self, case) -> bool:
        return self.decode_ready(case)

    def prepare_paged(self, case, pattern, q, cache, patterns):
        """Decode through the page table: the pages read in place, sequences of their own lengths."""
        b = q.shape[0]
        hkv = cache.k_pages.shape[1]
        scale = softmax_scale(case.head_dim)
        with setup_phase("compile"):
            missing = decode_unavailable(q, case.mode)
        if missing is not None:
            from bench.errors import Unavailable

            raise Unavailable(f"blocked reads a paged cache through its decode kernel only: {missing}")
        with setup_phase("mask"):
            masks = self._sequence_masks(patterns, hkv, case.seq_len)
            plan = masks_plan(masks, cache.page_size) if masks is not None else \
                pattern_plan(pattern.dense_mask(), b * hkv, cache.page_size)
        self._extras = {**self._decode_extras(case, plan, pattern), "paged": True}

        def call():
            return decode_attention(plan, q, cache.k_pages, cache.v_pages, scale, cache.page_table,
                                    cache.kv_lens)[0]

        return call

    @staticmethod
    def _sequence_masks(patterns, hkv: int, n: int):
        """(B * Hkv, q_len, N) masks of sequences with their own patterns, or None when they share one."""
        if patterns is None:
            return None
        import torch

        masks = [torch.nn.functional.pad(p.dense_mask(), (0, n - p.seq_len)) for p in patterns]
        return torch.stack(masks).repeat_interleave(hkv, dim=0)

    def prepare_selected(self, case, pattern, q, k, v):
        """Attention over a selection of key blocks (impls/blocked/selected.py): the CPU kernel over per-task
        block tables in inference, the gathered torch steps elsewhere."""
        b, h, nq, d = q.shape
        hkv, n = k.shape[1], k.shape[2]
        group = h // hkv
        bs = case.block_size
        scale = softmax_scale(case.head_dim)
        if self.decode_ready(case) and decode_unavailable(q, case.mode) is None:
            return with_sinks_of(case, self._decode_selected(case, pattern, q, k, v))
        kernel_missing: str | None = "mode fwd_bwd: the kernel is inference only"
        if case.mode == "fwd" and kernel_wanted(q.dtype, q.device):
            with setup_phase("compile"):
                kernel_missing = unavailable_reason(q, bs)
        elif case.mode == "fwd":
            kernel_missing = f"{q.dtype} on {q.device.type}"
        with setup_phase("mask"):
            slot, masks = base_slots(pattern, bs)
        self._extras = {"path": "kernel_selected" if kernel_missing is None else "gather_selected",
                        "gemm": gemm_engine(q.dtype, kernel=kernel_missing is None), "block_size": bs,
                        "group_size": group}
        products = kernel_products(q.dtype, bs, d, False) if kernel_missing is None else None
        if kernel_missing is not None:
            self._extras["kernel_unavailable"] = kernel_missing
        wanted = case.mode == "fwd" and kernel_wanted(q.dtype, q.device)  # the kernel would take a block selection

        def attend(selection):
            self._extras.pop("products", None)  # set again below where the block kernel runs
            self._extras.pop("fallback", None)
            if selection.kv_unit not in (1, bs):  # pages (blocked/pages.py): each (row, head) a paged decode
                if page_rows_unavailable(selection, pattern, q, k, case.mode) is None:
                    self._extras["path"] = "page_rows"
                    return page_rows_attention(selection, pattern, q, k, v, scale)
                selection = tokens_of_pages(selection, n)  # else as the tokens of its pages
            if selection.kv_unit == 1:  # tokens (blocked/tokens.py): each row read as a decode step over its
                # tokens (inference, a selection a KV group shares), else torch ops over a tile's rows' union
                if rows_as_sequences_unavailable(selection, q, k, case.mode) is None:
                    self._extras["path"] = "token_rows"
                    return token_rows_attention(selection, pattern, q, k, v, scale)
                self._extras["path"] = "token_union"
                return token_attention(selection, pattern, q, k, v, scale)
            if kernel_missing is not None:
                if wanted:
                    self._extras["fallback"] = {"path": "gather_selected",
                                                "reason": f"the CPU kernel: {kernel_missing}"}
                return gathered_attention(selection, pattern, q, k, v, scale, bs)
            self._extras["products"] = products
            task_heads, per_query_head = tasks_of(selection, h, hkv)
            tables = head_tables(selection, slot, masks, nq, n, bs, task_heads)
            tiles = q.reshape(b * h, 1, nq, d) if per_query_head else q.reshape(b * hkv, group, nq, d)
            keys, values = (t.reshape(b * hkv, n, d) for t in (k, v))
            out, lse = kernel_attention_tables(tables, tiles, keys, values, scale, group if per_query_head else 1)
            return out.reshape(q.shape), lse.reshape(b, h, nq)

        return with_sinks_of(case, attend)

    def _decode_selected(self, case, pattern, q, k, v):
        """A few query rows over a selection: the decode kernel, each (sequence, KV head) through its mask."""
        b, h, nq, _ = q.shape
        hkv, n = k.shape[1], k.shape[2]
        bs, scale = case.block_size, softmax_scale(case.head_dim)
        with setup_phase("mask"):
            base = pattern.dense_mask()  # (Nq, N)
        self._extras = {"path": "decode_selected", "block_size": bs, "group_size": h // hkv}

        def attend_decode(selection):
            masks = selection.dense_mask(base, h, hkv).reshape(b * hkv, (h // hkv) * nq, n)  # rows gi * nq + t
            return decode_attention(masks_plan(masks, bs), q, k, v, scale)

        return attend_decode

    def record_extras(self) -> dict[str, object]:
        return dict(self._extras)


def with_sinks_of(case, attend):
    """`attend(selection) -> (out, lse)` with the case's sinks applied to out (every path over a selection returns
    the rows' log-sum-exp); `attend` itself without sinks."""
    sinks = case.sink_logits()
    if sinks is None:
        return attend

    def attend_with_sinks(selection):
        out, lse = attend(selection)
        return apply_sinks(out, lse, sinks), lse

    return attend_with_sinks
