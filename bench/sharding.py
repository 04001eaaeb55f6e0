"""How a distributed implementation splits a case over ranks, which is how the harness checks it.

Every rank receives the same full, seeded q (B, H, q_len, D) and k, v (B, Hkv, N, D); the implementation
takes the part it owns in `prepare` (untimed). `shard(case, rank)` names that part of q and of the output: a
range of heads (dim 1, tensor parallelism) or of the sequence (dim 2, context parallelism); `kv_shard(case,
rank)` the part of k and v (with grouped-query attention a head split gives each rank its query heads' KV
heads). The timed call returns either the full output (every rank holds
it, as after tensor parallelism's all-reduce) or the rank's shard of it. In fwd_bwd each rank backpropagates
the upstream gradient of what it returned; afterwards the gradients of q, k and v are complete on the part
the rank owns. Outside the timed region the harness gathers the owned parts and checks them, and the output,
against the float64 oracle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from bench.registry import Impl

if TYPE_CHECKING:
    from torch import Tensor

    from bench.spec.case import Case

SPLIT_FIELDS = {1: "heads", 2: "seq_len"}  # dim of (B, H, N, D) -> the case field it splits


@dataclass(frozen=True)
class Shard:
    """The part of a (B, H, N, D) tensor one rank owns: [start, stop) along `dim`."""

    dim: int
    start: int
    stop: int

    def take(self, t: Tensor) -> Tensor:
        return t.narrow(self.dim, self.start, self.stop - self.start)

    def shape(self, full: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(self.stop - self.start if d == self.dim else size for d, size in enumerate(full))


def even_split(n: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of part `index` when n items are split in `parts` equal contiguous parts."""
    size = n // parts
    return index * size, (index + 1) * size


class DistributedImpl(Impl):
    """Base of implementations that split a case over `world_size` ranks along `split_dim`.

    Give `expected_comm_bytes(case)`: the bytes all ranks send per call of the timed step (fwd, or fwd and
    bwd) in closed form, the formula in its docstring; the record keeps it beside the measured bytes.
    """

    distributed = True
    split_dim: ClassVar[int] = 2  # 1: heads, 2: sequence

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
        return None

    def shard(self, case: Case, rank: int) -> Shard:
        """This rank's part of q and of the output."""
        total = getattr(case, SPLIT_FIELDS[self.split_dim])
        return Shard(self.split_dim, *even_split(total, case.world_size, rank))

    def kv_shard(self, case: Case, rank: int) -> Shard:
        """This rank's part of k and v: its query heads' KV heads, or the same positions as its queries."""
        if self.split_dim == 1:
            return Shard(1, *even_split(case.n_kv_heads, case.world_size, rank))
        return self.shard(case, rank)
