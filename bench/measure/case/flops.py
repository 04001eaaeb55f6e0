"""FLOP and byte counts: what the pattern makes necessary (useful) and what dense attention would do.

Forward: Q K^T and P V each take 2 * D FLOPs per allowed (query, key) pair per head: 4 * B * H * nnz * D,
nnz the allowed pairs of the q_len x seq_len matrix and H the query heads (grouped-query attention shares
K and V between heads, not the products).
Forward+backward: the backward recomputes nothing in this count and needs 2x the forward's matmuls
(dV, dP, dQ, dK: four products against the forward's two), so 2.5x the forward in all, the factor
FlashAttention's benchmarks use.
Bytes (`min_bytes`): the floor of the memory roof, the least a call must move, as FlashInfer's and vLLM's kernel
benchmarks count it for decode: every input it needs read once, its output written once.
"""

from __future__ import annotations

from bench.selection import allowed_units
from bench.spec.case import Case

FWD_BWD_FACTOR = 2.5


def attention_flops(case: Case, pairs: int) -> float:
    """FLOPs for `pairs` (query, key) pairs per head, in the case's mode."""
    fwd = 4.0 * case.batch * case.heads * pairs * case.head_dim
    return fwd * (FWD_BWD_FACTOR if case.mode == "fwd_bwd" else 1.0)


# The backward alone (a fwd_bwd record's `flops_bwd`), by FlashAttention's benchmark convention (its `flops(...,
# mode="bwd")`): 2.5x the forward. The pair's `flops` keep the contract's 2.5x the forward for forward+backward,
# so flops_bwd is not flops minus the forward: each says which convention it follows.
BWD_FACTOR = 2.5


def backward_flops(case: Case, nnz: int) -> float:
    """The backward's FLOPs over the allowed pairs: BWD_FACTOR x the forward's."""
    return 4.0 * case.batch * case.heads * nnz * case.head_dim * BWD_FACTOR


def useful_flops(case: Case, nnz: int) -> float:
    """FLOPs over the pattern's allowed pairs only."""
    return attention_flops(case, nnz)


def dense_flops(case: Case) -> float:
    """FLOPs dense attention spends on the same shape."""
    return attention_flops(case, case.n_queries * case.seq_len)


def min_bytes(case: Case, kv_rows: int) -> int:
    """The least bytes the call must move: q, each allowed key and value row once per KV head (a GQA group reads
    a K/V row once for all its query heads), the output; fwd_bwd adds the upstream gradient's read and dq, dk, dv
    written. `kv_rows`: the key rows some query row of a KV head's group may attend to, summed over the batch and
    the KV heads (what the pattern, or a selection, allows)."""
    e = case.element_bytes
    q_bytes = case.batch * case.heads * case.n_queries * case.head_dim * e
    kv_bytes = 2 * kv_rows * case.head_dim * e  # K and V
    if case.mode == "fwd_bwd":
        return 2 * (2 * q_bytes + kv_bytes)  # q, o, do, dq; k, v, dk, dv
    return 2 * q_bytes + kv_bytes


def pattern_kv_rows(case: Case, pattern: object) -> int:
    """`min_bytes`' kv_rows for a pattern shared by the batch and the heads: the key positions some query row
    may attend to, times B * Hkv."""
    used = allowed_units(pattern, max(1, case.n_queries), 1)  # (1, N): keys any row allows
    return int(used.sum()) * case.batch * case.n_kv_heads
