"""NSA's selection branch (Yuan et al. 2025, "Native Sparse Attention: Hardware-Aligned and Natively Trainable
Sparse Attention", section 3.3.2, eqs. 8-11; fla-org/native-sparse-attention, native_sparse_attention/ops/naive.py
`naive_nsa_compression` and the top-k kernel `parallel_nsa_kernel_topk` of ops/parallel.py).

Per query row and KV group, over key blocks of the case's block_size (NSA's selection block l', 64):
- compressed keys: the mean of each block's keys. The paper compresses blocks of l = 32 keys with stride d = 16
  by a learned MLP with position encodings, then maps those scores onto selection blocks (eq. 9); with no trained
  MLP we take fla's mean pooling with l = d = l', which makes eq. 9's mapping the identity;
- importance (eq. 8): p = softmax(q . k_cmp / sqrt(D)) over the blocks the row has seen whole (fla's causal mask
  on compressed keys: a block enters once its last key is at or before the row), among those the base pattern
  allows; allowed blocks not yet whole score 0;
- shared by the KV group (eq. 10): p summed over the group's query heads, so its heads read one selection, as NSA's
  kernel loads each block once for the whole group;
- the first block and the two local blocks (the row's own and the one before) forced in (the paper's 1 initial
  and 2 local blocks), then the top `budget` blocks (eq. 11, NSA's n = 16) including the forced ones. A budget
  under 3 (never NSA's) keeps the own block, then the one before, then the first.

Cost: the block means O(B Hkv N D); the scores O(B H Nq (N / block) D) over each chunk's allowed span and their
softmax; a top-k over N / block importances per row and KV group.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from bench.selection.registry import register_selector
from bench.selection.units import grouped_scores, per_row_topk, unit_means


@register_selector("nsa", q_unit="row", kv_unit="block", shared="kv_group", takes="budget")
def nsa(q: Tensor, k: Tensor, case: Any) -> Tensor:
    """NSA: per row and KV group, the `budget` blocks of most compressed attention, first and local forced."""
    b, h, _, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    bs = case.block_size
    means = unit_means(k, bs)  # (B, Hkv, KB, D): the compressed keys
    offset = n - q.shape[2]

    def importance(start: int, stop: int, lo: int, hi: int, allowed: Tensor) -> Tensor:
        scores = grouped_scores(q[:, :, start:stop], means[:, :, lo:hi]) / math.sqrt(d)  # (B, H, rows, blocks)
        positions = torch.arange(start, stop, device=q.device) + offset
        ends = ((torch.arange(lo, hi, device=q.device) + 1) * bs).clamp(max=n)  # one past each block's last key
        whole = allowed & (ends[None, :] <= positions[:, None] + 1)
        probs = torch.softmax(scores.masked_fill(~whole, -math.inf), dim=-1).nan_to_num_(0.0)  # no whole block: 0
        return probs.view(b, hkv, h // hkv, stop - start, hi - lo).sum(dim=2)  # (B, Hkv, rows, blocks)

    def first_and_local(positions: Tensor, blocks: Tensor) -> Tensor:
        # priorities where a budget under 3 is short of them: the own block, the one before, the first
        own = (positions // bs)[:, None]
        first = (blocks[None, :] == 0).to(torch.int64)
        return torch.maximum(first, 3 * (blocks[None, :] == own) + 2 * (blocks[None, :] == own - 1))

    return per_row_topk(q, case, bs, hkv, importance, first_and_local)
