"""MoBA's block gate (Lu et al. 2025, "MoBA: Mixture of Block Attention for Long-Context LLMs";
MoonshotAI/MoBA, moba/moba_naive.py).

Per query row and head, over key blocks of the case's block_size (MoBA's `moba_chunk_size`): gate = q . mean of
the block's keys (float32, as the reference's "use fp32 to avoid precision issue in bf16"), the row's own block
forced in (the reference's +inf), later blocks out (its -inf: here, every block the base pattern does not allow),
and the `budget` blocks (`moba_topk`) of largest gate, its own included. A query head reads its KV head's block
means. Exactly docs/DESIGN.md's definition; the only departures from the reference are where it has no answer:
a budget larger than the allowed blocks pads with -1 (the reference's topk takes -inf blocks, then masks them),
and a base pattern other than causal restricts the candidates.

Cost: the block means O(B Hkv N D); the gate O(B H Nq (N / block) D), over the allowed span of each chunk of
rows (about half of it under causal); a top-k over N / block gates per row.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from bench.selection.registry import register_selector
from bench.selection.units import grouped_scores, per_row_topk, unit_means


@register_selector("moba", q_unit="row", kv_unit="block", shared="head", takes="budget")
def moba(q: Tensor, k: Tensor, case: Any) -> Tensor:
    """MoBA: per row and head, the `budget` key blocks of largest q . mean(block keys), its own block forced."""
    bs = case.block_size
    means = unit_means(k, bs)  # (B, Hkv, KB, D)

    def gate(start: int, stop: int, lo: int, hi: int, allowed: Tensor) -> Tensor:
        return grouped_scores(q[:, :, start:stop], means[:, :, lo:hi])  # (B, H, rows, blocks)

    def own(positions: Tensor, blocks: Tensor) -> Tensor:
        return blocks[None, :] == (positions // bs)[:, None]

    return per_row_topk(q, case, bs, q.shape[1], gate, own)
