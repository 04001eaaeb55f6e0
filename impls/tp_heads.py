"""`tp_heads`: Megatron-style tensor parallelism over attention heads.

An attention layer whose QKV projection is column-parallel (rank r computes heads [r H/P, (r+1) H/P)) and
whose output projection is row-parallel (each rank's partial output, one all-reduce). The projections are
identity matrices, so the all-reduced result is exactly the attention output and the oracle can check it;
multiplying by an identity is a copy, so they are applied as what they amount to - taking the rank's heads,
and placing its heads' output in an otherwise zero hidden state - and time_s stays the attention's plus its
communication, comparable with the context-parallel implementations.

Only hidden states cross the wire, whatever the mask: this is why sparsity saves nothing here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bench.comm import all_reduce_sent
from bench.comm_autograd import copy_to_ranks, reduce_from_ranks
from bench.registry import register
from bench.sharding import DistributedImpl
from impls.common import accum_dtype
from impls.parallel_common import attend, communicator_for, elem_bytes, empty_matrix, score_modifier


@register
class TensorParallelHeads(DistributedImpl):
    name = "tp_heads"
    description = "heads split over ranks; column-parallel QKV, row-parallel output, one all-reduce forward"
    fwd_bwd = True
    score_mods = frozenset({"softcap", "alibi", "relative_bias", "custom"})  # on its own heads and positions
    split_dim = 1  # heads

    def prepare(self, case, pattern, q, k, v):
        comm = communicator_for(case)
        shard, kv_shard = self.shard(case, comm.rank), self.kv_shard(case, comm.rank)
        heads = case.heads
        mask = pattern.dense_mask().to(q.device)  # (N, N)
        rows = torch.arange(case.seq_len - case.n_queries, case.seq_len)
        modify = score_modifier(case, torch.arange(shard.start, shard.stop), rows, torch.arange(case.seq_len),
                                q.device, accum_dtype(q.dtype))

        def call():
            # Megatron's f: identity forward; backward all-reduces dq, dk, dv (one call).
            q_all, k_all, v_all = copy_to_ranks(q, k, v)
            local = attend(shard.take(q_all), kv_shard.take(k_all), kv_shard.take(v_all), mask,
                           modify)  # (B, H/P, Nq, D)
            # Row-parallel output with an identity weight: this rank's heads in place, zeros elsewhere.
            partial = F.pad(local, (0, 0, 0, 0, shard.start, heads - shard.stop))  # (B, H, N, D)
            return reduce_from_ranks(partial)  # Megatron's g: one all-reduce of B N H D elements

        return call

    def expected_comm_bytes(self, case):
        """Ring all-reduce of S bytes sends 2(P-1)/P*S per rank, 2(P-1)*S in all.

        fwd: 2(P-1)*S_q with S_q = B*q_len*H*D*e (the output all-reduce). fwd_bwd: plus 2(P-1)*(S_q + 2 S_kv),
        S_kv = B*N*Hkv*D*e (dq, dk, dv all-reduced together). With checkpoint the recomputation re-runs some
        collectives: None (measured only). The pattern does not appear.
        """
        if case.checkpoint:
            return None
        p = case.world_size
        s_q = case.batch * case.n_queries * case.heads * case.head_dim * elem_bytes(case)
        s_kv = case.batch * case.seq_len * case.n_kv_heads * case.head_dim * elem_bytes(case)
        forward = 2 * (p - 1) * s_q
        return forward if case.mode == "fwd" else forward + 2 * (p - 1) * (s_q + 2 * s_kv)

    def expected_comm_matrix(self, case):
        """Ring all-reduces: rank r sends rank r+1 `all_reduce_sent(n, e, r, P)` bytes (bench.comm: 2(P-1)/P of
        the buffer, exactly per chunk) for n = B*q_len*H*D forward, and n + 2 B*N*Hkv*D (dq, dk, dv in one
        call) in backward. Across nodes, only the ring's steps from a node's last rank to the next node's first
        leave a node. Checkpoint: None."""
        if case.checkpoint:
            return None
        p, e = case.world_size, elem_bytes(case)
        n_q = case.batch * case.n_queries * case.heads * case.head_dim
        n_kv = case.batch * case.seq_len * case.n_kv_heads * case.head_dim
        sent = empty_matrix(p)
        for r in range(p if p > 1 else 0):
            back = 0 if case.mode == "fwd" else all_reduce_sent(n_q + 2 * n_kv, e, r, p)
            sent[r][(r + 1) % p] = all_reduce_sent(n_q, e, r, p) + back
        return sent
