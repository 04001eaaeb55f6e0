"""`cp_ring`: context parallelism with ring attention.

The sequence is split in P contiguous chunks of C = N/P positions; rank r owns queries, keys and values of
chunk r. K and V of each chunk travel round the ring: at step t rank r holds chunk (r - t) mod P, attends
to it, and passes it on (P-1 shifts). Partial results are merged with their log-sum-exps, so no rank ever
holds more than two K/V chunks at once in the forward pass. Blocks with no allowed pair are not computed,
but K/V still go round the whole ring: the bytes do not depend on the pattern.

Each shift is a blocking batch_isend_irecv (no overlap of communication with compute). In fwd_bwd autograd
keeps the received chunks and sends dK/dV back round the ring, one reverse shift per forward shift.
"""

from __future__ import annotations

import torch

from bench.comm_autograd import keep_in_graph, ring_shift
from bench.registry import register
from bench.sharding import DistributedImpl
from impls.parallel_common import attend_with_lse, communicator_for, kv_row_bytes, merge


@register
class RingContextParallel(DistributedImpl):
    name = "cp_ring"
    description = "sequence split in P chunks; K/V passed round the ring (P-1 shifts), log-sum-exp merge"
    fwd_bwd = True

    def prepare(self, case, pattern, q, k, v):
        comm = communicator_for(case)
        p, r = comm.world_size, comm.rank
        shard = self.shard(case, r)
        q_r, k_r, v_r = shard.take(q), shard.take(k), shard.take(v)  # (B, H or Hkv, C, D), views
        c = shard.stop - shard.start
        rows = torch.arange(shard.start, shard.stop)
        masks: list[torch.Tensor | None] = []
        for step in range(p):
            src = (r - step) % p
            cols = torch.arange(src * c, (src + 1) * c)
            mask = pattern.mask(rows[:, None], cols[None, :])  # (C, C)
            masks.append(mask.to(q.device) if bool(mask.any()) else None)

        def call():
            kv = torch.stack((k_r, v_r))  # (2, B, H, C, D)
            out = lse = None
            unused = []  # chunks with no allowed pair here: kept in the graph so their shifts' backward runs
            for step in range(p):
                if step:
                    kv = ring_shift(kv)
                if masks[step] is None:
                    unused.append(kv)
                    continue
                o, l = attend_with_lse(q_r, kv[0], kv[1], masks[step])
                out, lse = (o, l) if out is None else merge(out, lse, o, l)
            out = torch.zeros_like(q_r) if out is None else out.to(q.dtype)
            return keep_in_graph(out, *unused) if unused else out

        return call

    def expected_comm_bytes(self, case):
        """Every rank sends its current K/V chunk (C = N/P rows of 2*B*Hkv*D*e bytes) P-1 times.

        fwd: P * (P-1) * C * 2*B*H*D*e = 2 (P-1) * B*Hkv*N*D*e. fwd_bwd: twice that (dK/dV go back round the
        ring). Checkpoint: None (recomputation re-runs shifts; measured only). The pattern does not appear.
        """
        if case.checkpoint:
            return None
        p = case.world_size
        forward = (p - 1) * case.seq_len * kv_row_bytes(case)
        return forward if case.mode == "fwd" else 2 * forward
