"""Where a distributed pair's ranks run, and the bytes they send over each kind of link.

A rank's node is a label (`node_label`); the ranks gather theirs before the implementation prepares, so that
it can place its groups (cp_usp's Ulysses groups inside nodes), and the record's `comm.topology` lists them.
`comm.by_link` splits the bytes each rank sent each peer (bench.comm counts them per peer) by whether the two
ranks share a node; `comm.expected_bytes_by_link` splits the implementation's traffic matrix the same way.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from bench.comm import link_bytes


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
    return topology_of(labels)["node_of_rank"]


def topology_of(labels: list[Any]) -> dict[str, Any]:
    """{nodes, ranks_per_node, node_of_rank, node_names} from each rank's node label."""
    names: list[str] = []
    for label in labels:
        if label not in names:
            names.append(str(label))
    node_of_rank = [names.index(str(label)) for label in labels]
    return {"nodes": len(names), "ranks_per_node": [node_of_rank.count(n) for n in range(len(names))],
            "node_of_rank": node_of_rank, "node_names": names}


def links(parts: list[dict[str, Any]], expected_matrix: list[list[int]] | None) -> dict[str, Any]:
    """topology (each rank's node), by_link (the bytes the ranks sent over intra- and inter-node links, from
    each rank's bytes per peer) and expected_bytes_by_link (the implementation's traffic matrix, same split)."""
    if any("node" not in p or "peers" not in p for p in parts):
        return {}
    topology = topology_of([p["node"] for p in parts])
    sent = [[int(p["peers"].get(str(dst), 0)) for dst in range(len(parts))] for p in parts]
    nodes = topology["node_of_rank"]
    return {"topology": topology, "by_link": link_bytes(sent, nodes),
            "expected_bytes_by_link": None if expected_matrix is None else link_bytes(expected_matrix, nodes)}
