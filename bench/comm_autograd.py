"""Public import path of `bench.comm.autograd` (collectives that autograd differentiates through)."""

from bench.comm.autograd import all_gather, all_to_all, copy_to_ranks, keep_in_graph, reduce_from_ranks, ring_shift

__all__ = ["all_gather", "all_to_all", "copy_to_ranks", "keep_in_graph", "reduce_from_ranks", "ring_shift"]
