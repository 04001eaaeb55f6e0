"""Maths shared by the distributed implementations (tp_heads, cp_ring, cp_allgather, cp_sparse).

Masked attention over the keys a rank holds, the same with its log-sum-exp (for merging partial results
over key blocks, as ring attention does), the merge itself, and the byte sizes the closed forms use.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from bench.comm import Communicator, current
from bench.registry import Case
from impls.common import accum_dtype, masked_softmax, masked_softmax_, softmax_scale


def elem_bytes(case: Case) -> int:
    return torch.empty((), dtype=case.torch_dtype).element_size()


def kv_row_bytes(case: Case) -> int:
    """Bytes of one sequence position of K and V together: 2 * B * Hkv * D * e (grouped-query attention
    moves only the KV heads)."""
    return 2 * case.batch * case.n_kv_heads * case.head_dim * elem_bytes(case)


def communicator_for(case: Case) -> Communicator:
    """The current communicator, which must span the case's world_size ranks."""
    comm = current()
    if comm.world_size != case.world_size:
        raise RuntimeError(f"the case has world_size {case.world_size} but this process belongs to a group of "
                           f"{comm.world_size} rank(s)")
    return comm


def grouped_scores(q: Tensor, k: Tensor) -> Tensor:
    """q (B, H, M, D) @ k (B, Hkv, K, D)^T -> (B, H, M, K): query head h against KV head h // (H / Hkv).

    The query heads of one KV head are stacked as rows of one batched matmul, so K is not copied.
    """
    b, h, m, d = q.shape
    hkv = k.shape[1]
    return (q.reshape(b, hkv, (h // hkv) * m, d) @ k.transpose(-1, -2)).view(b, h, m, k.shape[2])


def grouped_values(probs: Tensor, v: Tensor) -> Tensor:
    """probs (B, H, M, K) @ v (B, Hkv, K, D) -> (B, H, M, D), grouped as in `grouped_scores`."""
    b, h, m, kk = probs.shape
    hkv = v.shape[1]
    return (probs.reshape(b, hkv, (h // hkv) * m, kk) @ v).view(b, h, m, v.shape[3])


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """Attention of q (B, H, M, D) over k, v (B, Hkv, K, D) where mask (M, K) allows; empty rows give zeros.

    Scores and softmax in float32 for low-precision inputs; the result has q's dtype.
    """
    scale = softmax_scale(q.shape[-1])
    scores = grouped_scores(q, k).to(accum_dtype(q.dtype))  # (B, H, M, K)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        probs = masked_softmax(scores * scale, mask)
    else:  # inference: one score-sized buffer
        probs = masked_softmax_(scores.mul_(scale), mask)
    return grouped_values(probs.to(v.dtype), v).to(q.dtype)


def attend_with_lse(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(out, lse) of q (B, H, M, D) over one key block k, v (B, Hkv, K, D) under mask (M, K).

    out (B, H, M, D) is normalised over this block, in the accumulation dtype; lse (B, H, M) is the log of
    the block's softmax denominator. A row with no allowed key in the block has out 0 and lse -inf.
    """
    acc = accum_dtype(q.dtype)
    if k.shape[-2] == 0:  # no keys at all
        return q.new_zeros(q.shape, dtype=acc), q.new_full(q.shape[:-1], -math.inf, dtype=acc)
    scores = grouped_scores(q, k).to(acc) * softmax_scale(q.shape[-1])
    scores = scores.masked_fill(~mask, -math.inf)
    peak = scores.amax(dim=-1, keepdim=True)
    # The max only keeps exp() in range; any finite shift gives the same result, so it carries no gradient.
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak)).detach()
    weights = torch.exp(scores - peak)  # masked keys: exp(-inf) = 0
    denom = weights.sum(dim=-1, keepdim=True)
    has_key = denom > 0
    safe = torch.where(has_key, denom, torch.ones_like(denom))
    out = grouped_values(weights / safe, v.to(acc))
    lse = torch.where(has_key, peak + torch.log(safe), torch.full_like(denom, -math.inf))
    return out, lse.squeeze(-1)


def merge(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Combine attention over two disjoint key sets from their normalised outputs and log-sum-exps.

    out = (e^lse_a out_a + e^lse_b out_b) / (e^lse_a + e^lse_b); rows empty in both stay 0 with lse -inf.
    Written so that no NaN reaches the gradient of an empty row.
    """
    top = torch.maximum(lse_a, lse_b)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top)).detach()  # a shift, as above
    wa, wb = torch.exp(lse_a - top), torch.exp(lse_b - top)  # (B, H, M); exp(-inf) = 0
    total = wa + wb
    nonzero = total > 0
    safe = torch.where(nonzero, total, torch.ones_like(total))
    out = (wa[..., None] * out_a + wb[..., None] * out_b) / safe[..., None]
    lse = torch.where(nonzero, top + torch.log(safe), torch.full_like(total, -math.inf))
    return out, lse
