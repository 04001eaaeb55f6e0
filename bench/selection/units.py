"""What the base pattern allows at a selection's granularity, and how a `budget` becomes a count per query unit.

`allowed_units(pattern, q_unit, kv_unit)`: bool (query units, key units), True where some (row, key) pair of the
two units is allowed by the base pattern; built in chunks of rows and cached on the pattern instance. A
selector picks among these units (picking others wastes its budget: the effective mask drops them).

`budget_counts(budget, allowed)`: the units kept per query unit. An int budget is a count (at most what the unit
allows); a float in (0, 1] is that fraction of the unit's allowed units, rounded up, at least 1.
"""

from __future__ import annotations

import math

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
    else:
        q_units, kv_units = math.ceil(q_len / q_unit), math.ceil(n / kv_unit)
        out = torch.zeros(q_units, kv_units, dtype=torch.bool)
        step = max(q_unit, (CHUNK_ELEMENTS // max(n, 1)) // q_unit * q_unit)
        keys = torch.arange(n)
        for start in range(0, q_len, step):
            rows = torch.arange(start, min(start + step, q_len))
            mask = pattern.mask(rows[:, None], keys[None, :])  # type: ignore[attr-defined]
            mask = torch.nn.functional.pad(mask, (0, kv_units * kv_unit - n))
            per_key_unit = mask.view(len(rows), kv_units, kv_unit).any(dim=-1)  # (c, KU)
            whole = math.ceil(len(rows) / q_unit) * q_unit  # chunks start on a unit's first row
            per_key_unit = torch.nn.functional.pad(per_key_unit, (0, 0, 0, whole - len(rows)))
            first = start // q_unit
            out[first : first + whole // q_unit] = per_key_unit.view(-1, q_unit, kv_units).any(dim=1)
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
