"""The communication parts of a distributed record (bench.measure.ranks.rank_record assembles them): bytes per op,
level and link, each rank's share, where the ranks ran."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

_STRICT = ConfigDict(extra="forbid", frozen=True)


class CommOp(BaseModel):
    """Bytes one collective kind moved, summed over its calls (ring accounting, as nccl-tests)."""

    model_config = _STRICT
    calls: int
    bytes_total: int  # sent by all ranks
    bytes_max_rank: int  # sent by the busiest rank
    time_s: float | None = None  # summed op time on the slowest rank
    hidden_s: float | None = None  # of which overlapped the rank's compute (the largest over ranks)
    algbw_gbps: float | None = None
    busbw_gbps: float | None = None


class RankComm(BaseModel):
    """One rank's share of a distributed step (times per step, averaged over the timed steps).

    comm_s: its ops' time (an op started without waiting: its time in flight); hidden_s: the part of comm_s
    that overlapped its compute; exposed_s = comm_s - hidden_s; compute_s = step_s - exposed_s (bench.comm,
    "Overlap"). flops: the useful FLOPs of the pairs it computes. peak_bytes: its memory (memory.method)."""

    model_config = _STRICT
    rank: int
    bytes: int
    flops: float | None = None
    step_s: float | None = None
    compute_s: float | None = None
    comm_s: float | None = None
    hidden_s: float | None = None
    exposed_s: float | None = None
    peak_bytes: int | None = None


class CommLevel(BaseModel):
    """Bytes of the ops counted under one level label (cp_usp: ulysses inside groups, ring across them)."""

    model_config = _STRICT
    calls: int
    bytes_total: int
    bytes_max_rank: int
    expected_bytes: int | None = None  # the implementation's closed form for the level


class Topology(BaseModel):
    """Where a distributed pair's ranks ran: nodes in order of first appearance over the ranks."""

    model_config = _STRICT
    nodes: int
    ranks_per_node: list[int]  # per node
    node_of_rank: list[int]  # per rank: its node's index
    node_names: list[str] | None = None  # host names (with torchrun's node rank), or BENCH_NODE


class LinkBytes(BaseModel):
    """Bytes sent between ranks on one node and between ranks on different nodes."""

    model_config = _STRICT
    intra_node: int
    inter_node: int


class CommInfo(BaseModel):
    model_config = _STRICT
    backend: Literal["gloo", "nccl", "model"]
    bytes_total: int
    bytes_max_rank: int
    by_op: dict[str, CommOp]
    expected_bytes: int | None = None  # the implementation's closed form
    world_size: int | None = None
    bytes_per_rank: list[int] | None = None
    per_rank: list[RankComm] | None = None
    imbalance: float | None = None  # max / mean of the ranks' useful FLOPs
    overlap_fraction: float | None = None  # sum of hidden_s / sum of comm_s over ranks, measured
    overlap_method: Literal["host", "cuda_events"] | None = None  # how hidden_s was measured (bench.comm)
    by_level: dict[str, CommLevel] | None = None
    topology: Topology | None = None
    by_link: LinkBytes | None = None  # counted: each rank's bytes per peer, split by the peers' nodes
    expected_bytes_by_link: LinkBytes | None = None  # the implementation's closed form, same split
