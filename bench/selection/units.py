"""What the base pattern allows at a selection's granularity, and how a `budget` becomes a count per query unit.

`allowed_units(pattern, q_unit, kv_unit)`: bool (query units, key units), True where some (row, key) pair of the
two units is allowed by the base pattern; built in chunks of rows and cached on the pattern instance. A
selector picks among these units (picking others wastes its budget: the effective mask drops them).

`budget_counts(budget, allowed)`: the units kept per query unit. An int budget is a count (at most what the unit
allows); a float in (0, 1] is that fraction of the unit's allowed units, rounded up, at least 1.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

# Rows of the base pattern evaluated at once (rows x N booleans).
CHUNK_ELEMENTS = 1 << 25


def allowed_units(pattern: object, q_unit: int, kv_unit: int) -> Tensor:
    """bool (ceil(q_len / q_unit), ceil(N / kv_unit)); module docstring."""
    cache = getattr(pattern, "_cache", None)
    key = ("selection_units", q_unit, kv_unit)
    if cache is not None and key in cache:
        return cache[key]
    q_len, n = pattern.q_len, pattern.seq_len  # type: ignore[attr-defined]
    if q_unit == kv_unit and hasattr(pattern, "block_layout"):
        out = pattern.block_layout(q_unit).to(torch.bool)
    elif q_unit >= q_len and kv_unit == 1 and hasattr(pattern, "used_keys"):
        out = pattern.used_keys()[None, :]  # one unit of every row: the keys some row may see
    else:
        q_units, kv_units = math.ceil(q_len / q_unit), math.ceil(n / kv_unit)
        out = torch.zeros(q_units, kv_units, dtype=torch.bool)
        chunk_rows = max(1, CHUNK_ELEMENTS // max(n, 1))
        # Chunks of whole query units where a unit fits in one; else a unit (all of a decode's queries, say)
        # spans chunks and each chunk ORs into it: never more than CHUNK_ELEMENTS booleans at once.
        whole_units = q_unit <= chunk_rows
        step = chunk_rows // q_unit * q_unit if whole_units else chunk_rows
        keys = torch.arange(n)
        for start in range(0, q_len, step):
            rows = torch.arange(start, min(start + step, q_len))
            mask = pattern.mask(rows[:, None], keys[None, :])  # type: ignore[attr-defined]
            mask = torch.nn.functional.pad(mask, (0, kv_units * kv_unit - n))
            per_key_unit = mask.view(len(rows), kv_units, kv_unit).any(dim=-1)  # (c, KU)
            if whole_units:
                whole = math.ceil(len(rows) / q_unit) * q_unit  # chunks start on a unit's first row
                per_key_unit = torch.nn.functional.pad(per_key_unit, (0, 0, 0, whole - len(rows)))
                first = start // q_unit
                out[first : first + whole // q_unit] = per_key_unit.view(-1, q_unit, kv_units).any(dim=1)
            else:
                unit = rows // q_unit  # a chunk shorter than a unit touches at most two
                for u in torch.unique(unit).tolist():
                    out[u] |= per_key_unit[unit == u].any(dim=0)
    if cache is not None:
        cache[key] = out
    return out


def budget_counts(budget: int | float | None, allowed: Tensor) -> Tensor:
    """int64 (query units,): the key units each query unit keeps (module docstring). `allowed`: (QU, KU) bool."""
    available = allowed.sum(dim=-1)
    if budget is None:
        return available
    if isinstance(budget, bool):
        raise TypeError("budget is a count (int) or a fraction (float), not a bool")
    if isinstance(budget, int):
        return available.clamp(max=budget)
    wanted = torch.ceil(available.to(torch.float64) * float(budget)).to(torch.int64).clamp(min=1)
    return torch.minimum(wanted, available)


def topk_indices(scores: Tensor, counts: Tensor) -> Tensor:
    """int32 (..., K) with K = counts.max(): per leading index, the `counts` (broadcast over scores' leading
    dims, last dim excluded) largest entries of scores (..., KU), -1 past each count. Entries of -inf (units
    not allowed) are never taken: a count larger than the allowed units leaves padding."""
    k = int(counts.max()) if counts.numel() else 0
    if k == 0:
        return torch.full((*scores.shape[:-1], 0), -1, dtype=torch.int32, device=scores.device)
    top = scores.topk(k, dim=-1)
    slot = torch.arange(k, device=scores.device)
    keep = (slot < counts.to(scores.device).unsqueeze(-1)) & torch.isfinite(top.values)
    return torch.where(keep, top.indices, -1).to(torch.int32)


# --- shared by the fast selectors (bench.selection.moba, quest, nsa, dsa, msa, xattention) ---------------------------

# float32 scores a fast selector holds at once (B * heads * rows * key units): 256 MiB
SCORE_ELEMENTS = 1 << 26
# A forced unit's score (times its priority, 1..3): above any score a selector computes from finite inputs,
# and finite, as topk_indices drops -inf.
FORCED = 1e30


# The last few base patterns selectors met, by their fields: a sweep runs many selections over one pattern.
_PATTERNS: dict[tuple[Any, ...], Any] = {}
_PATTERNS_KEPT = 4


def base_pattern(case: Any) -> Any:
    """The case's base pattern, one instance per distinct pattern: `allowed_units` caches on the instance, so the
    units a pattern allows are worked out once (as a kernel's block layout is), not inside every timed call."""
    fields = case.pattern_fields() if hasattr(case, "pattern_fields") else {}
    key = (case.pattern, case.seq_len, getattr(case, "q_len", None), getattr(case, "documents", None),
           tuple(sorted(fields.items())))
    try:
        pattern = _PATTERNS.get(key)
    except TypeError:  # an unhashable field value: no memo
        return case.make_pattern()
    if pattern is None:
        if len(_PATTERNS) >= _PATTERNS_KEPT:
            _PATTERNS.pop(next(iter(_PATTERNS)))
        pattern = _PATTERNS[key] = case.make_pattern()
    return pattern


def allowed_on(pattern: Any, q_unit: int, kv_unit: int, device: torch.device) -> Tensor:
    """`allowed_units` on `device`, cached there too."""
    cache = getattr(pattern, "_cache", None)
    key = ("selection_units", q_unit, kv_unit, str(device))
    if cache is not None and key in cache:
        return cache[key]
    out = allowed_units(pattern, q_unit, kv_unit).to(device)
    if cache is not None:
        cache[key] = out
    return out


def row_chunks(rows: int, per_row: int) -> list[tuple[int, int]]:
    """[start, stop) spans of at most SCORE_ELEMENTS // per_row rows (at least 1) covering range(rows)."""
    step = max(1, SCORE_ELEMENTS // max(1, per_row))
    return [(start, min(start + step, rows)) for start in range(0, rows, step)]


def key_span(allowed: Tensor) -> tuple[int, int]:
    """[lo, hi): the key units any row of `allowed` (rows, key units) may see; (0, 0) if none. A chunk of causal
    rows scores only the keys up to its last row, as a causal kernel skips the blocks past the diagonal."""
    cols = allowed.any(dim=0).nonzero()
    if cols.numel() == 0:
        return 0, 0
    return int(cols[0]), int(cols[-1]) + 1


def unit_means(k: Tensor, unit: int) -> Tensor:
    """float32 (B, Hkv, ceil(N / unit), D): the mean of each unit's keys (a last, partial unit over its own keys)."""
    b, hkv, n, d = k.shape
    units = math.ceil(n / unit)
    padded = k.float() if n == units * unit else torch.nn.functional.pad(k.float(), (0, 0, 0, units * unit - n))
    sums = padded.reshape(b, hkv, units, unit, d).sum(dim=3)
    sizes = (n - torch.arange(units, device=k.device) * unit).clamp(max=unit)  # keys per unit
    return sums / sizes.to(sums.dtype)[:, None]


def grouped_scores(q: Tensor, keys: Tensor) -> Tensor:
    """float32 (B, H, rows, U): q (B, H, rows, D) against per-KV-head keys (B, Hkv, U, D'), D' = D; query head h
    reads KV head h // (H / Hkv), without copying the keys per query head."""
    b, h, rows, d = q.shape
    hkv = keys.shape[1]
    grouped = q.float().reshape(b, hkv, (h // hkv) * rows, d)
    return (grouped @ keys.float().transpose(-1, -2)).view(b, h, rows, keys.shape[2])


def pick_topk(scores: Tensor, allowed: Tensor, forced: Tensor | None, counts: Tensor) -> Tensor:
    """int32 (B, Hs, rows, K = counts.max()): per row the counts[row] allowed units of largest score, forced
    units (allowed ones) first, the higher priority first where the count is short of them; -1 past the count.
    scores (B, Hs, rows, U), finite, overwritten; allowed bool (rows, U); forced (rows, U) bool, or int
    priorities (0: not forced)."""
    # one pass over the scores: + FORCED * priority lifts a forced unit above all (FORCED absorbs the score), + -inf
    # drops a unit the base pattern does not allow
    bias = torch.zeros(allowed.shape, dtype=scores.dtype, device=scores.device)
    if forced is not None:
        bias = FORCED * forced.to(scores.dtype)
    bias.masked_fill_(~allowed, -math.inf)
    return topk_indices(scores.add_(bias), counts)


def per_row_topk(q: Tensor, case: Any, kv_unit: int, heads_sel: int,
                 score: Callable[[int, int, int, int, Tensor], Tensor],
                 forced: Callable[[Tensor, Tensor], Tensor] | None) -> Tensor:
    """int32 (B, heads_sel, q_len, K): the top-`budget` key units of each query row (q_unit 1) by `score`.

    Rows go in chunks; each chunk scores only the span of key units its rows may see. `score(start, stop, lo,
    hi, allowed)` gives float (B, heads_sel, stop - start, hi - lo) for rows [start, stop) and key units [lo, hi)
    (allowed: bool (rows, units) of the base pattern); `forced(positions, units)` (rows, units), bool or int
    priorities, marks the units kept before any other (allowed ones; `pick_topk`). K = the largest per-row count;
    -1 pads.
    """
    b, h, q_len, _ = q.shape
    pattern = base_pattern(case)
    allowed_all = allowed_on(pattern, 1, kv_unit, q.device)  # (q_len, KU)
    kv_units = allowed_all.shape[1]
    counts = budget_counts(case.budget, allowed_all)  # (q_len,)
    k_max = int(counts.max()) if counts.numel() else 0
    out = torch.full((b, heads_sel, q_len, k_max), -1, dtype=torch.int32, device=q.device)
    offset = pattern.seq_len - pattern.q_len  # query row r is position r + offset
    for start, stop in row_chunks(q_len, b * h * kv_units):
        allowed = allowed_all[start:stop]
        lo, hi = key_span(allowed)
        if hi == lo:
            continue
        allowed = allowed[:, lo:hi]
        scores = score(start, stop, lo, hi, allowed)
        positions = torch.arange(start, stop, device=q.device) + offset
        must = forced(positions, torch.arange(lo, hi, device=q.device)) if forced is not None else None
        picked = pick_topk(scores, allowed, must, counts[start:stop])
        out[:, :, start:stop, : picked.shape[-1]] = torch.where(picked >= 0, picked + lo, -1)
    return out
