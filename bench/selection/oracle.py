"""The reference selectors: exact masses of dense attention, the best any selector of a budget can do.

`oracle_topk` keeps, for each (batch, selection head, query unit), the `budget` key units with the largest summed
softmax mass of dense attention under the base pattern over the unit's query rows (summed over the query heads
that share the selection). For that count it maximises the mean recall of those rows: the yardstick of every
record's `fidelity.oracle_recall`, which the harness computes at the selector's own units, sharing and counts
(`oracle_topk_indices`). `oracle_topp` keeps the fewest units whose mass reaches `threshold` of the unit's total
(top-p, as XAttention's threshold is meant to).

Both compute the dense scores, q.k/sqrt(D) in float32, in chunks of query units, over the keys each chunk may
attend to: they cost about as much as dense attention, and stand apart from the fast selectors as the oracle does
from the implementations. Where a query unit's float32 masses leave a near tie at the boundary of what it keeps
(`mass_error_bound`: how far float32 can be from the exact masses, from the scores' magnitude and head_dim), its
masses are computed again in float64 before choosing, so that rounding never decides what the yardstick keeps:
both agree with an all-float64 oracle.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from bench.selection.base import selection_heads
from bench.selection.registry import register_selector
from bench.selection.units import allowed_units, budget_counts, topk_indices

CHUNK_ELEMENTS = 1 << 26  # float32 scores held at once (B * H * rows * N)
# float32's unit roundoff: every rounded operation is exact to within this share of its result
UNIT_ROUNDOFF = 2.0**-24
# Masses below this share of the query unit's total (far above float32's subnormals, where a relative bound no
# longer holds, and exp's underflow to 0) count as equal whenever they are this close.
TIE_FLOOR = 1e-30
# Query units are taken in at least this many chunks, each over the span of keys its rows may attend to: a causal
# pattern's chunks then skip about half the keys, a window's all but its band.
SPAN_CHUNKS = 8


def _key_span(mask: Tensor, kv_unit: int, n: int) -> tuple[int, int]:
    """[lo, hi) of the keys any row of `mask` (c, N) allows, widened to whole key units (hi may pass N)."""
    cols = mask.any(dim=0).nonzero()
    if cols.numel() == 0:
        return 0, 0
    lo, hi = int(cols[0]), int(cols[-1]) + 1
    return lo // kv_unit * kv_unit, math.ceil(hi / kv_unit) * kv_unit


def unit_masses(q: Tensor, k: Tensor, pattern: Any, q_unit: int, kv_unit: int, shared: str,
                units: Tensor | None = None, dtype: torch.dtype = torch.float32
                ) -> Iterator[tuple[Tensor, Tensor]]:
    """Yields (query units (u,), masses (B, H_sel, u, KU) in `dtype`): dense attention's mass per key unit, summed
    over each unit's rows and the heads that share a selection; `units` (sorted) limits the query units.

    Per chunk of query units only the span of keys its rows may attend to is computed (a causal chunk skips the
    keys after it, a window all but its band), and the probabilities are made in place: exp(s - max) per row,
    summed per key unit, each row divided by its sum."""
    b, h, q_len, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    group = h // hkv
    q_units, kv_units = math.ceil(q_len / q_unit), math.ceil(n / kv_unit)
    units = torch.arange(q_units) if units is None else units.to(torch.int64).cpu()
    per_chunk = max(1, CHUNK_ELEMENTS // max(1, b * h * n * q_unit))
    per_chunk = min(per_chunk, max(1, math.ceil(len(units) / SPAN_CHUNKS)))
    keys = torch.arange(n)
    kt = k.to(dtype).transpose(-1, -2)
    scale = 1.0 / math.sqrt(d)
    h_sel = selection_heads(shared, h, hkv)
    for start in range(0, len(units), per_chunk):
        chunk = units[start : start + per_chunk]
        rows = (chunk[:, None] * q_unit + torch.arange(q_unit)[None, :]).flatten()
        valid = rows < q_len
        rows = rows.clamp(max=q_len - 1)
        mask = pattern.mask(rows[:, None], keys[None, :]) & valid[:, None]  # (c, N)
        lo, hi = _key_span(mask, kv_unit, n)
        out = torch.zeros(b, h_sel, len(chunk), kv_units, dtype=dtype, device=q.device)
        if hi > lo:
            span = min(hi, n) - lo
            qg = q[:, :, rows.to(q.device)].to(dtype).reshape(b, hkv, group * len(rows), d)
            scores = (qg @ kt[..., lo : lo + span]).mul_(scale).view(b, h, len(rows), span)
            scores.masked_fill_(~mask[:, lo : lo + span].to(scores.device), -math.inf)
            top = scores.amax(dim=-1, keepdim=True)
            top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # a row without keys: all zero
            probs = scores.sub_(top).exp_()
            if hi - lo > span:  # the last key unit passes the sequence's end
                probs = torch.nn.functional.pad(probs, (0, hi - lo - span))
            per_row = probs.view(b, h, len(rows), (hi - lo) // kv_unit, kv_unit).sum(dim=-1)  # (B, H, c, KUspan)
            total = per_row.sum(dim=-1, keepdim=True)
            per_row = per_row / torch.where(total > 0, total, torch.ones_like(total))
            per_unit = per_row.view(b, h, len(chunk), q_unit, -1).sum(dim=3)  # (B, H, u, KUspan)
            out[..., lo // kv_unit : hi // kv_unit] = per_unit.view(b, h_sel, h // h_sel, len(chunk), -1).sum(dim=2)
        yield chunk, out


def _gamma(n: float) -> float:
    """The relative error bound of n rounded float32 operations in a row: n u / (1 - n u) (Higham, Accuracy and
    Stability of Numerical Algorithms, 2nd ed., Lemma 3.1)."""
    return n * UNIT_ROUNDOFF / (1 - n * UNIT_ROUNDOFF)


def mass_error_bound(q: Tensor, k: Tensor, n_keys: int) -> float:
    """How far, relatively, a float32 unit mass of `unit_masses` can be from the exact one, for q (..., D) and
    k (..., D).

    Each scaled score s = q.k / sqrt(D) is off by at most gamma(D + 2) |q| |k| / sqrt(D) (a dot product of D terms,
    the scale, the subtraction of the row's max; |q.k| <= |q| |k|), so each exp(s - max) by a factor e^(2 e_s)
    (s and the max both off); the sums of positive terms (the unit's keys, the row's total, the unit's rows and
    heads: torch's reductions sum pairwise) add gamma(log2(N) + 3) relatively, the division one rounding."""
    d = q.shape[-1]
    norms = float(q.detach().double().norm(dim=-1).max()) * float(k.detach().double().norm(dim=-1).max())
    score_error = _gamma(d + 2) * norms / math.sqrt(d)
    return math.expm1(2 * score_error) + _gamma(math.ceil(math.log2(max(n_keys, 2))) + 4)


def _near_ties(masses: Tensor, wanted: Tensor, relative: float) -> Tensor:
    """bool (B, H_sel, u): whether the last unit kept and the first dropped could swap places at float32's error
    (each mass within `relative` of its exact value: within 2 `relative` of the larger, or TIE_FLOOR of the unit's
    total mass) (masses: -inf where not allowed)."""
    k = int(wanted.max()) if wanted.numel() else 0
    if k == 0 or k >= masses.shape[-1]:
        return torch.zeros(masses.shape[:-1], dtype=torch.bool, device=masses.device)
    top = masses.topk(k + 1, dim=-1).values  # (..., k + 1), descending
    at = wanted.clamp(min=1, max=k).unsqueeze(-1).to(torch.int64)
    last_kept, first_dropped = top.gather(-1, at - 1), top.gather(-1, at)
    total = masses.clamp_min(0).nan_to_num(0.0).sum(dim=-1, keepdim=True)
    larger = torch.maximum(last_kept, first_dropped).clamp_min(0)
    bound = torch.maximum(2 * relative * larger, TIE_FLOOR * total)
    close = (last_kept - first_dropped).abs() <= bound
    return (close & torch.isfinite(first_dropped) & (wanted.unsqueeze(-1) > 0)).squeeze(-1)


def oracle_topk_indices(q: Tensor, k: Tensor, pattern: Any, q_unit: int, kv_unit: int, shared: str,
                        counts: Tensor, units: Tensor | None = None) -> Tensor:
    """int32 (B, H_sel, units, K): per query unit the counts[b, h_sel, unit] (or counts[unit]) key units of most
    dense mass among those the pattern allows, -1 padded (K = counts.max()). Masses in float32; a query unit whose
    choice rests on a near tie (`_near_ties`) is chosen on its float64 masses."""
    allowed = allowed_units(pattern, q_unit, kv_unit)
    relative = mass_error_bound(q, k, k.shape[2])
    chunks = []
    for chunk, masses in unit_masses(q, k, pattern, q_unit, kv_unit, shared, units):
        masses = masses.masked_fill(~allowed[chunk].to(masses.device), -math.inf)
        wanted = counts[..., chunk] if counts.dim() > 1 else counts[chunk]
        wanted = wanted.to(masses.device).expand(masses.shape[:-1])
        ties = _near_ties(masses, wanted, relative).any(dim=(0, 1))  # (u,): the query units to look at again
        if bool(ties.any()):
            again = chunk[ties.cpu()]
            exact = torch.cat([m for _, m in unit_masses(q, k, pattern, q_unit, kv_unit, shared, again,
                                                         torch.float64)], dim=2)
            exact = exact.masked_fill(~allowed[again].to(exact.device), -math.inf)
            masses = masses.double()
            masses[:, :, ties.to(masses.device)] = exact
        chunks.append((masses, wanted))
    k_max = max((int(w.max()) for _, w in chunks), default=0)
    out = []
    for masses, wanted in chunks:
        picked = _ascending(topk_indices(masses, wanted))
        out.append(torch.nn.functional.pad(picked, (0, k_max - picked.shape[-1]), value=-1))
    return torch.cat(out, dim=2)


def _ascending(picked: Tensor) -> Tensor:
    """`picked` (..., K) with each row's units in ascending order, -1 last: a selection is a set, and the order
    topk leaves (by mass) would let rounding between two kept units' masses change the output."""
    past = torch.iinfo(picked.dtype).max
    ordered = torch.where(picked < 0, past, picked).sort(dim=-1).values
    return torch.where(ordered == past, -1, ordered)


@register_selector("oracle_topk", q_unit="block", kv_unit="block", shared="head", takes="budget",
                   reference=True)
def oracle_topk(q: Tensor, k: Tensor, case: Any) -> Tensor:
    """The budget key blocks of most dense attention mass per (head, query block): the best recall any selector of
    that budget can reach (dense scores computed, so it costs dense attention)."""
    pattern = case.make_pattern()
    counts = budget_counts(case.budget, allowed_units(pattern, case.block_size, case.block_size))
    return oracle_topk_indices(q, k, pattern, case.block_size, case.block_size, "head", counts)


@register_selector("oracle_topp", q_unit="block", kv_unit="block", shared="head", takes="threshold",
                   reference=True)
def oracle_topp(q: Tensor, k: Tensor, case: Any) -> Tensor:
    """The fewest key blocks per (head, query block) holding `threshold` of its dense attention mass (top-p)."""
    pattern = case.make_pattern()
    bs = case.block_size
    allowed = allowed_units(pattern, bs, bs)
    relative = mass_error_bound(q, k, k.shape[2])
    picked: list[Tensor] = []
    for chunk, masses in unit_masses(q, k, pattern, bs, bs, "head"):
        masses = masses.masked_fill(~allowed[chunk].to(masses.device), -1.0)  # never needed: below any mass
        ties = _topp_near_ties(masses, case.threshold, relative).any(dim=(0, 1))  # (u,)
        if bool(ties.any()):
            again = chunk[ties.cpu()]
            exact = torch.cat([m for _, m in unit_masses(q, k, pattern, bs, bs, "head", again, torch.float64)],
                              dim=2)
            masses = masses.double()
            masses[:, :, ties.to(masses.device)] = exact.masked_fill(~allowed[again].to(exact.device), -1.0)
        picked.append(_top_p(masses, case.threshold))
    k_max = max(int((p >= 0).sum(-1).max()) for p in picked) if picked else 0
    k_max = max(k_max, 1)
    return torch.cat([p[..., :k_max] for p in picked], dim=2)


def _top_p(masses: Tensor, threshold: float) -> Tensor:
    """int32 (..., KU): per query unit the fewest units whose mass reaches `threshold` of the total, by mass,
    -1 past them (masses -1 where not allowed: never kept)."""
    ordered = masses.sort(dim=-1, descending=True)
    values = ordered.values.clamp_min(0)
    before = values.cumsum(dim=-1) - values
    # keep a unit while the mass before it is short of the threshold (the first unit always, if allowed)
    keep = (before < threshold * values.sum(dim=-1, keepdim=True)) & (ordered.values >= 0)
    return torch.where(keep, ordered.indices, -1).to(torch.int32)


def _topp_near_ties(masses: Tensor, threshold: float, relative: float) -> Tensor:
    """bool (B, H, u): whether float32's error (each mass within `relative` of its exact value, so every sum of
    them too) could change what top-p keeps: the mass before the first unit dropped or before the last kept within
    2 `relative` of the total from the threshold, or the last kept and the first dropped as close as `_near_ties`
    says."""
    ordered = masses.sort(dim=-1, descending=True).values
    values = ordered.clamp_min(0)
    total = values.sum(dim=-1, keepdim=True)
    before = values.cumsum(dim=-1) - values
    kept = ((before < threshold * total) & (ordered >= 0)).sum(dim=-1, keepdim=True)  # (..., 1)
    last = ordered.shape[-1] - 1
    at_last = (kept - 1).clamp(0, last)
    at_first = kept.clamp(max=last)
    slack = 2 * relative * total + TIE_FLOOR * total
    stop_close = ((before.gather(-1, at_first) - threshold * total).abs() <= slack) & (kept <= last)
    keep_close = (threshold * total - before.gather(-1, at_last)).abs() <= slack
    a, b = ordered.gather(-1, at_last), ordered.gather(-1, at_first)
    order_close = ((a - b).abs() <= torch.maximum(2 * relative * torch.maximum(a, b).clamp_min(0),
                                                  TIE_FLOOR * total)) & (kept <= last) & (b >= 0)
    return (stop_close | keep_close | order_close).squeeze(-1) & (total.squeeze(-1) > 0)
