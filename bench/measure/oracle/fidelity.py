"""Fidelity of a selection to dense attention under the base pattern: how much of dense attention it keeps.

Computed once per case from the float64 oracle on a seeded sample of whole query units (all of them up to
FIDELITY_ELEMENTS score elements, else a sample holding the first and the last), per (batch, head, query row)
whose base pattern allows a key:

- recall: the softmax mass of dense attention on the row's selected keys; lse_gap = LSE_dense - LSE_selected,
  which equals -log(recall) (the selected keys' softmax is dense's renormalised to them);
- oracle_recall: the recall of `oracle_topk` at the selector's own units, sharing and per-unit counts, the best
  any selector keeping that many units reaches (so oracle_recall.mean >= recall.mean);
- cosine of the selected attention's output row against dense attention's, and output_rel_l2 over the whole;
- needles_found (structured inputs): the share of planted (needle, query row, batch, head) whose row's selection
  keeps at least half of the needle's keys that the base pattern allows;
- density: effective pairs over base pairs on the sampled rows.

A selector's distance from dense attention is fidelity, never `incorrect` (that is for the attention step).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from bench.inputs import CaseInputs
from bench.measure.oracle.reference import reference_chunks
from bench.patterns import Pattern
from bench.results.records import FidelityInfo, Spread
from bench.selection import Selection, effective_mask
from bench.selection.oracle import oracle_topk_indices

FIDELITY_ELEMENTS = 1 << 25  # B * H * sampled rows * N, about the oracle check's limit (twice)


def sampled_units(selection: Selection, batch: int, heads: int, q_len: int, seq_len: int, seed: int) -> Tensor:
    """Sorted query units whose rows fidelity is computed on."""
    units = selection.units
    per_unit = batch * heads * selection.q_unit * seq_len
    count = max(2, FIDELITY_ELEMENTS // max(per_unit, 1))
    if count >= units:
        return torch.arange(units)
    gen = torch.Generator().manual_seed(seed)
    inner = torch.randperm(units - 2, generator=gen)[: count - 2] + 1
    return torch.unique(torch.cat([torch.tensor([0, units - 1]), inner]))


def spread(values: Tensor) -> Spread:
    """mean, 5th percentile, min and max of `values` (all None when there are none)."""
    if values.numel() == 0:
        return Spread(mean=None, p5=None, min=None, max=None)
    v = values.to(torch.float64).cpu()
    return Spread(mean=float(v.mean()), p5=float(torch.quantile(v, 0.05)), min=float(v.min()), max=float(v.max()))


def _recall(weights: Tensor, mask: Tensor) -> Tensor:
    return (weights * mask).sum(dim=-1)


def fidelity(selection: Selection, pattern: Pattern, made: CaseInputs, seed: int) -> FidelityInfo:
    """The record's `fidelity` (module docstring)."""
    q, k, v = made.q, made.k, made.v
    b, h, q_len, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    units = sampled_units(selection, b, h, q_len, n, seed)
    rows = (units[:, None] * selection.q_unit + torch.arange(selection.q_unit)[None, :]).flatten()
    rows = rows[rows < q_len]
    counts = selection.counts().cpu()  # (B, H_sel, U): the oracle keeps as many
    picked = oracle_topk_indices(q, k, pattern, selection.q_unit, selection.kv_unit, selection.shared, counts,
                                 units)
    full = torch.full((*picked.shape[:2], selection.units, picked.shape[-1]), -1, dtype=torch.int32)
    full[:, :, units] = picked.cpu()
    oracle = Selection(full, selection.q_unit, selection.kv_unit, selection.shared)

    v64 = v.detach().double()
    group = h // hkv
    recalls, oracle_recalls, cosines = [], [], []
    diff_sq = ref_sq = 0.0
    effective_pairs = base_pairs = 0
    for r, weights, _ in reference_chunks(q.detach(), k.detach(), pattern, rows):
        has_keys = weights.sum(dim=-1) > 0  # (B, H, c)
        chosen = effective_mask(selection, pattern, r, h, hkv).to(weights.device)
        best = effective_mask(oracle, pattern, r, h, hkv).to(weights.device)
        recall = _recall(weights, chosen)
        recalls.append(recall[has_keys])
        oracle_recalls.append(_recall(weights, best)[has_keys])
        c = len(r)
        dense_out = (weights.reshape(b, hkv, group * c, n) @ v64).view(b, h, c, d)
        kept = weights * chosen / recall.clamp_min(1e-300).unsqueeze(-1)
        selected_out = (kept.reshape(b, hkv, group * c, n) @ v64).view(b, h, c, d)
        cos = torch.nn.functional.cosine_similarity(selected_out, dense_out, dim=-1)
        cosines.append(cos[has_keys & (recall > 0)])
        diff_sq += float(((selected_out - dense_out) ** 2).sum())
        ref_sq += float((dense_out**2).sum())
        base = weights > 0
        effective_pairs += int((chosen & base).sum())
        base_pairs += int(base.sum())
    recall_all = torch.cat(recalls)
    lse_gap = -torch.log(recall_all.clamp_min(1e-300))
    return FidelityInfo(recall=spread(recall_all), lse_gap=spread(lse_gap),
                        oracle_recall=spread(torch.cat(oracle_recalls)), cosine=spread(torch.cat(cosines)),
                        output_rel_l2=math.sqrt(diff_sq / ref_sq) if ref_sq > 0 else 0.0,
                        needles_found=needles_found(selection, pattern, made),
                        density=effective_pairs / base_pairs if base_pairs else None, rows=int(recall_all.numel()))


def needles_found(selection: Selection, pattern: Pattern, made: CaseInputs) -> float | None:
    """The share of planted (needle, row, batch, head) whose selection keeps at least half of the needle's keys
    the base pattern allows the row (needles the base hides from a row are left out); None without needles."""
    if made.kind != "structured" or not made.needles:
        return None
    b, h = made.q.shape[:2]
    hkv = made.k.shape[1]
    found = total = 0
    for needle in made.needles:
        rows = torch.tensor(needle.rows, dtype=torch.int64)
        span = torch.arange(needle.start, needle.end)
        base = pattern.mask(rows[:, None], span[None, :])  # (r, len)
        reachable = base.sum(dim=-1)  # (r,)
        if not bool((reachable > 0).any()):
            continue
        kept = effective_mask(selection, pattern, rows, h, hkv)[..., needle.start : needle.end].sum(dim=-1)
        reachable = reachable.to(kept.device)  # the selection lives on the inputs' device, the pattern's on the CPU
        hit = (2 * kept >= reachable) & (reachable > 0)  # (B, H, r)
        found += int(hit.sum())
        total += b * h * int((reachable > 0).sum())
    return found / total if total else None
