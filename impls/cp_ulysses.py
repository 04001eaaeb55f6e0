"""`cp_ulysses`: DeepSpeed-Ulysses sequence parallelism (all-to-all between sequence and head shards).

Every rank holds its positions of the sequence (the case's cp_layout: contiguous chunks or zigzag pairs) for
all heads. One all-to-all (q, k and v together) turns that into all positions for H/P of the heads: rank r
gets head group r from every rank. Each rank then attends over the whole sequence with its heads - the mask's
rows and columns in the gathered order, rank by rank, so any layout works and no rank has more pairs than
another - and a second all-to-all sends every rank its positions back, all heads. fwd_bwd: the two
exchanges run backwards for the gradients (autograd through `bench.comm_autograd.all_to_all`).

Grouped-query attention: with kv_heads % P == 0 each rank gets kv_heads/P KV heads, its query heads' own; with
P % kv_heads == 0 each KV head is repeated P/kv_heads times before the exchange so that every rank gets the
one its query heads read (DeepSpeed-Ulysses does the same); other kv_heads are unsupported. The all-to-alls
are counted under the level "ulysses".
"""

from __future__ import annotations

import torch

from bench.registry import register
from bench.sharding import DistributedImpl
from impls.common import accum_dtype
from impls.parallel_common import (
    UlyssesGroup,
    attend,
    communicator_for,
    score_modifier,
    ulysses_bytes,
    ulysses_gather_heads,
    ulysses_kv_heads,
    ulysses_peer_bytes,
    ulysses_problem,
    ulysses_scatter_heads,
)


@register
class UlyssesContextParallel(DistributedImpl):
    name = "cp_ulysses"
    description = ("sequence split over P ranks; all-to-all to H/P heads over the whole sequence, attention, "
                   "all-to-all back (DeepSpeed-Ulysses)")
    fwd_bwd = True
    score_mods = frozenset({"softcap", "alibi", "relative_bias", "custom"})  # on its own heads and positions

    def unsupported(self, case):
        why = super().unsupported(case)
        if why:
            return why
        return ulysses_problem(self.name, case.heads, case.n_kv_heads, case.world_size, "world_size")

    def prepare(self, case, pattern, q, k, v):
        comm = communicator_for(case)
        p, r = comm.world_size, comm.rank
        shard = self.shard(case, r)
        repeat = ulysses_kv_heads(case.heads, case.n_kv_heads, p) // case.n_kv_heads
        group = UlyssesGroup(tuple(range(p)), r, p)
        order = self._gathered_order(case)
        mask = pattern.mask(order[:, None], order[None, :]).to(q.device)  # (N, N) in the gathered order
        per = case.heads // p  # this rank's head group after the all-to-all: heads [r H/P, (r+1) H/P)
        modify = score_modifier(case, torch.arange(r * per, (r + 1) * per), order + case.seq_len - case.n_queries,
                                order, q.device, accum_dtype(q.dtype))

        def call():
            # the rank's positions taken in the call (zigzag: its two chunks copied), so that it reads the inputs
            # as they are when it runs
            q_r, k_r, v_r = shard.take(q), shard.take(k), shard.take(v)  # (B, H or Hkv, C, D)
            k_x, v_x = (k_r, v_r) if repeat == 1 else (t.repeat_interleave(repeat, dim=1) for t in (k_r, v_r))
            q_h, k_h, v_h = ulysses_scatter_heads(group, (q_r, k_x, v_x))  # (B, H/P, N, D), (B, Hkv'/P, N, D)
            return ulysses_gather_heads(group, attend(q_h, k_h, v_h, mask, modify))  # (B, H, C, D)

        return call

    def _gathered_order(self, case):
        import torch

        return torch.cat([self.shard(case, src).positions() for src in range(case.world_size)])

    def rank_pairs(self, case, pattern, rank):
        """Every rank computes every allowed pair for its H/P heads."""
        return case.heads // case.world_size * pattern.nnz

    def expected_comm_bytes(self, case):
        """Each rank sends (P-1)/P of its q, k, v (one all-to-all) and of the output (the second):

        fwd: (P-1)/P * B*N*(2H + 2Hkv')*D*e, Hkv' = kv_heads when kv_heads % P == 0, else P (the repeated KV
        heads). fwd_bwd: twice that (the gradients of the output and of q, k, v go back the same ways).
        Checkpoint: None (measured only). Neither the pattern nor the layout appears.
        """
        if case.checkpoint:
            return None
        return ulysses_bytes(case, case.world_size)

    def expected_comm_bytes_by_level(self, case):
        total = self.expected_comm_bytes(case)
        return None if total is None else {"ulysses": total}

    def expected_comm_matrix(self, case):
        """All-to-all over every rank: each rank sends each other rank `ulysses_peer_bytes(case, P)`, 1/P of its
        q, k, v and of its output, B*(N/P)*D*(2H + 2Hkv')/P elements (twice in fwd_bwd)."""
        if case.checkpoint:
            return None
        p, peer = case.world_size, ulysses_peer_bytes(case, case.world_size)
        return [[0 if s == d else peer for d in range(p)] for s in range(p)]
