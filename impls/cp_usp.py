"""`cp_usp`: unified sequence parallelism (USP, yunchang's LongContextAttention): Ulysses inside groups, a ring
across them.

The P ranks form P/u Ulysses groups of u consecutive ranks (u = the case's ulysses_degree) and u rings of
R = P/u ranks (rank r is in ring r % u, at place r // u). Every rank holds its positions of the sequence (the
case's cp_layout) for all heads. An all-to-all inside the group gives each member H/u of the heads over the
positions of the whole group (N/R); ring attention across the groups then passes those K/V blocks round the
ring of the members with the same heads, the next shift in flight while the current block computes (as
cp_ring, `impls.parallel_common.ring_attention`); an all-to-all inside the group sends every member its
positions back, all heads. With a zigzag layout over the P ranks each group holds a zigzag pair of chunks of
the R-way split, so the ring is balanced too.

The Ulysses all-to-alls are counted under the level "ulysses", the ring shifts under "ring". (The all-to-all
spans every rank and sends nothing outside the group, the bytes a group communicator would move; a real USP
builds one communicator per group.) ulysses_degree null: the largest proper divisor of P that the heads allow
(so both levels exist from P = 4; P = 2 is a ring of two) whose groups of consecutive ranks each lie on one node,
where the harness knows the ranks' nodes (`bench.comm.current().node_of_rank`): the all-to-alls, the larger share,
stay on the fast links inside a node and only the ring crosses nodes. Records say where the groups are
(`config.ulysses_groups`: inside nodes | across nodes). u = P is Ulysses alone, u = 1 the ring alone.
Grouped-query attention as in cp_ulysses, at u ranks per group.
"""

from __future__ import annotations

import torch

from bench.comm import current
from bench.registry import register
from bench.sharding import DistributedImpl, owned_row_pairs
from impls.parallel_common import (
    Ring,
    UlyssesGroup,
    communicator_for,
    empty_matrix,
    ring_attention,
    ring_bytes,
    ring_matrix,
    ulysses_bytes,
    ulysses_gather_heads,
    ulysses_kv_heads,
    ulysses_peer_bytes,
    ulysses_problem,
    ulysses_scatter_heads,
)


def default_degree(heads: int, kv_heads: int, world_size: int, node_of_rank: list[int] | None = None) -> int:
    """The largest divisor of world_size below it that the heads allow (1 for one or two ranks), and with
    `node_of_rank` whose groups lie inside nodes (1 at worst: a ring alone)."""
    for d in range(world_size - 1, 0, -1):
        if world_size % d == 0 and ulysses_problem("", heads, kv_heads, d, "") is None and (
                node_of_rank is None or groups_inside_nodes(d, node_of_rank)):
            return d
    return 1


def groups_inside_nodes(degree: int, node_of_rank: list[int]) -> bool:
    """Every group of `degree` consecutive ranks lies on one node."""
    return all(len(set(node_of_rank[g:g + degree])) == 1 for g in range(0, len(node_of_rank), degree))


def topology(case) -> list[int] | None:
    """The ranks' nodes, when the case is being measured on a group whose nodes the harness knows."""
    comm = current()
    return comm.node_of_rank if comm.world_size == case.world_size else None


@register
class UnifiedSequenceParallel(DistributedImpl):
    name = "cp_usp"
    description = ("Ulysses all-to-all inside groups of ulysses_degree ranks, ring attention across the groups "
                   "(USP); contiguous or zigzag")
    fwd_bwd = True
    uses_ulysses_degree = True

    def __init__(self) -> None:
        self._extras: dict[str, object] = {}

    def degree(self, case) -> int:
        """u: the case's ulysses_degree, or the default."""
        if case.ulysses_degree is not None:
            return case.ulysses_degree
        return default_degree(case.heads, case.n_kv_heads, case.world_size, topology(case))

    def unsupported(self, case):
        why = super().unsupported(case)
        if why:
            return why
        u = self.degree(case)
        if case.world_size % u:
            return f"{self.name}: ulysses_degree {u} does not divide world_size {case.world_size}"
        return ulysses_problem(self.name, case.heads, case.n_kv_heads, u, "ulysses_degree")

    def _groups(self, case):
        u = self.degree(case)
        p = case.world_size
        return u, p // u

    def group_positions(self, case, group: int) -> torch.Tensor:
        """The positions Ulysses group `group` holds after its all-to-all: its members' in member order."""
        u, _ = self._groups(case)
        return torch.cat([self.shard(case, m).positions() for m in range(group * u, (group + 1) * u)])

    def prepare(self, case, pattern, q, k, v):
        comm = communicator_for(case)
        p, r = comm.world_size, comm.rank
        u, rings = self._groups(case)
        place, index = r // u, r % u
        self._extras = {"ulysses_degree": u, "ring_degree": rings}
        nodes = topology(case)
        if nodes is not None:
            self._extras["ulysses_groups"] = "inside nodes" if groups_inside_nodes(u, nodes) else "across nodes"
        shard = self.shard(case, r)
        repeat = ulysses_kv_heads(case.heads, case.n_kv_heads, u) // case.n_kv_heads
        group = UlyssesGroup(tuple(range(place * u, (place + 1) * u)), index, p)
        rows = self.group_positions(case, place)
        masks: list[torch.Tensor | None] = []
        for step in range(rings):
            cols = self.group_positions(case, (place - step) % rings)
            mask = pattern.mask(rows[:, None], cols[None, :])  # (N/R, N/R)
            masks.append(mask.to(q.device) if bool(mask.any()) else None)
        ring = Ring(comm, rings, (r + u) % p, (r - u) % p, tuple(masks))

        def call():
            # the rank's positions taken in the call (zigzag: its two chunks copied), so that it reads the inputs
            # as they are when it runs
            q_r, k_r, v_r = shard.take(q), shard.take(k), shard.take(v)  # (B, H or Hkv, C, D)
            if u == 1:
                return ring_attention(q_r, k_r, v_r, ring)
            k_x, v_x = (k_r, v_r) if repeat == 1 else (t.repeat_interleave(repeat, dim=1) for t in (k_r, v_r))
            q_h, k_h, v_h = ulysses_scatter_heads(group, (q_r, k_x, v_x))  # (B, H/u, N/R, D), (B, Hkv'/u, ...)
            return ulysses_gather_heads(group, ring_attention(q_h, k_h, v_h, ring))  # (B, H, C, D)

        return call

    def record_extras(self):
        return dict(self._extras)

    def rank_pairs(self, case, pattern, rank):
        """H/u heads over the rows of the rank's Ulysses group."""
        u, _ = self._groups(case)
        return case.heads // u * owned_row_pairs(pattern, self.group_positions(case, rank // u))

    def expected_comm_bytes(self, case):
        """The sum of the two levels (`expected_comm_bytes_by_level`)."""
        levels = self.expected_comm_bytes_by_level(case)
        return None if levels is None else sum(levels.values())

    def expected_comm_bytes_by_level(self, case):
        """u ranks per Ulysses group, R = P/u per ring, Hkv' = kv_heads if kv_heads % u == 0 else u.

        ulysses: (u-1)/u * B*N*(2H + 2Hkv')*D*e forward (q, k, v in, output out, inside each group); fwd_bwd
        twice that. ring: (R-1) * N * 2*B*Hkv'*D*e forward (every group's K/V block, N/R positions at Hkv'/u
        heads on each of its u members, passed R-1 times); fwd_bwd adds (R-1) * N * 2*B*Hkv'*D*e (K/V round
        again) + R * N * 2*B*Hkv'*D*a (dK/dV home, accumulation dtype a). Checkpoint: None (measured only).
        """
        if case.checkpoint:
            return None
        u, rings = self._groups(case)
        kv = ulysses_kv_heads(case.heads, case.n_kv_heads, u)
        return {"ulysses": ulysses_bytes(case, u) if u > 1 else 0, "ring": ring_bytes(case, rings, kv)}

    def expected_comm_matrix(self, case):
        """Ulysses: each rank sends each other member of its group (ranks g*u .. g*u+u-1) `ulysses_peer_bytes`;
        ring: each rank sends rank (r + u) % P, the next member of its ring, 1/P of the ring level's bytes."""
        levels = self.expected_comm_bytes_by_level(case)
        if levels is None:
            return None
        u, _ = self._groups(case)
        p = case.world_size
        sent = ring_matrix(p, levels["ring"] // p, step=u) if p // u > 1 else empty_matrix(p)
        if u > 1:
            peer = ulysses_peer_bytes(case, u)
            for r in range(p):
                for m in range(r // u * u, (r // u + 1) * u):
                    if m != r:
                        sent[r][m] += peer
        return sent
