"""Launching the kernels: tile configurations and their autotuning, autograd.

`plan_attention` does the untimed work of a case - lookup tables, mask choice, and on a GPU the choice of tile
configuration per kernel by timing each candidate - and `BlockSparseAttention.apply(q, k, v, plan)` is the
timed, differentiable call. Interpreter or compiled: `mode`.
"""

from __future__ import annotations

import contextlib
import math
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from bench.registry import setup_phase
from impls.triton_block_sparse import tables as tbl
from impls.triton_block_sparse.mode import _is_interpreted, kernels, uses_interpreter
from impls.triton_block_sparse.score_mods import ModArgs

_NO_MOD = ModArgs()

LOG2E = 1.4426950408889634  # exp(x) = exp2(x * log2(e)): the kernels use exp2
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 128  # tl.dot needs K >= 16; above 128 the tiles outgrow shared memory
MAX_GRID_Y = 65535  # CUDA's limit on grid dimension y, which carries B * H (B * Hkv for dK/dV)


@dataclass(frozen=True)
class TileConfig:
    """A tile shape and launch parameters. block_m: query rows per tile; block_n: keys per tile."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    @property
    def label(self) -> str:
        return f"m{self.block_m}n{self.block_n}w{self.num_warps}s{self.num_stages}"


# Candidates on a GPU, after the Triton tutorial 06 (forward: 64..128 x 64..128 tiles, 4 or 8 warps, 3
# stages; backward: dK/dV over 32-row query tiles against 128 keys, dQ its transpose). Each kernel is tuned
# alone. Three each: every candidate is a compile per (dtype, head_dim, mask kind), which the GPU check's
# time budget pays for.
FWD_CONFIGS = (TileConfig(128, 64, 4, 3), TileConfig(128, 128, 8, 3), TileConfig(64, 64, 4, 3))
DKDV_CONFIGS = (TileConfig(32, 128, 4, 3), TileConfig(64, 64, 4, 3), TileConfig(64, 128, 8, 3))
DQ_CONFIGS = (TileConfig(128, 32, 4, 3), TileConfig(64, 64, 4, 3), TileConfig(128, 64, 8, 3))
# In the interpreter one config per kernel and no timing loop. Each tile step costs ~100 interpreted
# operations whatever its size, so large tiles are fastest: the conformance tests take ~40% less CPU time at
# 128 than at 64 (N 97..257). Small tiles, and so many partial and skipped ones, are tested separately.
INTERPRETER_CONFIG = TileConfig(128, 128, 4, 1)
PREPROCESS_BLOCK = 64
TUNE_WARMUP_MS, TUNE_REP_MS = 5, 25  # triton.testing.do_bench per candidate: enough to rank tile shapes

def padded_head_dim(head_dim: int) -> int:
    return max(MIN_HEAD_DIM, 1 << (head_dim - 1).bit_length())


# --- plans: what a case needs prepared ----------------------------------------------------------------------

@dataclass
class KernelPlan:
    """One kernel's tile configuration, its tables (on the inputs' device) and its mask."""

    config: TileConfig
    tables: tbl.TileTables
    mask: tbl.MaskSpec

    def describe(self) -> dict[str, Any]:
        t = self.tables
        return {**asdict(self.config), "mask": self.mask.name, "tiles_full": t.n_full,
                "tiles_partial": t.n_partial, "query_tiles": len(t.row_full), "key_tiles": len(t.col_full)}


@dataclass
class Plan:
    fwd: KernelPlan
    dkdv: KernelPlan | None  # None when no gradient is needed
    dq: KernelPlan | None
    interpreter: bool
    tuning: dict[str, Any]  # per kernel: median ms per candidate, or why it failed
    q_len: int | None = None  # the pattern's query rows and keys (q_len < seq_len: the last positions)
    seq_len: int | None = None
    kv_group: int = 1  # query heads per KV head (GQA), read from the inputs at the call
    mod: ModArgs | None = None  # the score modification the kernels apply (None: none)

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"interpreter": self.interpreter, "q_len": self.q_len, "seq_len": self.seq_len,
                               "kv_group": self.kv_group, "fwd": self.fwd.describe()}
        if self.dkdv is not None and self.dq is not None:
            out["bwd_dkdv"] = self.dkdv.describe()
            out["bwd_dq"] = self.dq.describe()
        if self.tuning:
            out["autotune_ms"] = self.tuning
        return out


def pattern_key(pattern) -> tuple:
    """What a pattern's tables depend on: its class, its matrix (seq_len, q_len, documents) and every field."""
    return (type(pattern), pattern.label, pattern.seq_len, pattern.q_len, pattern.documents,
            tuple(sorted(pattern.field_values().items())))


class _TableCache:
    """Tables by (pattern, tile shape, bitmasks, device); a few entries, oldest dropped first."""

    def __init__(self, size: int = 24) -> None:
        self.size = size
        self._entries: OrderedDict[tuple, tbl.TileTables] = OrderedDict()

    def get(self, pattern, config: TileConfig, with_bits: bool, base: int, device: torch.device) -> tbl.TileTables:
        key = (pattern_key(pattern), config.block_m, config.block_n, with_bits, str(device))
        if key not in self._entries:
            view = pattern.block_sparse(base)
            self._entries[key] = tbl.build_tables(view, config.block_m, config.block_n, with_bits).to(device)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)
        return self._entries[key]


TABLES = _TableCache()
_TUNED: dict[tuple, tuple[TileConfig, dict[str, float | str]]] = {}


def kernel_plan(pattern, config: TileConfig, base: int, device: torch.device) -> KernelPlan:
    mask = tbl.mask_spec(pattern, [(config.block_m, config.block_n)])
    with setup_phase("mask"):  # the tile tables and bitmasks
        tables = TABLES.get(pattern, config, mask.kind == tbl.MASK_BITS, base, device)
    return KernelPlan(config, tables, mask)


def plan_with_configs(pattern, q: Tensor, fwd: TileConfig, dkdv: TileConfig | None = None,
                      dq: TileConfig | None = None, k: Tensor | None = None) -> Plan:
    """A plan with the given tile configurations (no tuning); backward configs None for forward only.

    q (B, H, q_len, D) gives the device; k (B, Hkv, N, D), when given, the GQA group recorded in `describe`.
    """
    used = [c for c in (fwd, dkdv, dq) if c is not None]
    base = tbl.base_block([(c.block_m, c.block_n) for c in used])
    plans = [None if c is None else kernel_plan(pattern, c, base, q.device) for c in (dkdv, dq)]
    return Plan(kernel_plan(pattern, fwd, base, q.device), plans[0], plans[1], _is_interpreted(kernels()), {},
                **_shape_info(pattern, q, k))


def _shape_info(pattern, q: Tensor, k: Tensor | None) -> dict[str, int]:
    group = 1 if k is None else q.shape[1] // k.shape[1]
    return {"q_len": pattern.q_len, "seq_len": pattern.seq_len, "kv_group": group}


def plan_attention(pattern, q: Tensor, k: Tensor, v: Tensor, needs_grad: bool, mod: ModArgs | None = None) -> Plan:
    """Tables, masks and (on a GPU) autotuned tile configurations for attention of q, k, v under `pattern`, with
    the score modification `mod` (tuned with it: its cost is the kernels')."""
    if _is_interpreted(kernels()):
        cfg = INTERPRETER_CONFIG
        plan = plan_with_configs(pattern, q, cfg, cfg if needs_grad else None, cfg if needs_grad else None, k)
        plan.mod = mod
        return plan

    device = q.device
    candidates = FWD_CONFIGS + (DKDV_CONFIGS + DQ_CONFIGS if needs_grad else ())
    base = tbl.base_block([(c.block_m, c.block_n) for c in candidates])
    tuning: dict[str, Any] = {}
    shape_key = (pattern_key(pattern), tuple(q.shape), tuple(k.shape), str(q.dtype), str(device))
    info = _shape_info(pattern, q, k)
    with _on_device(q):
        fwd = _tune("fwd", FWD_CONFIGS, shape_key, tuning, pattern, base, device,
                    lambda plan: run_forward(q, k, v, plan, mod))
        if not needs_grad:
            return Plan(fwd, None, None, False, tuning, **info, mod=mod)
        o, lse = run_forward(q, k, v, fwd, mod)
        gen = torch.Generator(device=device).manual_seed(0)
        do = torch.randn(o.shape, generator=gen, device=device, dtype=torch.float32).to(o.dtype)
        delta = run_preprocess(o, do)
        dkdv = _tune("bwd_dkdv", DKDV_CONFIGS, shape_key, tuning, pattern, base, device,
                     lambda plan: run_dkdv(q, k, v, do, lse, delta, plan, mod))
        dq = _tune("bwd_dq", DQ_CONFIGS, shape_key, tuning, pattern, base, device,
                   lambda plan: run_dq(q, k, v, do, lse, delta, plan, mod))
    return Plan(fwd, dkdv, dq, False, tuning, **info, mod=mod)


def _tune(kernel: str, configs: tuple[TileConfig, ...], shape_key: tuple, tuning: dict[str, Any], pattern,
          base: int, device: torch.device, run) -> KernelPlan:
    """The fastest of `configs` for one kernel, by triton.testing.do_bench; remembered per case shape."""
    key = (kernel, *shape_key)
    if key in _TUNED:  # tuned earlier in this process (same pattern and shapes): keep its choice
        config, tuning[kernel] = _TUNED[key]
        return kernel_plan(pattern, config, base, device)
    timings: dict[str, float | str] = {}
    with setup_phase("compile"):  # autotuning: each candidate compiled and timed (its tables count as mask)
        best = _tune_candidates(configs, pattern, base, device, run, timings)
    tuning[kernel] = timings
    if best is None:
        raise RuntimeError(f"no {kernel} tile configuration ran on this GPU: {timings}")
    _TUNED[key] = (best[1].config, timings)
    return best[1]


def _tune_candidates(configs: tuple[TileConfig, ...], pattern, base: int, device: torch.device, run,
                     timings: dict[str, float | str]) -> tuple[float, KernelPlan] | None:
    """(median ms, plan) of the fastest candidate that runs; every candidate's time or error in `timings`."""
    from triton.testing import do_bench

    best: tuple[float, KernelPlan] | None = None
    for config in configs:
        plan = kernel_plan(pattern, config, base, device)
        try:
            ms = float(do_bench(lambda plan=plan: run(plan), warmup=TUNE_WARMUP_MS, rep=TUNE_REP_MS,
                                return_mode="median"))
        except Exception as exc:  # a config the GPU cannot hold (shared memory, registers) is skipped
            timings[config.label] = f"{type(exc).__name__}: {str(exc).strip()[:120]}"
            continue
        timings[config.label] = round(ms, 4)
        if best is None or ms < best[0]:
            best = (ms, plan)
    return best


_blas_controller: Any = None


@contextlib.contextmanager
def _on_device(t: Tensor):
    """Launch context: the tensor's GPU, or in the interpreter numpy's BLAS held to one thread.

    The interpreter multiplies each tile with numpy; BLAS threads woken for (64 x 64) products cost more than
    they save (several times the whole kernel on a busy 2-core machine).
    """
    global _blas_controller
    if t.device.type == "cuda" and not uses_interpreter():
        with torch.cuda.device(t.device):
            yield
        return
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:  # optional: only the interpreter's speed depends on it
        yield
        return
    if _blas_controller is None:
        _blas_controller = ThreadpoolController()
    with _blas_controller.limit(limits=1, user_api="blas"):
        yield


# --- launches -------------------------------------------------------------------------------------------------

def _common(plan: KernelPlan, q: Tensor, interpreter_bf16: bool) -> dict[str, Any]:
    m, t, c = plan.mask, plan.tables, plan.config
    d = q.shape[-1]
    return dict(q_offset=m.q_offset, band_lo=m.band_lo, band_hi=m.band_hi, dilation=m.dilation,
                global_rows=m.global_rows, global_cols=m.global_cols, global_lo=m.global_lo, period=m.period,
                MASK_KIND=m.kind, HAS_DILATION=m.dilation > 1, HAS_GLOBAL=m.has_global, WORDS=t.words,
                BLOCK_M=c.block_m, BLOCK_N=c.block_n, D=d, HEAD_DIM=padded_head_dim(d), DOT_F32=interpreter_bf16,
                num_warps=c.num_warps, num_stages=c.num_stages)


def _dot_f32(q: Tensor) -> bool:
    """bfloat16 in the interpreter multiplies in float32 (see the DOT_F32 note in kernels.py)."""
    return q.dtype == torch.bfloat16 and _is_interpreted(kernels())


def _shapes(q: Tensor, k: Tensor) -> tuple[int, int, int, int, int, int]:
    """(B, H, Hkv, G, Nq, N) of q (B, H, Nq, D) and k (B, Hkv, N, D): query head h reads KV head h // G."""
    b, h, nq, _ = q.shape
    hkv, n = k.shape[1], k.shape[2]
    if h % hkv:
        raise ValueError(f"q has {h} heads and k {hkv}: grouped-query attention needs a multiple")
    return b, h, hkv, h // hkv, nq, n


def run_forward(q: Tensor, k: Tensor, v: Tensor, plan: KernelPlan, mod: ModArgs | None = None
                ) -> tuple[Tensor, Tensor]:
    """(o (B, H, Nq, D) contiguous, lse (B*H, Nq) float32 base-2 log-sum-exp of the scaled scores)."""
    b, h, _, group, nq, n = _shapes(q, k)
    d = q.shape[-1]
    o = torch.empty((b, h, nq, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((b * h, nq), dtype=torch.float32, device=q.device)
    t = plan.tables
    grid = (math.ceil(nq / plan.config.block_m), b * h)
    kernels().attn_fwd[grid](q, k, v, o, lse, *q.stride(), *k.stride(), *v.stride(),
                             t.row_offsets, t.row_full, t.row_cols, t.row_slots, t.mask_words,
                             h, group, nq, n, LOG2E / math.sqrt(d), **_common(plan, q, _dot_f32(q)),
                             **(mod or _NO_MOD).kwargs(q.device))
    return o, lse


def run_preprocess(o: Tensor, do: Tensor) -> Tensor:
    """delta = rowsum(o * do) in float32, (B*H, Nq); o and do contiguous (B, H, Nq, D)."""
    b, h, nq, d = o.shape
    delta = torch.empty((b * h, nq), dtype=torch.float32, device=o.device)
    grid = (math.ceil(nq / PREPROCESS_BLOCK), b * h)
    kernels().attn_bwd_preprocess[grid](o, do, delta, nq, BLOCK_M=PREPROCESS_BLOCK, D=d,
                                        HEAD_DIM=padded_head_dim(d))
    return delta


def run_dkdv(q: Tensor, k: Tensor, v: Tensor, do: Tensor, lse: Tensor, delta: Tensor,
             plan: KernelPlan, mod: ModArgs | None = None) -> tuple[Tensor, Tensor]:
    """dk, dv (B, Hkv, N, D) contiguous: each KV head's program sums over its G query heads."""
    b, _, hkv, group, nq, n = _shapes(q, k)
    d = q.shape[-1]
    dk = torch.empty((b, hkv, n, d), dtype=k.dtype, device=k.device)
    dv = torch.empty((b, hkv, n, d), dtype=v.dtype, device=v.device)
    t = plan.tables
    grid = (math.ceil(n / plan.config.block_n), b * hkv)
    kernels().attn_bwd_dkdv[grid](q, k, v, do, dk, dv, lse, delta, *q.stride(), *k.stride(), *v.stride(),
                                  t.col_offsets, t.col_full, t.col_rows, t.col_slots, t.mask_words,
                                  hkv, group, nq, n, 1.0 / math.sqrt(d), LOG2E / math.sqrt(d),
                                  **_common(plan, q, _dot_f32(q)), **(mod or _NO_MOD).kwargs(q.device))
    return dk, dv


def run_dq(q: Tensor, k: Tensor, v: Tensor, do: Tensor, lse: Tensor, delta: Tensor, plan: KernelPlan,
           mod: ModArgs | None = None) -> Tensor:
    """dq (B, H, Nq, D) contiguous."""
    b, h, _, group, nq, n = _shapes(q, k)
    d = q.shape[-1]
    dq = torch.empty((b, h, nq, d), dtype=q.dtype, device=q.device)
    t = plan.tables
    grid = (math.ceil(nq / plan.config.block_m), b * h)
    kernels().attn_bwd_dq[grid](q, k, v, do, dq, lse, delta, *q.stride(), *k.stride(), *v.stride(),
                                t.row_offsets, t.row_full, t.row_cols, t.row_slots, t.mask_words,
                                h, group, nq, n, 1.0 / math.sqrt(d), LOG2E / math.sqrt(d),
                                **_common(plan, q, _dot_f32(q)), **(mod or _NO_MOD).kwargs(q.device))
    return dq


def forward_with_lse(q: Tensor, k: Tensor, v: Tensor, plan: Plan) -> tuple[Tensor, Tensor]:
    """Inference: (o (B, H, Nq, D), the rows' natural log-sum-exp (B, H, Nq) float32, -inf on rows without a key),
    what learned sinks merge through."""
    with _on_device(q):
        o, lse2 = run_forward(q, k, v, plan.fwd, plan.mod)
    lse = torch.where(torch.isinf(lse2), -math.inf, lse2 * math.log(2.0))  # the kernel's rows without keys: +inf
    return o, lse.view(q.shape[0], q.shape[1], q.shape[2])


class BlockSparseAttention(torch.autograd.Function):
    """Differentiable block-sparse attention: forward saves O and the LSE, backward runs the two passes."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, plan: Plan) -> Tensor:
        if plan.q_len is not None and (q.shape[2], k.shape[2]) != (plan.q_len, plan.seq_len):
            raise ValueError(f"this plan is for {plan.q_len} query rows over {plan.seq_len} keys; got q "
                             f"{tuple(q.shape)} and k {tuple(k.shape)}")
        with _on_device(q):
            o, lse = run_forward(q, k, v, plan.fwd, plan.mod)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.plan = plan
        return o

    @staticmethod
    def backward(ctx, do: Tensor):
        q, k, v, o, lse = ctx.saved_tensors
        plan: Plan = ctx.plan
        if plan.dkdv is None or plan.dq is None:
            raise RuntimeError("this attention call was prepared without gradients (no tensor required grad)")
        do = do.contiguous()
        with _on_device(q):
            delta = run_preprocess(o, do)
            dk, dv = run_dkdv(q, k, v, do, lse, delta, plan.dkdv, plan.mod)
            dq = run_dq(q, k, v, do, lse, delta, plan.dq, plan.mod)
        return dq, dk, dv, None
