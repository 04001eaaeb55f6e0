"""The fused forward of `blocked` in bfloat16 and float16 on CPU: band windows through torch's fused kernel.

Without autograd the products and the softmax of a step need not be separate ops: torch's CPU flash kernel
(`aten::_scaled_dot_product_flash_attention_for_cpu`, the one behind dense sdpa on CPU) computes
softmax(scale Q K^T + mask) V tile by tile with the low-precision GEMMs (AMX), its scores never leaving the
cache, the softmax statistics and the running output in float32. Each run of query blocks (B*Hkv, R,
G*rows, D) goes in against its key windows (B*Hkv, R, span, D), overlapping views of K and V that the
kernel reads through their strides, with the band plan's masks as one dense additive mask per run of alike
blocks (one broadcast (G*rows, span) mask for the band's interior), built once per plan.

The kernel cuts a batch's query rows into tiles (32 rows below 192, 64 below 768, else 256) and repacks the
keys for each tile, so it wants many rows per window: `blocked` gives it a band plan of FUSED_ROWS rows per
query block (more keys per window, computed and masked, than its 64-row plan). Measured in bfloat16 (CPU
time, interleaved, loaded 2-core Xeon with AMX, N=4096): local W=256 H=8 D=64 69-97 ms against 113-135 ms
for the unfused 64-row steps; causal_local W=1024 153-213 against 210-269; at H=32, 8 KV heads, D=128:
239-335 against 321-396 (local) and 599-667 against 944-1096 (causal_local). With 64-row blocks it was no
faster than the unfused steps. Gathered blocks (a gather plan) measured 2-3x slower through this kernel (a
call per step of few rows), so they stay unfused; so does float32, where the unfused steps measured alike.
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

from impls.blocked.compute import _query_blocks, _window_segments
from impls.blocked.plan import BandPlan, BiasPiece

_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
FUSED_DTYPES = (torch.bfloat16, torch.float16)
FUSED_ROWS = 256  # query rows per block of the fused band plan (times G query heads per step)


def fused_available(q: Tensor) -> bool:
    """Whether inference on q's dtype and device goes through the fused kernel (where the plan is a band)."""
    return _FLASH is not None and q.device.type == "cpu" and q.dtype in FUSED_DTYPES


def _attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """q (B, X, L, D), k, v (B, X, S, D), mask (1, X or 1, L, S) or None -> (B, X, L, D)."""
    assert _FLASH is not None
    return _FLASH(q, k, v, 0.0, False, attn_mask=mask, scale=scale)[0]


def _dense_mask(pieces: list[BiasPiece], a: int, b: int, rows: int, keys: int, g: int, dtype: torch.dtype,
                device: torch.device) -> Tensor | None:
    """The pieces over blocks [a, b) as one additive mask (1, b - a or 1, g * rows, keys), or None without any.
    Every piece covers all of [a, b) or none of it (the caller cuts runs at the pieces' ends)."""
    cover = [p for p in pieces if p.r0 <= a and b <= p.r1]
    if not cover:
        return None
    per_block = any(p.bias.shape[0] > 1 for p in cover)
    mask = torch.zeros((b - a) if per_block else 1, rows, keys, dtype=dtype, device=device)
    for p in cover:
        bias = p.bias if p.bias.shape[0] == 1 else p.bias[a - p.r0 : b - p.r0]
        mask[:, :, p.c0 : p.c1] += bias.to(dtype)
    return mask.repeat(1, g, 1)[None]  # row g' * rows + t of the G stacked heads is row t's


def _band_runs(plan: BandPlan, bounds: set[int], g: int, dtype: torch.dtype, device: torch.device
               ) -> list[tuple[int, int, Tensor | None]]:
    """(a, b, mask) for runs of query blocks cut at `bounds` and at every piece's ends; cached on the plan."""
    key = (tuple(sorted(bounds)), g, dtype)
    cached = plan.fused_masks.get(key)
    if cached is None:
        cuts = sorted({0, plan.n_blocks, *bounds, *(r for p in plan.pieces for r in (p.r0, p.r1))})
        cuts = [c for c in cuts if 0 <= c <= plan.n_blocks]
        cached = [(a, b, _dense_mask(plan.pieces, a, b, plan.rows, plan.span, g, dtype, device))
                  for a, b in itertools.pairwise(cuts) if a < b]
        plan.fused_masks[key] = cached
    return cached


def band_fused(plan: BandPlan, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """band_forward's output (BHkv, G, nb*rb, D) by the fused kernel, without probabilities."""
    bk, g, _, d = q.shape
    rb, nb = plan.rows, plan.n_blocks
    rows = _query_blocks(q.to(k.dtype), nb, rb).transpose(1, 2).reshape(bk, nb, g * rb, d)  # view when G == 1
    ks, vs = _window_segments(k, plan), _window_segments(v, plan)
    out = k.new_empty(bk, nb, g * rb, d)
    for a, b, mask in _band_runs(plan, {s.r0 for s in ks} | {s.r1 for s in ks}, g, k.dtype, k.device):
        seg, v_seg = next((s, t) for s, t in zip(ks, vs, strict=True) if s.r0 <= a and b <= s.r1)
        out[:, a:b] = _attend(rows[:, a:b], seg.windows[:, a - seg.r0 : b - seg.r0],
                              v_seg.windows[:, a - seg.r0 : b - seg.r0], mask, plan.scale)
    return out.view(bk, nb, g, rb, d).transpose(1, 2).reshape(bk, g, nb * rb, d)
