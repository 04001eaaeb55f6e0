"""Bytes between nodes per scheme, computed from the implementations' closed forms (no measurement): each case of
a suite at world size P placed node-major on nodes of K ranks, as a Markdown table (docs/cluster.md).

Usage: python scripts/link_table.py suites/seed000_comm.yaml [--worlds 4,8] [--per-node 2,4]
The figures are byte counts: tests/test_links.py and tests/test_cluster.py hold the closed forms equal to what
bench.comm counts per peer on gloo, so a measured run with the same placement writes these numbers.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import impls  # noqa: F401 - registers the implementations
from bench import registry
from bench.comm import Communicator, use
from bench.console.format import format_bytes
from bench.sharding import DistributedImpl
from bench.spec.suite import load_suite


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("suite", type=Path)
    parser.add_argument("--worlds", default="4,8")
    parser.add_argument("--per-node", default="2,4")
    args = parser.parse_args(argv)
    suite = load_suite(args.suite)
    worlds = [int(w) for w in args.worlds.split(",")]
    per_node = [int(k) for k in args.per_node.split(",")]
    print("| case | P | ranks/node | " + " | ".join(suite.impls) + " |")
    print("|---|---|---|" + "---|" * len(suite.impls))
    for case in suite.cases:
        case = case.with_device("cpu")  # byte counts do not depend on the device
        if case.world_size not in worlds:
            continue
        for k in per_node:
            if k >= case.world_size or case.world_size % k:
                continue
            nodes = [r // k for r in range(case.world_size)]
            comm = Communicator(None, 0, case.world_size)
            comm.node_of_rank = nodes  # what cp_usp sees when it places its groups
            cells = []
            with use(comm):
                for name in suite.impls:
                    impl = registry.get(name)
                    if not isinstance(impl, DistributedImpl) or impl.unsupported(case):
                        cells.append("-")
                        continue
                    split = impl.expected_comm_bytes_by_link(case, nodes)
                    if split is None:
                        cells.append("?")
                        continue
                    total = split["inter_node"] + split["intra_node"]
                    share = split["inter_node"] / total if total else 0.0
                    cells.append(f"{format_bytes(split['inter_node'])} ({share:.0%})")
            print(f"| {case.label} | {case.world_size} | {k} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
