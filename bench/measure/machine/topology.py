"""Where a distributed pair's ranks run, and the bytes they send over each kind of link.

A rank's node is a label (`node_label`); the ranks gather theirs before the implementation prepares, so that
it can place its groups (cp_usp's Ulysses groups inside nodes), and the record's `comm.topology` lists them.
`comm.by_link` splits the bytes each rank sent each peer (bench.comm counts them per peer) by whether the two
ranks share a node; `comm.expected_bytes_by_link` splits the implementation's traffic matrix the same way.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bench.comm.communicator import link_bytes
from bench.results.records import LinkBytes, Topology

if TYPE_CHECKING:
    from bench.measure.ranks.rank_part import RankPart


def node_label() -> str:
    """The node this rank runs on: BENCH_NODE where set (a placement declared by hand or simulated by the
    runner); else the host name, with torchrun's node rank (GROUP_RANK) so that two launchers on one host are two
    nodes, as they would be on two hosts."""
    explicit = os.environ.get("BENCH_NODE")
    if explicit:
        return explicit
    host = socket.gethostname()
    group = os.environ.get("GROUP_RANK")
    return f"{host}#{group}" if group is not None else host


def node_of_rank(control: Any, world_size: int, label: str) -> list[int]:
    """Every rank's node as an index (in order of first appearance over the ranks), gathered over the control
    group."""
    import torch.distributed as dist

    labels: list[Any] = [None] * world_size
    dist.all_gather_object(labels, label, group=control)
    return topology_of(labels).node_of_rank


def topology_of(labels: list[Any]) -> Topology:
    """{nodes, ranks_per_node, node_of_rank, node_names} from each rank's node label."""
    names: list[str] = []
    for label in labels:
        if label not in names:
            names.append(str(label))
    node_of_rank = [names.index(str(label)) for label in labels]
    return Topology(nodes=len(names), ranks_per_node=[node_of_rank.count(n) for n in range(len(names))],
                    node_of_rank=node_of_rank, node_names=names)


@dataclass(frozen=True)
class Links:
    """The record's comm.topology, comm.by_link and comm.expected_bytes_by_link."""

    topology: Topology
    by_link: LinkBytes
    expected_bytes_by_link: LinkBytes | None


def links(parts: Sequence[RankPart], expected_matrix: list[list[int]] | None) -> Links | None:
    """topology (each rank's node), by_link (the bytes the ranks sent over intra- and inter-node links, from
    each rank's bytes per peer) and expected_bytes_by_link (the implementation's traffic matrix, same split);
    None when a rank did not say its node."""
    if any(p.node is None for p in parts):
        return None
    topology = topology_of([p.node for p in parts])
    sent = [[int(p.peers.get(str(dst), 0)) for dst in range(len(parts))] for p in parts]
    nodes = topology.node_of_rank
    return Links(topology, LinkBytes(**link_bytes(sent, nodes)),
                 None if expected_matrix is None else LinkBytes(**link_bytes(expected_matrix, nodes)))
