"""DeepSeek Sparse Attention's lightning indexer (DeepSeek-AI 2025, "DeepSeek-V3.2-Exp: Boosting Long-Context
Efficiency with DeepSeek Sparse Attention", eq. 1; deepseek-ai/DeepSeek-V3.2-Exp, inference/model.py `Indexer`
and inference/kernel.py `fp8_index`).

Per query row, shared by all heads: index score I(t, s) = sum_j w_{t,j} ReLU(q^I_{t,j} . k^I_s) over H_I
indexer heads, and the `budget` tokens of largest score among those the base pattern allows (the report's top-k,
2048). The indexer has its own weights; DeepSeek trains them (a KL loss to the main attention's distribution
summed over heads). Without trained weights ours are fixed random projections seeded by the case's seed, built
so that the indexer approximates that target rather than scoring at random:
- P, a Gaussian (Hkv D, d_I) projection (entries N(0, 1/d_I), so P P^T is the identity in expectation);
- k^I_s = P^T [k_s over the KV heads]: one indexer key per token (MQA, as DeepSeek's), from the token's keys;
- q^I_{t,j} = P^T (q_{t,h_j} in the slot of its KV group), indexer head j reading query head h_j = j H / H_I, so
  that q^I_{t,j} . k^I_s approximates q_{t,h_j} . k_{s,g(h_j)} (the other groups' keys add noise of the order
  |q| |k| sqrt(Hkv / d_I));
- w_{t,j} = sigmoid(u_j . q_{t,h_j} / sqrt(D)) H_I^-1/2 d_I^-1/2, u_j Gaussian: a per-token weight from the
  token's query, with the reference's scales. DeepSeek's w is a signed linear map of the hidden state; a
  random signed weight would flip a head's ranking at random, hence the sigmoid.
Sizes: H_I = 8 indexer heads (min(8, H); DeepSeek has 64) of d_I = 128 (DeepSeek's index_head_dim); at GQA 32/8,
D = 128 the scoring costs a quarter of dense attention's q.k. In float32 (DeepSeek's runs in FP8).

Cost: the projections O(B N (Hkv D d_I + H_I D d_I)); the scores O(B Nq N H_I d_I) over each chunk's allowed
span of keys; a top-`budget` over N scores per row.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from bench.selection.registry import register_selector
from bench.selection.units import base_pattern, budget_counts, key_span, row_chunks, topk_indices

INDEXER_HEADS = 8  # H_I (DeepSeek-V3.2-Exp: index_n_heads 64)
INDEXER_DIM = 128  # d_I (DeepSeek-V3.2-Exp: index_head_dim 128)
SEED_SALT = 7_919  # the indexer's weights draw from their own stream of the case's seed


def indexer_weights(seed: int, heads: int, kv_heads: int, head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """(P (Hkv D, d_I), u (H_I, D), h_j (H_I,) int64): the indexer's seeded weights, drawn on the CPU so that
    every device gets the same ones."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + SEED_SALT)
    h_i = min(INDEXER_HEADS, heads)
    proj = torch.randn(kv_heads * head_dim, INDEXER_DIM, generator=gen) / math.sqrt(INDEXER_DIM)
    gate = torch.randn(h_i, head_dim, generator=gen)
    reads = torch.arange(h_i) * heads // h_i
    return proj, gate, reads


@register_selector("dsa", q_unit="row", kv_unit="token", shared="all", takes="budget")
def dsa(q: Tensor, k: Tensor, case: Any) -> Tensor:
    """DSA: per row, the `budget` tokens of largest sum_j w_j ReLU(q^I_j . k^I) (a seeded lightning indexer)."""
    b, h, q_len, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    proj, gate, reads = (t.to(q.device) for t in indexer_weights(case.seed, h, hkv, d))
    h_i = len(reads)
    keys = k.float().transpose(1, 2).reshape(b, n, hkv * d) @ proj  # (B, N, d_I): k^I
    queries = q[:, reads].float()  # (B, H_I, Nq, D): the query head each indexer head reads
    slots = proj.view(hkv, d, INDEXER_DIM)[reads // (h // hkv)]  # (H_I, D, d_I): its KV group's rows of P
    q_index = torch.einsum("bjtd,jde->bjte", queries, slots)  # (B, H_I, Nq, d_I): q^I
    weights = torch.sigmoid(torch.einsum("bjtd,jd->bjt", queries, gate) / math.sqrt(d))
    weights = weights * (h_i ** -0.5) * (INDEXER_DIM ** -0.5)  # (B, H_I, Nq): w, the reference's scales

    pattern = base_pattern(case)
    key_positions = torch.arange(n, device=q.device)
    budget = case.budget
    if isinstance(budget, int) and not isinstance(budget, bool):
        k_bound = min(budget, n)
    elif budget is None:
        k_bound = n
    else:
        k_bound = min(n, math.ceil(n * float(budget)))
    out = torch.full((b, 1, q_len, k_bound), -1, dtype=torch.int32, device=q.device)
    k_max = 0
    for start, stop in row_chunks(q_len, b * h_i * n):
        rows = torch.arange(start, stop, device=q.device)
        allowed = pattern.mask(rows[:, None], key_positions[None, :])  # (rows, N), on q's device
        lo, hi = key_span(allowed)
        if hi == lo:
            continue
        counts = budget_counts(budget, allowed)  # (rows,)
        logits = q_index[:, :, start:stop] @ keys[:, None, lo:hi].transpose(-1, -2)  # (B, H_I, rows, span)
        scores = logits.relu_().mul_(weights[:, :, start:stop, None]).sum(dim=1, keepdim=True)  # (B, 1, rows, span)
        scores = scores.masked_fill(~allowed[:, lo:hi], -math.inf)
        picked = topk_indices(scores, counts)
        out[..., start:stop, : picked.shape[-1]] = torch.where(picked >= 0, picked + lo, -1)
        k_max = max(k_max, picked.shape[-1])
    return out[..., :k_max].contiguous()

