"""The reference selectors: exact masses of dense attention, the best any selector of a budget can do.

`oracle_topk` keeps, for each (batch, selection head, query unit), the `budget` key units with the largest summed
softmax mass of dense attention under the base pattern over the unit's query rows (summed over the query heads
that share the selection). For that count it maximises the mean recall of those rows: the yardstick of every
record's `fidelity.oracle_recall`, which the harness computes at the selector's own units, sharing and counts
(`oracle_topk_indices`). `oracle_topp` keeps the fewest units whose mass reaches `threshold` of the unit's total
(top-p, as XAttention's threshold is meant to).

Both compute the dense scores, q.k/sqrt(D) in float32, in chunks of query units: they cost as much as dense
attention, and stand apart from the fast selectors as the oracle does from the implementations.
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


def unit_masses(q: Tensor, k: Tensor, pattern: Any, q_unit: int, kv_unit: int, shared: str,
                units: Tensor | None = None) -> Iterator[tuple[Tensor, Tensor]]:
    """Yields (query units (u,), masses float32 (B, H_sel, u, KU)): dense attention's mass per key unit, summed
    over each unit's rows and the heads that share a selection; `units` (sorted) limits the query units."""
    b, h, q_len, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    group = h // hkv
    q_units, kv_units = math.ceil(q_len / q_unit), math.ceil(n / kv_unit)
    units = torch.arange(q_units) if units is None else units.to(torch.int64).cpu()
    per_chunk = max(1, CHUNK_ELEMENTS // max(1, b * h * n * q_unit))
    keys = torch.arange(n)
    kt = k.float().transpose(-1, -2)
    scale = 1.0 / math.sqrt(d)
    h_sel = selection_heads(shared, h, hkv)
    for start in range(0, len(units), per_chunk):
        chunk = units[start : start + per_chunk]
        rows = (chunk[:, None] * q_unit + torch.arange(q_unit)[None, :]).flatten()
        valid = rows < q_len
        rows = rows.clamp(max=q_len - 1)
        mask = pattern.mask(rows[:, None], keys[None, :]) & valid[:, None]  # (c, N)
        qg = q[:, :, rows.to(q.device)].float().reshape(b, hkv, group * len(rows), d)
        scores = (qg @ kt * scale).view(b, h, len(rows), n)
        scores = scores.masked_fill(~mask.to(scores.device), -math.inf)
        probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # a row without keys has no mass
        probs = torch.nn.functional.pad(probs, (0, kv_units * kv_unit - n))
        per_unit = probs.view(b, h, len(chunk), q_unit, kv_units, kv_unit).sum(dim=(3, 5))  # (B, H, u, KU)
        yield chunk, per_unit.view(b, h_sel, h // h_sel, len(chunk), kv_units).sum(dim=2)


def oracle_topk_indices(q: Tensor, k: Tensor, pattern: Any, q_unit: int, kv_unit: int, shared: str,
                        counts: Tensor, units: Tensor | None = None) -> Tensor:
    """int32 (B, H_sel, units, K): per query unit the counts[b, h_sel, unit] (or counts[unit]) key units of most
    dense mass among those the pattern allows, -1 padded (K = counts.max())."""
    allowed = allowed_units(pattern, q_unit, kv_unit)
    chunks = []
    for chunk, masses in unit_masses(q, k, pattern, q_unit, kv_unit, shared, units):
        masses = masses.masked_fill(~allowed[chunk].to(masses.device), -math.inf)
        wanted = counts[..., chunk] if counts.dim() > 1 else counts[chunk]
        chunks.append((masses, wanted))
    k_max = max((int(w.max()) for _, w in chunks), default=0)
    out = []
    for masses, wanted in chunks:
        picked = topk_indices(masses, wanted.to(masses.device).expand(masses.shape[:-1]))
        out.append(torch.nn.functional.pad(picked, (0, k_max - picked.shape[-1]), value=-1))
    return torch.cat(out, dim=2)


@register_selector("oracle_topk", q_unit="block", kv_unit="block", shared="head", reference=True)
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
    picked: list[Tensor] = []
    for chunk, masses in unit_masses(q, k, pattern, bs, bs, "head"):
        masses = masses.masked_fill(~allowed[chunk].to(masses.device), -1.0)  # never needed: below any mass
        ordered = masses.sort(dim=-1, descending=True)
        total = masses.clamp_min(0).sum(dim=-1, keepdim=True)
        before = ordered.values.clamp_min(0).cumsum(dim=-1) - ordered.values.clamp_min(0)
        # keep a unit while the mass before it is short of the threshold (the first unit always, if allowed)
        keep = (before < case.threshold * total - 1e-7 * total) & (ordered.values >= 0)
        keep[..., 0] &= ordered.values[..., 0] >= 0
        picked.append(torch.where(keep, ordered.indices, -1).to(torch.int32))
    k_max = max(int((p >= 0).sum(-1).max()) for p in picked) if picked else 0
    k_max = max(k_max, 1)
    return torch.cat([p[..., :k_max] for p in picked], dim=2)
