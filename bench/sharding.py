"""Public import path of `bench.comm.sharding` (how a distributed implementation splits a case over ranks)."""

from bench.comm.sharding import DistributedImpl, Shard, even_split, layout_ranges, owned_row_pairs, sequence_shard

__all__ = ["DistributedImpl", "Shard", "even_split", "layout_ranges", "owned_row_pairs", "sequence_shard"]
