"""The float64 oracle: what correct attention is, for every implementation and every pattern.

Attention is computed from the pattern's predicate over query rows in chunks, so the oracle's memory stays
bounded whatever N is. Above a size limit only a seeded sample of query rows is checked (the first and
last rows always among them) and `rows_checked` says how many. The oracle is differentiable (float64
autograd), which is how gradients are checked: the upstream gradient is zero outside the checked rows, so
dq, dk and dv of the full problem equal those of the sampled one exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from bench.patterns import Pattern, ScoreMod

# Relative L2 error tolerated per input dtype (docs/DESIGN.md); NaN never passes.
TOLERANCE = {"float32": 1e-4, "float32_tf32": 2e-3, "float16": 5e-3, "bfloat16": 2e-2}

# Above this many score elements (B * H * q_len * N) only a sample of query rows is checked, about this many
# elements' worth (at least 64 rows). At 2**26 the check took 2-6 s a case at N >= 4096 on a 2-core CPU, up to a
# third of the case's time; a quarter of that still finds a fault confined to one 64-row block of 4096 rows
# with probability 1 - (63/64)**512 > 99.9%.
FULL_CHECK_LIMIT = 2**24
# Bytes of float64 scores one chunk of query rows may hold.
CHUNK_BYTES = 2**27


def tolerance_for(dtype: str, tf32: bool = False) -> float:
    return TOLERANCE["float32_tf32"] if dtype == "float32" and tf32 else TOLERANCE[dtype]


def rows_to_check(batch: int, heads: int, seq_len: int, seed: int = 0,
                  limit: int = FULL_CHECK_LIMIT, q_len: int | None = None) -> Tensor:
    """Sorted int64 query rows the oracle checks: all q_len of them, or a seeded sample above `limit`."""
    rows = seq_len if q_len is None else q_len
    if batch * heads * rows * seq_len <= limit or rows <= 2:
        return torch.arange(rows)
    count = max(64, limit // (batch * heads * seq_len))
    gen = torch.Generator().manual_seed(seed)
    inner = torch.randperm(rows - 2, generator=gen)[: max(0, count - 2)] + 1
    return torch.unique(torch.cat([torch.tensor([0, rows - 1]), inner]))


def check_shapes(q: Tensor, k: Tensor, v: Tensor, pattern: Pattern) -> None:
    """ValueError naming what is wrong: q (B, H, q_len, D), k and v (B, Hkv, seq_len, D), H % Hkv == 0."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (B, H, N, D), got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape (B, Hkv, N, D), got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    b, h, nq, d = q.shape
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share batch and head_dim: q is "
                         "(B, H, q_len, D), k and v (B, Hkv, seq_len, D)")
    if k.shape[1] < 1 or h % k.shape[1]:
        raise ValueError(f"q has {h} heads and k, v have {k.shape[1]}; grouped-query attention needs the query "
                         "heads to be a multiple of the KV heads")
    if k.shape[2] != pattern.seq_len:
        raise ValueError(f"k and v have N={k.shape[2]} but the pattern was made for seq_len={pattern.seq_len}")
    if nq != pattern.q_len:
        raise ValueError(f"q has {nq} rows but the pattern was made for q_len={pattern.q_len} (seq_len "
                         f"{pattern.seq_len}); q holds the last q_len positions")


# A mask beyond the pattern's, per (batch, head): rows (c,) -> bool (B, H, c, N) (a selection's effective mask).
RowMask = Callable[[Tensor], Tensor]


def reference_chunks(q: Tensor, k: Tensor, pattern: Pattern, rows: Tensor | None = None,
                     extra_mask: RowMask | None = None, score_mod: ScoreMod | None = None
                     ) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
    """The oracle's float64 attention weights, chunk by chunk of query `rows` (default: all): yields
    (r, weights, lse) with r the chunk's rows (c,), weights (B, H, c, N), zero on masked keys (a row with no
    allowed key is all zeros), and lse (B, H, c) the log-sum-exp of the row's allowed scaled scores (-inf for a
    row without keys). `extra_mask` narrows the pattern per (batch, head); `score_mod` modifies the scaled scores
    before the mask (its tables in float64). Differentiable in q and k."""
    check_shapes(q, k, k, pattern)
    b, h, nq, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    group = h // hkv
    device = q.device
    rows = torch.arange(nq) if rows is None else rows.to(torch.int64).cpu()
    q64, k64 = q.double(), k.double()
    keys = torch.arange(n)
    scale = 1.0 / math.sqrt(d)
    chunk = max(1, CHUNK_BYTES // (8 * b * h * n))
    mod = None if score_mod is None else score_mod.for_device(device, torch.float64)
    heads = torch.arange(h)[:, None, None]
    for start in range(0, len(rows), chunk):
        r = rows[start : start + chunk]
        c = len(r)
        mask = pattern.mask(r[:, None], keys[None, :]).to(device)  # (c, N)
        if extra_mask is not None:
            mask = mask & extra_mask(r).to(device)  # (B, H, c, N)
        # The query heads of one KV head share its keys: (B, Hkv, G*c, D) against (B, Hkv, N, D), no copy of K.
        qg = q64[:, :, r.to(device)].reshape(b, hkv, group * c, d)
        scores = (torch.matmul(qg, k64.transpose(-1, -2)) * scale).view(b, h, c, n)
        if mod is not None:  # on absolute positions: row r is position r + seq_len - q_len
            scores = mod.apply(scores, heads, (r + (pattern.seq_len - pattern.q_len))[:, None], keys[None, :])
        scores = scores.masked_fill(~mask, -math.inf)
        peak = scores.amax(dim=-1, keepdim=True).detach()
        peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
        weights = torch.exp(scores - peak)  # exp(-inf) = 0: masked keys and empty rows get no weight
        denom = weights.sum(dim=-1, keepdim=True)
        lse = torch.where(denom > 0, peak + denom.clamp_min(1e-300).log(), -math.inf).squeeze(-1)
        yield r, weights / torch.where(denom > 0, denom, torch.ones_like(denom)), lse


def reference_weights(q: Tensor, k: Tensor, pattern: Pattern, rows: Tensor | None = None,
                      extra_mask: RowMask | None = None) -> Iterator[tuple[Tensor, Tensor]]:
    """`reference_chunks` without the log-sum-exp: yields (rows (c,), weights (B, H, c, N))."""
    for r, weights, _ in reference_chunks(q, k, pattern, rows, extra_mask):
        yield r, weights


def reference_attention(q: Tensor, k: Tensor, v: Tensor, pattern: Pattern, rows: Tensor | None = None,
                        extra_mask: RowMask | None = None, score_mod: ScoreMod | None = None,
                        sinks: Tensor | None = None) -> Tensor:
    """Attention in float64 for query `rows` (default: all): (B, H, len(rows), D).

    q (B, H, q_len, D), k and v (B, Hkv, seq_len, D) of any float dtype and device, query head h reading KV
    head h // (H / Hkv); the result is float64 on the same device. A query row with no allowed key gives
    zeros. Differentiable with respect to q, k, v (dk, dv summed over each KV head's query group). `sinks` (H,):
    one logit per query head joining each row's softmax with a zero value vector (`with_sinks`).
    """
    return reference_attention_lse(q, k, v, pattern, rows, extra_mask, score_mod, sinks)[0]


def with_sinks(out: Tensor, lse: Tensor, sinks: Tensor | None) -> Tensor:
    """`out` (B, H, rows, D) with one sink logit per query head (H,) joined to each row's softmax, its value
    vector zero: out * sigmoid(lse - sink), lse the row's log-sum-exp without the sink (an empty row stays 0)."""
    if sinks is None:
        return out
    sink = sinks.to(device=lse.device, dtype=lse.dtype)[None, :, None]
    return out * torch.sigmoid(lse - sink).unsqueeze(-1).to(out.dtype)


def reference_attention_lse(q: Tensor, k: Tensor, v: Tensor, pattern: Pattern, rows: Tensor | None = None,
                            extra_mask: RowMask | None = None, score_mod: ScoreMod | None = None,
                            sinks: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(`reference_attention`'s output, its log-sum-exp (B, H, len(rows)) in float64, -inf for empty rows; with
    `sinks` the output has them and the log-sum-exp is still that of the row's own keys)."""
    check_shapes(q, k, v, pattern)
    b, h, _, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    group = h // hkv
    v64 = v.double()
    outs, lses = [], []
    for r, weights, lse in reference_chunks(q, k, pattern, rows, extra_mask, score_mod):
        c = len(r)
        out = torch.matmul(weights.reshape(b, hkv, group * c, n), v64).view(b, h, c, d)
        outs.append(with_sinks(out, lse, sinks))
        lses.append(lse)
    if not outs:
        return q.double().new_zeros(b, h, 0, d), q.double().new_zeros(b, h, 0)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


@dataclass(frozen=True)
class ErrorStats:
    max_abs: float | None  # None when the output holds NaN or Inf
    rel_l2: float | None
    tolerance: float
    rows_checked: int
    nonfinite: int = 0  # NaN or Inf elements in the checked rows
    max_rel: float | None = None  # the elementwise maximum of |error| / (|expected| + ELEMENT_EPS)

    @property
    def passed(self) -> bool:
        return self.nonfinite == 0 and self.rel_l2 is not None and self.rel_l2 <= self.tolerance


# The elementwise relative error's guard against a zero expected value: FlashInfer-Bench's (its
# bench/utils.py compute_error_stats), so that `max_rel` is the figure its traces call max_relative_error.
ELEMENT_EPS = 1e-8


def float64_grads(q: Tensor, k: Tensor, v: Tensor, upstream: Tensor,
                  attend: Callable[[Tensor, Tensor, Tensor], Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of `attend` (the oracle on float64 copies of q, k, v, over the checked rows) for `upstream`, the
    upstream gradient of those rows: the one float64 backward the check, a selection's check and the fidelity
    share."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    dq, dk, dv = torch.autograd.grad(attend(q64, k64, v64), (q64, k64, v64), upstream.double())
    return dq, dk, dv


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
    max_rel = float((diff.abs() / (e.abs() + ELEMENT_EPS)).max()) if diff.numel() else 0.0
    return ErrorStats(max_abs, rel, tolerance, rows, 0, max_rel)
