"""`cp_ring`: context parallelism with ring attention, communication overlapped with compute.

The sequence is split over the P ranks by the case's cp_layout (contiguous: chunk r of P; zigzag: chunks r and
2P-1-r of 2P, which balances a causal mask); rank r owns queries, keys and values of its positions. K and V of
each rank travel round the ring: at step t rank r holds the block of rank (r - t) mod P and attends to it while
the shift that brings the next block is already in flight (isend/irecv through bench.comm, started before the
block's compute and waited for after it, as ring-flash-attention and PyTorch's context parallel do). Partial
results are merged with their log-sum-exps, so no rank ever holds more than two K/V blocks at once. Blocks
with no allowed pair are not computed, but K/V still go round the whole ring: the bytes do not depend on the
pattern.

fwd_bwd: the backward is written out (`impls.parallel_common.ring_attention`): K/V go round again while each
block's gradients are computed, and each block's dK/dV (float32 for low precision) travel with it back to the
owner, also overlapped. Shifts are counted under the level "ring".
"""

from __future__ import annotations

import torch

from bench.registry import register
from bench.sharding import DistributedImpl
from impls.parallel_common import Ring, communicator_for, ring_attention, ring_bytes, ring_matrix


@register
class RingContextParallel(DistributedImpl):
    name = "cp_ring"
    description = ("sequence split over P ranks (contiguous or zigzag); K/V passed round the ring, the next shift "
                   "in flight while the current block computes; log-sum-exp merge")
    fwd_bwd = True

    def prepare(self, case, pattern, q, k, v):
        comm = communicator_for(case)
        p, r = comm.world_size, comm.rank
        shard = self.shard(case, r)
        rows = shard.positions()
        masks: list[torch.Tensor | None] = []
        for step in range(p):
            cols = self.shard(case, (r - step) % p).positions()
            mask = pattern.mask(rows[:, None], cols[None, :])  # (C, C)
            masks.append(mask.to(q.device) if bool(mask.any()) else None)
        ring = Ring(comm, p, (r + 1) % p, (r - 1) % p, tuple(masks))

        def call():
            # the rank's positions taken in the call (zigzag: its two chunks copied), so that it reads the inputs
            # as they are when it runs
            q_r, k_r, v_r = shard.take(q), shard.take(k), shard.take(v)  # (B, H or Hkv, C, D)
            return ring_attention(q_r, k_r, v_r, ring)

        return call

    def expected_comm_bytes(self, case):
        """Every rank sends its current K/V block (C = N/P rows of 2*B*Hkv*D*e bytes) P-1 times.

        fwd: P * (P-1) * C * 2*B*Hkv*D*e = (P-1) * N * 2*B*Hkv*D*e, whatever the layout. fwd_bwd: K/V go round
        again (as much again) and the dK/dV of every block make P shifts back to its owner, in the accumulation
        dtype a (4 bytes: float32): + (P-1) * N * 2*B*Hkv*D*e + P * N * 2*B*Hkv*D*a. Checkpoint: None
        (recomputation re-runs shifts; measured only). The pattern does not appear.
        """
        if case.checkpoint:
            return None
        return ring_bytes(case, case.world_size, case.n_kv_heads)

    def expected_comm_bytes_by_level(self, case):
        total = self.expected_comm_bytes(case)
        return None if total is None else {"ring": total}

    def expected_comm_matrix(self, case):
        """Every rank sends all it sends to rank r+1: 1/P of `expected_comm_bytes` (each rank passes P-1 K/V
        blocks of the same size, and in fwd_bwd P-1 more and P dK/dV blocks)."""
        total = self.expected_comm_bytes(case)
        return None if total is None else ring_matrix(case.world_size, total // case.world_size)
