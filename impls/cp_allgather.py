"""`cp_allgather`: context parallelism with K/V all-gathered.

The sequence is split over the P ranks by the case's cp_layout (C = N/P positions each: contiguous chunks or
zigzag pairs); every rank all-gathers K and V (one call, both stacked) and attends its own queries to the whole
sequence under the pattern, its mask's columns in the gathered order (rank by rank). Simple and
pattern-blind: every rank receives all of K and V. In fwd_bwd the gradient of the gathered K/V is
reduce-scattered back to the owners.
"""

from __future__ import annotations

import torch

from bench.comm_autograd import all_gather
from bench.registry import register
from bench.sharding import DistributedImpl
from impls.common import accum_dtype
from impls.parallel_common import attend, communicator_for, kv_row_bytes, ring_matrix, score_modifier


@register
class AllGatherContextParallel(DistributedImpl):
    name = "cp_allgather"
    description = "sequence split over P ranks; K/V all-gathered, local queries against the whole sequence"
    fwd_bwd = True
    score_mods = frozenset({"softcap", "alibi", "relative_bias", "custom"})  # on its own heads and positions

    def prepare(self, case, pattern, q, k, v):
        comm = communicator_for(case)
        shard = self.shard(case, comm.rank)
        b, hkv, n, d = k.shape
        rows = shard.positions()
        gathered_order = torch.cat([self.shard(case, src).positions() for src in range(comm.world_size)])
        mask = pattern.mask(rows[:, None], gathered_order[None, :]).to(q.device)  # (C, N)
        modify = score_modifier(case, torch.arange(case.heads), rows + case.seq_len - case.n_queries,
                                gathered_order, q.device, accum_dtype(q.dtype))

        def call():
            # the rank's positions taken in the call (zigzag: its two chunks copied), so that it reads the inputs
            # as they are when it runs
            q_r, k_r, v_r = shard.take(q), shard.take(k), shard.take(v)  # (B, H, C, D)
            gathered = all_gather(torch.stack((k_r, v_r)))  # (P, 2, B, H, C, D)
            kv = gathered.permute(1, 2, 3, 0, 4, 5).reshape(2, b, hkv, n, d)  # ranks' positions in rank order
            return attend(q_r, kv[0], kv[1], mask, modify)

        return call

    def expected_comm_bytes(self, case):
        """All-gather of K/V: each rank sends its chunk (C = N/P rows of 2*B*Hkv*D*e bytes) to P-1 ranks.

        fwd: P * (P-1) * C * 2*B*Hkv*D*e = 2 (P-1) * B*Hkv*N*D*e, whatever the layout. fwd_bwd: twice that
        (the reduce-scatter of dK/dV moves as much). Checkpoint: None (measured only). The pattern does not
        appear.
        """
        if case.checkpoint:
            return None
        p = case.world_size
        forward = (p - 1) * case.seq_len * kv_row_bytes(case)
        return forward if case.mode == "fwd" else 2 * forward

    def expected_comm_matrix(self, case):
        """A ring all-gather (and in fwd_bwd a ring reduce-scatter): every rank sends rank r+1 (P-1) chunks of
        C = N/P rows of 2*B*Hkv*D*e bytes, each time."""
        if case.checkpoint:
            return None
        p = case.world_size
        per_rank = (p - 1) * (case.seq_len // p) * kv_row_bytes(case)
        return ring_matrix(p, per_rank if case.mode == "fwd" else 2 * per_rank)
