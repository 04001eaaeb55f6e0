"""Decode through the split-key kernels (`kernels_decode.py`): when a case takes them, their plan, their launch.

A case is decode here when its few query rows (at most DECODE_MAX_ROWS, fewer than the keys: the last
positions of a longer sequence) and its GQA group fit one packed tile (G * q_len <= DECODE_MAX_PACKED), it needs
no gradient, and its score modification, if any, is the softcap (the bias modifications differ per query head,
and a tile of packed rows spans heads). Everything else goes through `launch.plan_attention`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from bench.registry import setup_phase
from impls.triton_block_sparse import launch
from impls.triton_block_sparse.mode import _is_interpreted, kernels
from impls.triton_block_sparse.score_mods import MOD_SOFTCAP, ModArgs

DECODE_MAX_ROWS = 16  # query rows: decode (1) and short chunks (speculative decoding's 2..16)
DECODE_MAX_PACKED = 128  # G * q_len rows in one tile
DECODE_TILE_M = 64  # the tables' query tile: every query row in one
# Candidates on a GPU: key tiles of 64 or 128, 4 or 8 warps. Each is a compile per (dtype, head_dim, mask kind).
DECODE_CONFIGS = (launch.TileConfig(DECODE_TILE_M, 128, 4, 3), launch.TileConfig(DECODE_TILE_M, 64, 4, 3),
                  launch.TileConfig(DECODE_TILE_M, 128, 8, 3))
PROGRAMS_PER_SM = 2  # splits enough for this many programs per multiprocessor
INTERPRETER_SPLITS = 3  # in the interpreter: several splits, so that the combine is exercised


@dataclass
class DecodePlan:
    kernel: launch.KernelPlan
    splits: int  # S: programs per (sequence, KV head)
    tiles_per_split: int
    packed_rows: int  # BLOCK_M of the kernel: G * q_len rounded up to a power of two (at least 16)
    interpreter: bool
    mod: ModArgs | None
    tuning: dict[str, Any]

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"interpreter": self.interpreter, "path": "decode (split keys)",
                               "splits": self.splits, "tiles_per_split": self.tiles_per_split,
                               "packed_rows": self.packed_rows, "fwd": self.kernel.describe()}
        if self.tuning:
            out["autotune_ms"] = self.tuning
        return out


def takes(pattern, q: Tensor, k: Tensor, needs_grad: bool, mod: ModArgs | None) -> bool:
    """Whether this case goes through the decode kernels (module docstring)."""
    nq, n = q.shape[2], k.shape[2]
    group = q.shape[1] // k.shape[1]
    return (not needs_grad and nq <= DECODE_MAX_ROWS and nq < n and group * nq <= DECODE_MAX_PACKED
            and (mod is None or mod.kind == MOD_SOFTCAP))


def _splits(key_tiles: int, programs: int, device: torch.device, interpreter: bool) -> tuple[int, int]:
    """(S, tiles per split): enough programs to fill the GPU, every split at least one tile."""
    if interpreter:
        wanted = INTERPRETER_SPLITS
    else:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        wanted = math.ceil(PROGRAMS_PER_SM * sms / max(1, programs))
    per_split = max(1, math.ceil(key_tiles / max(1, min(wanted, key_tiles))))
    return max(1, math.ceil(key_tiles / per_split)), per_split


def plan_decode(pattern, q: Tensor, k: Tensor, v: Tensor, mod: ModArgs | None) -> DecodePlan:
    """Tables for one query tile, the splits, and on a GPU the key tile chosen by timing each candidate."""
    interpreter = _is_interpreted(kernels())
    b, h, nq, _ = q.shape
    hkv = k.shape[1]
    packed = max(16, 1 << (h // hkv * nq - 1).bit_length())
    # in the interpreter one configuration, with the interpreter's large key tile (see launch.INTERPRETER_CONFIG)
    configs = ((launch.TileConfig(DECODE_TILE_M, launch.INTERPRETER_CONFIG.block_n, 4, 1),) if interpreter
               else DECODE_CONFIGS)
    base = launch.tbl.base_block([(c.block_m, c.block_n) for c in configs])

    def make(config: launch.TileConfig) -> DecodePlan:
        kernel = launch.kernel_plan(pattern, config, base, q.device)
        listed = kernel.tables.row_offsets[:2].tolist()  # one query tile: its key tiles (setup, not timed)
        splits, per_split = _splits(listed[1] - listed[0], b * hkv, q.device, interpreter)
        return DecodePlan(kernel, splits, per_split, packed, interpreter, mod, {})

    if interpreter:
        return make(configs[0])
    timings: dict[str, float | str] = {}
    best: tuple[float, DecodePlan] | None = None
    from triton.testing import do_bench

    with setup_phase("compile"), torch.cuda.device(q.device):
        for config in configs:
            plan = make(config)
            try:
                ms = float(do_bench(lambda plan=plan: run_decode(q, k, v, plan), warmup=launch.TUNE_WARMUP_MS,
                                    rep=launch.TUNE_REP_MS, return_mode="median"))
            except Exception as exc:  # a config the GPU cannot hold
                timings[config.label] = f"{type(exc).__name__}: {str(exc).strip()[:120]}"
                continue
            timings[config.label] = round(ms, 4)
            if best is None or ms < best[0]:
                best = (ms, plan)
    if best is None:
        raise RuntimeError(f"no decode tile configuration ran on this GPU: {timings}")
    best[1].tuning = {"decode": timings}
    return best[1]


def run_decode(q: Tensor, k: Tensor, v: Tensor, plan: DecodePlan) -> Tensor:
    """o (B, H, Nq, D) contiguous, in q's dtype: the splits, then their combination."""
    b, h, hkv, group, nq, n = launch._shapes(q, k)
    d = q.shape[-1]
    rows = b * h * nq
    o_part = torch.empty((plan.splits, rows, d), dtype=torch.float32, device=q.device)
    lse_part = torch.empty((plan.splits, rows), dtype=torch.float32, device=q.device)
    common = launch._common(plan.kernel, q, launch._dot_f32(q))
    common.update(TILE_M=plan.kernel.config.block_m, BLOCK_M=plan.packed_rows)
    t = plan.kernel.tables
    k_ = kernels()
    k_.attn_fwd_decode[(plan.splits, b * hkv)](
        q, k, v, o_part, lse_part, *q.stride(), *k.stride(), *v.stride(),
        t.row_offsets, t.row_full, t.row_cols, t.row_slots, t.mask_words,
        hkv, group, nq, n, launch.LOG2E / math.sqrt(d), plan.tiles_per_split, rows,
        **common, **(plan.mod or launch._NO_MOD).kwargs(q.device))
    o = torch.empty((b, h, nq, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((b * h, nq), dtype=torch.float32, device=q.device)
    k_.attn_decode_combine[(rows,)](o_part, lse_part, o, lse, plan.splits, rows,
                                    BLOCK_S=max(2, 1 << (plan.splits - 1).bit_length()), D=d,
                                    HEAD_DIM=launch.padded_head_dim(d))
    return o


def call_for(q: Tensor, k: Tensor, v: Tensor, plan: DecodePlan):
    """The timed call: forward only (decode needs no gradient, see `takes`)."""
    def call() -> Tensor:
        with launch._on_device(q):  # the GPU of the inputs, or in the interpreter numpy's BLAS on one thread
            return run_decode(q, k, v, plan)

    return call
