"""How a distributed implementation splits a case over ranks, which is how the harness checks it.

Every rank receives the same full, seeded q (B, H, q_len, D) and k, v (B, Hkv, N, D); the implementation
takes the part it owns in `prepare` (untimed). `shard(case, rank)` names that part of q and of the output: a
range of heads (dim 1, tensor parallelism) or positions of the sequence (dim 2, context parallelism);
`kv_shard(case, rank)` the part of k and v (with grouped-query attention a head split gives each rank its
query heads' KV heads). A sequence split follows the case's `cp_layout`: `contiguous` gives rank r chunk r of
P, `zigzag` chunks r and 2P-1-r of 2P (ring-flash-attention's zigzag, torchtitan's head-tail load balancing:
with a causal mask every rank then gets as many allowed pairs). A shard is a list of ranges along its dim, in
order. The timed call returns either the full output (every rank holds it, as after tensor parallelism's
all-reduce) or the rank's shard of it (its ranges concatenated in order). In fwd_bwd each rank
backpropagates the upstream gradient of what it returned; afterwards the gradients of q, k and v are
complete on the part the rank owns. Outside the timed region the harness gathers the owned parts and checks
them, and the output, against the float64 oracle.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from bench.comm.communicator import link_bytes
from bench.registry import Impl

if TYPE_CHECKING:
    from torch import Tensor

    from bench.patterns import Pattern
    from bench.spec.case import Case

SPLIT_FIELDS = {1: "heads", 2: "seq_len"}  # dim of (B, H, N, D) -> the case field it splits


@dataclass(frozen=True)
class Shard:
    """The part of a (B, H, N, D) tensor one rank owns: the ranges [start, stop) along `dim`, in order."""

    dim: int
    ranges: tuple[tuple[int, int], ...]

    @classmethod
    def span(cls, dim: int, start: int, stop: int) -> Shard:
        """One contiguous range."""
        return cls(dim, ((start, stop),))

    @property
    def length(self) -> int:
        return sum(stop - start for start, stop in self.ranges)

    @property
    def contiguous(self) -> bool:
        return len(self.ranges) == 1

    @property
    def start(self) -> int:
        """Start of a single-range shard (a layout of several ranges has no one start)."""
        return self._single()[0]

    @property
    def stop(self) -> int:
        return self._single()[1]

    def _single(self) -> tuple[int, int]:
        if len(self.ranges) != 1:
            raise ValueError(f"this shard is {len(self.ranges)} ranges {list(self.ranges)}; use ranges or "
                             "positions()")
        return self.ranges[0]

    def positions(self) -> Tensor:
        """The owned indices along `dim`, in order (int64)."""
        import torch

        return torch.cat([torch.arange(start, stop) for start, stop in self.ranges])

    def take(self, t: Tensor) -> Tensor:
        """The owned part of t: a view for one range, the ranges concatenated (differentiable) otherwise."""
        import torch

        parts = [t.narrow(self.dim, start, stop - start) for start, stop in self.ranges]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)

    def put(self, whole: Tensor, part: Tensor) -> None:
        """Copy `part` (this shard's shape) into the owned places of `whole`."""
        offset = 0
        for start, stop in self.ranges:
            whole.narrow(self.dim, start, stop - start).copy_(part.narrow(self.dim, offset, stop - start))
            offset += stop - start

    def shape(self, full: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(self.length if d == self.dim else size for d, size in enumerate(full))


def even_split(n: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of part `index` when n items are split in `parts` equal contiguous parts."""
    size = n // parts
    return index * size, (index + 1) * size


def layout_ranges(n: int, parts: int, index: int, layout: str = "contiguous") -> tuple[tuple[int, int], ...]:
    """The ranges of part `index` of n positions over `parts` ranks: `contiguous` chunk index of P, or
    `zigzag` chunks index and 2P-1-index of 2P (adjacent ranges merged: with one part, the whole)."""
    if layout == "contiguous":
        return (even_split(n, parts, index),)
    if layout != "zigzag":
        raise ValueError(f"unknown cp_layout {layout!r}; allowed: contiguous, zigzag")
    size = n // (2 * parts)
    first = (index * size, (index + 1) * size)
    second = ((2 * parts - 1 - index) * size, (2 * parts - index) * size)
    return ((first[0], second[1]),) if first[1] == second[0] else (first, second)


def sequence_shard(case: Case, rank: int) -> Shard:
    """Rank `rank`'s positions under the case's cp_layout."""
    return Shard(2, layout_ranges(case.seq_len, case.world_size, rank, case.cp_layout))


def owned_row_pairs(pattern: Pattern, rows: Tensor, chunk: int = 512) -> int:
    """Allowed (query row, key) pairs of the given query rows of the pattern's q_len x N matrix."""
    import torch

    total = 0
    cols = torch.arange(pattern.seq_len)
    for begin in range(0, len(rows), chunk):
        total += int(pattern.mask(rows[begin : begin + chunk, None], cols[None, :]).sum())
    return total


class DistributedImpl(Impl):
    """Base of implementations that split a case over `world_size` ranks along `split_dim`.

    Give `expected_comm_bytes(case)`: the bytes all ranks send per call of the timed step (fwd, or fwd and
    bwd) in closed form, the formula in its docstring; the record keeps it beside the measured bytes. An
    implementation whose communication has levels (cp_usp: Ulysses inside groups, a ring across them) labels
    its ops (`bench.comm.Communicator.level`) and gives `expected_comm_bytes_by_level(case)` too.
    `rank_pairs(case, pattern, rank)` is the useful work of one rank - the allowed (query head, query, key)
    triples it computes - from which records give per-rank FLOPs and the imbalance; the default follows
    `shard`: a sequence split computes its positions' rows for every head, a head split its heads' rows.
    """

    distributed = True
    split_dim: ClassVar[int] = 2  # 1: heads, 2: sequence
    uses_ulysses_degree: ClassVar[bool] = False  # reads the case's ulysses_degree (cp_usp)

    def unsupported(self, case: Case) -> str | None:
        why = super().unsupported(case)
        if why:
            return why
        field = SPLIT_FIELDS[self.split_dim]
        total = getattr(case, field)
        if total % case.world_size:
            return (f"{self.name} splits {field} into world_size equal parts: {field} {total} is not divisible "
                    f"by world_size {case.world_size}")
        if self.split_dim == 1 and case.n_kv_heads % case.world_size:
            return (f"{self.name} gives each rank its query heads' KV heads: kv_heads {case.n_kv_heads} is not "
                    f"divisible by world_size {case.world_size}")
        if self.split_dim == 2 and case.n_queries != case.seq_len:
            return (f"{self.name} splits queries and keys alike along the sequence; q_len {case.n_queries} < "
                    f"seq_len {case.seq_len} (decode, chunked prefill) is not supported")
        if case.cp_layout != "contiguous" and self.split_dim != 2:
            return (f"{self.name} splits {field}, not the sequence: cp_layout {case.cp_layout!r} (a placement of "
                    "sequence chunks on ranks) does not apply")
        if case.cp_layout == "zigzag" and case.seq_len % (2 * case.world_size):
            return (f"{self.name} with cp_layout zigzag splits seq_len into 2 x world_size equal chunks: seq_len "
                    f"{case.seq_len} is not divisible by {2 * case.world_size}")
        if case.ulysses_degree is not None and not self.uses_ulysses_degree:
            return (f"ulysses_degree applies to cp_usp (Ulysses inside groups, a ring across them); {self.name} "
                    "has no Ulysses level")
        return None

    def shard(self, case: Case, rank: int) -> Shard:
        """This rank's part of q and of the output."""
        if self.split_dim == 2:
            return sequence_shard(case, rank)
        total = getattr(case, SPLIT_FIELDS[self.split_dim])
        return Shard.span(self.split_dim, *even_split(total, case.world_size, rank))

    def kv_shard(self, case: Case, rank: int) -> Shard:
        """This rank's part of k and v: its query heads' KV heads, or the same positions as its queries."""
        if self.split_dim == 1:
            return Shard.span(1, *even_split(case.n_kv_heads, case.world_size, rank))
        return self.shard(case, rank)

    def rank_pairs(self, case: Case, pattern: Pattern, rank: int) -> int:
        """Allowed (query head, query row, key) triples rank `rank` computes: its useful work."""
        shard = self.shard(case, rank)
        if shard.dim == 1:
            return shard.length * pattern.nnz
        return case.heads * owned_row_pairs(pattern, shard.positions())

    def expected_comm_bytes_by_level(self, case: Case) -> dict[str, int] | None:
        """Closed forms per communication level (the op labels), or None for a single level."""
        return None

    def expected_comm_matrix(self, case: Case) -> list[list[int]] | None:
        """Closed form of the bytes rank s sends rank d per step, sent[s][d] (ranks of the case's group; its sum
        is `expected_comm_bytes`), or None where it is not known. With the ranks' nodes it gives the bytes over
        each kind of link (`expected_comm_bytes_by_link`)."""
        return None

    def expected_comm_bytes_by_link(self, case: Case, node_of_rank: Sequence[int]) -> dict[str, int] | None:
        """{intra_node, inter_node}: `expected_comm_matrix` split by whether both ranks are on one node."""
        sent = self.expected_comm_matrix(case)
        return None if sent is None else link_bytes(sent, node_of_rank)

