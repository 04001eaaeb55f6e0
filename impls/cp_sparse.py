"""`cp_sparse`: context parallelism that fetches only the K/V blocks the pattern needs.

The sequence is split over the P ranks by the case's cp_layout (C = N/P positions each: contiguous chunks or
zigzag pairs). From the pattern's block layout at the case's block_size, rank r needs key block kb when any
query block overlapping its positions has kb in its layout row; of those blocks it fetches the positions other
ranks own (for a local window: a halo of whole
blocks on each side; for longformer also the global blocks, and rank 0, whose global queries see every key,
fetches everything; for block_random the kept blocks). One all_to_all_single with uneven splits moves them;
the rank then attends its queries to its own chunk plus what it fetched. In fwd_bwd the gradients of the
fetched rows travel back by the transposed all-to-all.
"""

from __future__ import annotations

import torch

from bench.comm_autograd import all_to_all
from bench.registry import register
from bench.sharding import DistributedImpl, Shard, sequence_shard
from impls.common import accum_dtype
from impls.parallel_common import attend, communicator_for, kv_row_bytes, score_modifier


def needed_keys(pattern, case) -> list[torch.Tensor]:
    """Per rank: the sorted global key positions it must fetch (owned by other ranks), int64."""
    n, p, bs = case.seq_len, case.world_size, case.block_size
    layout = pattern.block_layout(bs)  # (nb, nb) bool
    out = []
    for rank in range(p):
        shard = sequence_shard(case, rank)
        key_blocks = torch.zeros(layout.shape[1], dtype=torch.bool)
        for start, stop in shard.ranges:
            key_blocks |= layout[start // bs : (stop - 1) // bs + 1].any(dim=0)  # (nb,)
        wanted = key_blocks.repeat_interleave(bs)[:n].clone()  # (N,) block -> its positions
        wanted[shard.positions()] = False  # its own positions are local
        out.append(torch.nonzero(wanted).flatten())
    return out


def owners(shards: list[Shard], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(owner rank, index within the owner's shard) of every position, int64 (N,) each."""
    owner, local = torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=torch.int64)
    for rank, shard in enumerate(shards):
        positions = shard.positions()
        owner[positions] = rank
        local[positions] = torch.arange(len(positions))
    return owner, local


@register
class SparseContextParallel(DistributedImpl):
    name = "cp_sparse"
    description = ("sequence split over P ranks; each rank fetches only the K/V blocks its queries need "
                   "(all-to-all)")
    fwd_bwd = True
    score_mods = frozenset({"softcap", "alibi", "relative_bias", "custom"})  # on its own heads and positions

    def prepare(self, case, pattern, q, k, v):
        comm = communicator_for(case)
        p, r = comm.world_size, comm.rank
        shards = [self.shard(case, rank) for rank in range(p)]
        shard = shards[r]
        needed = needed_keys(pattern, case)
        owner, local_index = owners(shards, case.seq_len)
        # What this rank sends to each rank (indices into its own positions), and receives from each owner:
        # every owner's rows in position order, owners in rank order.
        send_rows = [torch.zeros(0, dtype=torch.int64) if dst == r
                     else local_index[needed[dst][owner[needed[dst]] == r]] for dst in range(p)]
        fetched = [needed[r][owner[needed[r]] == src] for src in range(p)]
        recv_splits = [len(rows) for rows in fetched]
        send_splits = [len(rows) for rows in send_rows]
        send_index = torch.cat(send_rows).to(q.device)
        rows = shard.positions()
        keys = torch.cat((rows, *fetched))  # own positions, then the fetched ones in the order they arrive
        mask = pattern.mask(rows[:, None], keys[None, :]).to(q.device)  # (C, C + fetched)
        modify = score_modifier(case, torch.arange(case.heads), rows + case.seq_len - case.n_queries, keys,
                                q.device, accum_dtype(q.dtype))

        def call():
            # the rank's positions taken in the call (zigzag: its two chunks copied), so that it reads the inputs
            # as they are when it runs
            q_r, k_r, v_r = shard.take(q), shard.take(k), shard.take(v)  # (B, H, C, D)
            local = torch.stack((k_r, v_r)).permute(3, 0, 1, 2, 4)  # (C, 2, B, H, D): positions first
            fetched = all_to_all(local.index_select(0, send_index), send_splits, recv_splits)  # (F, 2, B, H, D)
            kv = torch.cat((local, fetched)).permute(1, 2, 3, 0, 4)  # (2, B, H, C + F, D)
            return attend(q_r, kv[0], kv[1], mask, modify)

        return call

    def expected_comm_bytes(self, case):
        """Sum over ranks r of the positions r fetches, times 2*B*Hkv*D*e bytes (K and V of the KV heads):

            sum_r |{ j not owned by r : layout[qb, j // bs] for some query block qb overlapping r's positions }|

        with layout the pattern's block layout at block_size bs and the positions of the case's cp_layout.
        fwd_bwd: twice that (the gradients of the fetched rows go back). Checkpoint: None (measured only).
        Local window W, contiguous, C a multiple of bs, and ceil((W//2)/bs) blocks within C: 2 (P-1) *
        ceil((W//2)/bs) * bs positions, so against cp_ring's (P-1) * N the ratio is about W/N; zigzag has
        twice the boundaries between ranks (2P-2 of the 2P-1 between its 2P chunks), so about twice the halo.
        """
        if case.checkpoint:
            return None
        fetched = sum(len(keys) for keys in needed_keys(case.make_pattern(), case))
        forward = fetched * kv_row_bytes(case)
        return forward if case.mode == "fwd" else 2 * forward

    def expected_comm_matrix(self, case):
        """sent[o][r]: the rows of owner o among the positions r fetches, times 2*B*Hkv*D*e; in fwd_bwd their
        gradients also go back, sent[r][o] as much. A local window's halo crosses only the boundaries between
        consecutive ranks, so across nodes only a node's first and last ranks send over the inter-node link."""
        if case.checkpoint:
            return None
        p = case.world_size
        owner, _ = owners([self.shard(case, r) for r in range(p)], case.seq_len)
        sent = [[0] * p for _ in range(p)]
        row = kv_row_bytes(case)
        for r, keys in enumerate(needed_keys(case.make_pattern(), case)):
            for o, count in enumerate(torch.bincount(owner[keys], minlength=p).tolist()):
                sent[o][r] += count * row
                if case.mode != "fwd":
                    sent[r][o] += count * row
        return sent
