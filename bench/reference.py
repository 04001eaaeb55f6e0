"""The float64 oracle: what correct attention is, for every implementation and every pattern.

Attention is computed from the pattern's predicate over query rows in chunks, so the oracle's memory stays
bounded whatever N is. Above a size limit only a seeded sample of query rows is checked (the first and
last rows always among them) and `rows_checked` says how many. The oracle is differentiable (float64
autograd), which is how gradients are checked: the upstream gradient is zero outside the checked rows, so
dq, dk and dv of the full problem equal those of the sampled one exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from bench.patterns import Pattern

# Relative L2 error tolerated per input dtype (DESIGN.md); NaN never passes.
TOLERANCE = {"float32": 1e-4, "float32_tf32": 2e-3, "float16": 5e-3, "bfloat16": 2e-2}

# Above this many score elements (B * H * N * N) only a sample of query rows is checked.
FULL_CHECK_LIMIT = 2**26
# Bytes of float64 scores one chunk of query rows may hold.
CHUNK_BYTES = 2**27


def tolerance_for(dtype: str, tf32: bool = False) -> float:
    return TOLERANCE["float32_tf32"] if dtype == "float32" and tf32 else TOLERANCE[dtype]


def rows_to_check(batch: int, heads: int, seq_len: int, seed: int = 0,
                  limit: int = FULL_CHECK_LIMIT) -> Tensor:
    """Sorted int64 query rows the oracle checks: all of them, or a seeded sample above `limit`."""
    if batch * heads * seq_len * seq_len <= limit:
        return torch.arange(seq_len)
    count = max(64, limit // (batch * heads * seq_len))
    gen = torch.Generator().manual_seed(seed)
    inner = torch.randperm(seq_len - 2, generator=gen)[: max(0, count - 2)] + 1
    return torch.unique(torch.cat([torch.tensor([0, seq_len - 1]), inner]))


def reference_attention(q: Tensor, k: Tensor, v: Tensor, pattern: Pattern, rows: Tensor | None = None) -> Tensor:
    """Attention in float64 for query `rows` (default: all): (B, H, len(rows), D).

    q, k, v: (B, H, N, D) of any float dtype and device; the result is float64 on the same device.
    A query row with no allowed key gives zeros. Differentiable with respect to q, k, v.
    """
    b, h, n, d = q.shape
    if k.shape != (b, h, n, d) or v.shape != (b, h, n, d):
        raise ValueError(f"q, k, v must share the shape (B, H, N, D); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if n != pattern.seq_len:
        raise ValueError(f"inputs have N={n} but the pattern is for seq_len={pattern.seq_len}")
    device = q.device
    rows = torch.arange(n) if rows is None else rows.to(torch.int64).cpu()
    q64, k64, v64 = q.double(), k.double(), v.double()
    keys = torch.arange(n)
    scale = 1.0 / math.sqrt(d)
    chunk = max(1, CHUNK_BYTES // (8 * b * h * n))
    outs = []
    for start in range(0, len(rows), chunk):
        r = rows[start : start + chunk]
        mask = pattern.allowed(r[:, None], keys[None, :]).to(device)  # (c, N)
        scores = torch.matmul(q64[:, :, r.to(device)], k64.transpose(-1, -2)) * scale  # (B, H, c, N)
        scores = scores.masked_fill(~mask, -math.inf)
        peak = scores.amax(dim=-1, keepdim=True).detach()
        peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
        weights = torch.exp(scores - peak)  # exp(-inf) = 0: masked keys and empty rows get no weight
        denom = weights.sum(dim=-1, keepdim=True)
        weights = weights / torch.where(denom > 0, denom, torch.ones_like(denom))
        outs.append(torch.matmul(weights, v64))
    return torch.cat(outs, dim=2) if outs else q64.new_zeros(b, h, 0, d)


@dataclass(frozen=True)
class ErrorStats:
    max_abs: float | None  # None when the output holds NaN or Inf
    rel_l2: float | None
    tolerance: float
    rows_checked: int
    nonfinite: int = 0  # NaN or Inf elements in the checked rows

    @property
    def passed(self) -> bool:
        return self.nonfinite == 0 and self.rel_l2 is not None and self.rel_l2 <= self.tolerance


def compare(actual: Tensor, expected: Tensor, tolerance: float) -> ErrorStats:
    """Error of `actual` against the oracle's `expected` (same shape, rows along dim 2)."""
    a = actual.detach().to(torch.float64)
    e = expected.detach().to(device=a.device)
    nonfinite = int((~torch.isfinite(a)).sum())
    rows = a.shape[2] if a.dim() == 4 else a.shape[0]
    if nonfinite:
        return ErrorStats(None, None, tolerance, rows, nonfinite)
    diff = a - e
    norm = float(torch.linalg.vector_norm(e))
    err = float(torch.linalg.vector_norm(diff))
    rel = err / norm if norm > 0 else err  # all-empty rows: the expected output is exactly zero
    max_abs = float(diff.abs().max()) if diff.numel() else 0.0
    return ErrorStats(max_abs, rel, tolerance, rows, 0)
