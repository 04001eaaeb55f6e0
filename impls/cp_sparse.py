"""`cp_sparse`: context parallelism that fetches only the K/V blocks the pattern needs.

The sequence is split in P contiguous chunks of C = N/P positions. From the pattern's block layout at the
case's block_size, rank r needs key block kb when any query block overlapping its chunk has kb in its
layout row; of those blocks it fetches the positions other ranks own (for a local window: a halo of whole
blocks on each side; for longformer also the global blocks, and rank 0, whose global queries see every key,
fetches everything; for block_random the kept blocks). One all_to_all_single with uneven splits moves them;
the rank then attends its queries to its own chunk plus what it fetched. In fwd_bwd the gradients of the
fetched rows travel back by the transposed all-to-all.
"""

from __future__ import annotations

import torch

from bench.comm_autograd import all_to_all
from bench.registry import register
from bench.sharding import DistributedImpl, even_split
from impls.parallel_common import attend, communicator_for, kv_row_bytes


def needed_keys(pattern, case) -> list[torch.Tensor]:
    """Per rank: the sorted global key positions it must fetch (owned by other ranks), int64."""
    n, p, bs = case.seq_len, case.world_size, case.block_size
    layout = pattern.block_layout(bs)  # (nb, nb) bool
    out = []
    for rank in range(p):
        start, stop = even_split(n, p, rank)
        key_blocks = layout[start // bs : (stop - 1) // bs + 1].any(dim=0)  # (nb,)
        wanted = key_blocks.repeat_interleave(bs)[:n].clone()  # (N,) block -> its positions
        wanted[start:stop] = False  # its own chunk is local
        out.append(torch.nonzero(wanted).flatten())
    return out


@register
class SparseContextParallel(DistributedImpl):
    name = "cp_sparse"
    description = "sequence split in P chunks; each rank fetches only the K/V blocks its queries need (all-to-all)"
    fwd_bwd = True

    def prepare(self, case, pattern, q, k, v):
        comm = communicator_for(case)
        p, r = comm.world_size, comm.rank
        shard = self.shard(case, r)
        q_r, k_r, v_r = shard.take(q), shard.take(k), shard.take(v)  # (B, H, C, D)
        needed = needed_keys(pattern, case)
        c = shard.stop - shard.start
        # What this rank sends to each rank (positions in its own chunk), and receives from each owner.
        send_rows = [torch.zeros(0, dtype=torch.int64) if dst == r else
                     needed[dst][(needed[dst] >= shard.start) & (needed[dst] < shard.stop)] - shard.start
                     for dst in range(p)]
        recv_splits = [0 if src == r else int(((needed[r] >= src * c) & (needed[r] < (src + 1) * c)).sum())
                       for src in range(p)]
        send_splits = [len(rows) for rows in send_rows]
        send_index = torch.cat(send_rows).to(q.device)
        keys = torch.cat((torch.arange(shard.start, shard.stop), needed[r]))  # own chunk, then fetched
        rows = torch.arange(shard.start, shard.stop)
        mask = pattern.mask(rows[:, None], keys[None, :]).to(q.device)  # (C, C + fetched)

        def call():
            local = torch.stack((k_r, v_r)).permute(3, 0, 1, 2, 4)  # (C, 2, B, H, D): positions first
            fetched = all_to_all(local.index_select(0, send_index), send_splits, recv_splits)  # (F, 2, B, H, D)
            kv = torch.cat((local, fetched)).permute(1, 2, 3, 0, 4)  # (2, B, H, C + F, D)
            return attend(q_r, kv[0], kv[1], mask)

        return call

    def expected_comm_bytes(self, case):
        """Sum over ranks r of the positions r fetches, times 2*B*Hkv*D*e bytes (K and V of the KV heads):

            sum_r |{ j not in chunk r : layout[qb, j // bs] for some query block qb overlapping chunk r }|

        with layout the pattern's block layout at block_size bs. fwd_bwd: twice that (the gradients of the
        fetched rows go back). Checkpoint: None (measured only). Local window W, C a multiple of bs, and
        ceil((W//2)/bs) blocks within C: 2 (P-1) * ceil((W//2)/bs) * bs positions, so against cp_ring's
        (P-1) * N the ratio is about W/N.
        """
        if case.checkpoint:
            return None
        fetched = sum(len(keys) for keys in needed_keys(case.make_pattern(), case))
        forward = fetched * kv_row_bytes(case)
        return forward if case.mode == "fwd" else 2 * forward
