"""The distributed surface: counted collectives (`communicator`, re-exported here as `bench.comm`), the timing
of transfers in flight (`timing`), differentiable collectives (`autograd`, public as `bench.comm_autograd`) and
how a distributed implementation splits a case over ranks (`sharding`, public as `bench.sharding`).

`bench.comm` is a public import path: implementations import `Communicator`, `current`, `P2P`, ... from it.
"""

from bench.comm.communicator import (
    OPS,
    P2P,
    Communicator,
    LevelStats,
    OpStats,
    Pending,
    all_reduce_sent,
    broadcast_sent,
    bus_factor,
    current,
    link_bytes,
    nbytes,
    ring_chunks,
    use,
)

__all__ = ["OPS", "P2P", "Communicator", "LevelStats", "OpStats", "Pending", "all_reduce_sent", "broadcast_sent",
           "bus_factor", "current", "link_bytes", "nbytes", "ring_chunks", "use"]
