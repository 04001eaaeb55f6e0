"""What a case's inputs make of dense attention under its pattern: how concentrated each row's mass is.

Computed from the oracle's float64 weights (`bench.measure.oracle.reference.reference_weights`) on the rows the oracle
checks (a seeded sample above its size limit), per (batch, head, query row), then summarised over rows. A row's
top-p% is of the keys its pattern allows it (at least one key), so a causal row near the start is judged
against its own few keys. Rows with no allowed key are left out.

- top1_mass, top5_mass, top10_mass: the share of the row's mass in its largest 1%, 5%, 10% of keys;
- block_top5_mass: the same over key blocks of the case's block_size (the largest 5% of the blocks it can see);
- entropy: -sum p log p in nats (log of the allowed count for a flat row);
- sink_mass: the mass on the first SINK_TOKENS positions (StreamingLLM's four sink tokens).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from bench.measure.oracle.reference import reference_weights
from bench.patterns import Pattern

SINK_TOKENS = 4
STAT_NAMES = ("top1_mass", "top5_mass", "top10_mass", "block_top5_mass", "entropy", "sink_mass")


def _top_share(weights: Tensor, allowed: Tensor, share: float) -> Tensor:
    """Per row (..., N): the mass of the largest ceil(share * allowed) entries."""
    ordered = weights.sort(dim=-1, descending=True).values.cumsum(dim=-1)
    count = (allowed.to(torch.float64) * share).ceil().clamp_min(1).to(torch.int64)
    return ordered.gather(-1, (count - 1).clamp(max=weights.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)


def row_statistics(weights: Tensor, allowed_mask: Tensor, block_size: int) -> dict[str, Tensor]:
    """Each statistic per row: weights (B, H, c, N) float64 summing to 1 on rows with keys; allowed_mask (c, N)."""
    n = weights.shape[-1]
    allowed = allowed_mask.sum(dim=-1).expand(weights.shape[:-1])  # (B, H, c)
    out = {f"top{p}_mass": _top_share(weights, allowed, p / 100) for p in (1, 5, 10)}
    blocks = math.ceil(n / block_size)
    padded = torch.nn.functional.pad(weights, (0, blocks * block_size - n))
    block_mass = padded.unflatten(-1, (blocks, block_size)).sum(dim=-1)
    mask_pad = torch.nn.functional.pad(allowed_mask, (0, blocks * block_size - n))
    allowed_blocks = mask_pad.unflatten(-1, (blocks, block_size)).any(dim=-1).sum(dim=-1).expand(
        weights.shape[:-1])
    out["block_top5_mass"] = _top_share(block_mass, allowed_blocks, 0.05)
    logs = torch.where(weights > 0, weights.log(), torch.zeros_like(weights))
    out["entropy"] = -(weights * logs).sum(dim=-1)
    out["sink_mass"] = weights[..., :SINK_TOKENS].sum(dim=-1)
    out["_has_keys"] = allowed > 0
    return out


def _summary(values: Tensor) -> dict[str, float]:
    if values.numel() == 0:
        return {"mean": math.nan, "p5": math.nan, "p50": math.nan, "p95": math.nan}
    q = torch.quantile(values, torch.tensor([0.05, 0.5, 0.95], dtype=values.dtype))
    return {"mean": float(values.mean()), "p5": float(q[0]), "p50": float(q[1]), "p95": float(q[2])}


def attention_statistics(q: Tensor, k: Tensor, pattern: Pattern, rows: Tensor, block_size: int) -> dict[str, Any]:
    """The statistics of dense attention under `pattern` on query `rows`: each {mean, p5, p50, p95} over
    (batch, head, row), `rows` (how many (b, h, row) were summarised) and `by_head` (each head's mean top5_mass
    and entropy)."""
    collected: dict[str, list[Tensor]] = {name: [] for name in STAT_NAMES}
    per_head: dict[str, list[Tensor]] = {"top5_mass": [], "entropy": []}
    keys = torch.arange(pattern.seq_len)
    with torch.no_grad():
        for r, weights in reference_weights(q.detach(), k.detach(), pattern, rows):
            mask = pattern.mask(r[:, None], keys[None, :]).to(weights.device)
            stats = row_statistics(weights, mask, block_size)
            keep = stats.pop("_has_keys")
            for name in STAT_NAMES:
                collected[name].append(stats[name][keep].cpu())
            for name in per_head:
                # (H, c) with NaN where the row has no key, averaged per head below
                per_head[name].append(torch.where(keep, stats[name], math.nan).mean(dim=0).cpu())
    out: dict[str, Any] = {name: _summary(torch.cat(vals)) for name, vals in collected.items()}
    out["rows"] = int(sum(v.numel() for v in collected["entropy"]))
    out["by_head"] = {name: [float(x) for x in torch.cat(vals, dim=-1).nanmean(dim=-1)]
                      for name, vals in per_head.items()}
    return out
