"""FLOP counts: what the pattern makes necessary (useful) and what dense attention would do.

Forward: Q K^T and P V each take 2 * D FLOPs per allowed (query, key) pair per head: 4 * B * H * nnz * D,
nnz the allowed pairs of the q_len x seq_len matrix and H the query heads (grouped-query attention shares
K and V between heads, not the products).
Forward+backward: the backward recomputes nothing in this count and needs 2x the forward's matmuls
(dV, dP, dQ, dK: four products against the forward's two), so 2.5x the forward in all, the factor
FlashAttention's benchmarks use.
"""

from __future__ import annotations

from bench.spec.case import Case

FWD_BWD_FACTOR = 2.5


def attention_flops(case: Case, pairs: int) -> float:
    """FLOPs for `pairs` (query, key) pairs per head, in the case's mode."""
    fwd = 4.0 * case.batch * case.heads * pairs * case.head_dim
    return fwd * (FWD_BWD_FACTOR if case.mode == "fwd_bwd" else 1.0)


def useful_flops(case: Case, nnz: int) -> float:
    """FLOPs over the pattern's allowed pairs only."""
    return attention_flops(case, nnz)


def dense_flops(case: Case) -> float:
    """FLOPs dense attention spends on the same shape."""
    return attention_flops(case, case.n_queries * case.seq_len)
