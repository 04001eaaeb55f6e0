"""Bytes per link: each rank's bytes per peer, counted on gloo, equal every scheme's traffic matrix in closed form
(`expected_comm_matrix`), and its split into intra- and inter-node bytes; cp_usp places its Ulysses groups
inside nodes. The ranks are placed on nodes by hand (tests/link_rank_program.py): counting does not depend on
where a rank really runs; tests/test_cluster.py runs real two-node launches.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from functools import cache
from pathlib import Path

import pytest

import impls  # noqa: F401
from bench import registry
from bench.comm import Communicator, link_bytes, use
from bench.measure.machine.topology import links, topology_of
from bench.measure.ranks.rank_part import RankPart
from bench.results.records import LinkBytes
from tests.link_rank_program import SCHEMES, cases

ROOT = Path(__file__).resolve().parents[1]


@cache
def counted(world: int, nodes: tuple[int, ...]) -> dict[str, dict[str, list[list[int]]]]:
    """{case: {impl: sent[src][dst]}} counted on `world` gloo ranks placed on `nodes`."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world + 1, True, timeout=timedelta(seconds=60), wait_for_workers=False)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.link_rank_program", str(r), str(world), str(store.port),
                               ",".join(map(str, nodes))], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(world)]
    reports = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
        reports.append(json.loads(out.strip().splitlines()[-1]))
    reports.sort(key=lambda r: r["rank"])
    result: dict[str, dict[str, list[list[int]]]] = {}
    for label in reports[0]["cases"]:
        result[label] = {name: [[int(r["cases"][label][name].get(str(d), 0)) for d in range(world)]
                                for r in reports] for name in reports[0]["cases"][label]}
    return result


NODES = (0, 0, 1, 1)


def placed(nodes) -> Communicator:
    """The communicator the closed forms see during a measurement: the ranks' nodes known (cp_usp reads them)."""
    comm = Communicator(None, 0, len(nodes))
    comm.node_of_rank = list(nodes)
    return comm


def test_counted_bytes_per_peer_equal_every_schemes_closed_form():
    got = counted(4, NODES)
    checked = set()
    for label, case in cases(4).items():
        for name, sent in got[label].items():
            impl = registry.get(name)
            with use(placed(NODES)):
                assert sent == impl.expected_comm_matrix(case), f"{label} {name}"
                assert sum(map(sum, sent)) == impl.expected_comm_bytes(case), f"{label} {name}"
                for nodes in (NODES, (0, 1, 0, 1), (0, 0, 0, 1)):  # the split of a matrix, under any placement
                    assert link_bytes(sent, nodes) == impl.expected_comm_bytes_by_link(case, nodes)
            checked.add(name)
    assert checked == set(SCHEMES)
    inter_node_bytes_follow_the_placement(got["fwd"])
    ulysses_stays_inside_nodes(got["fwd"]["cp_usp"])


def inter_node_bytes_follow_the_placement(got: dict[str, list[list[int]]]) -> None:
    by_link = {name: link_bytes(sent, [0, 0, 1, 1]) for name, sent in got.items()}
    # Rings (tp_heads, cp_ring, cp_allgather): ranks 1 -> 2 and 3 -> 0 cross: half of the ring's steps.
    for name in ("tp_heads", "cp_ring", "cp_allgather"):
        assert by_link[name]["inter_node"] == by_link[name]["intra_node"] > 0
    # Ulysses over all 4: each rank sends 1 of its 3 peers' shares inside its node.
    assert by_link["cp_ulysses"]["inter_node"] == 2 * by_link["cp_ulysses"]["intra_node"]
    # A local window's halo crosses only the boundary between the nodes (1 | 2) and the ring-free rest inside.
    assert 0 < by_link["cp_sparse"]["inter_node"] < by_link["cp_sparse"]["intra_node"]
    # Interleaved placement: every ring step crosses nodes.
    assert link_bytes(got["cp_ring"], [0, 1, 0, 1])["intra_node"] == 0


def test_cp_usp_places_its_ulysses_groups_inside_nodes():
    from impls.cp_usp import default_degree, groups_inside_nodes

    assert default_degree(8, 8, 8) == 4  # one node: the largest proper divisor
    assert default_degree(8, 8, 8, [0] * 4 + [1] * 4) == 4
    assert default_degree(8, 8, 8, [0, 0, 1, 1, 2, 2, 3, 3]) == 2  # groups of 2 ranks, each on its node
    assert default_degree(8, 8, 8, [0, 1] * 4) == 1  # no group fits a node: the ring alone
    assert groups_inside_nodes(2, [0, 0, 1, 1]) and not groups_inside_nodes(2, [0, 1, 0, 1])


def ulysses_stays_inside_nodes(sent: list[list[int]]) -> None:
    """Counted with nodes (0, 0, 1, 1): the Ulysses all-to-alls stay inside the nodes, only the ring crosses."""
    case = cases(4)["fwd"]
    impl = registry.get("cp_usp")
    with use(placed(NODES)):
        levels = impl.expected_comm_bytes_by_level(case)
        assert impl.degree(case) == 2
    assert link_bytes(sent, [0, 0, 1, 1]) == {"intra_node": levels["ulysses"], "inter_node": levels["ring"]}


def test_records_carry_topology_and_both_splits():
    parts = [RankPart(rank=r, node=f"h#{r // 2}", peers={str((r + 1) % 4): 10}) for r in range(4)]
    got = links(parts, [[0, 10, 0, 0], [0, 0, 10, 0], [0, 0, 0, 10], [10, 0, 0, 0]])
    assert got is not None
    assert got.topology.model_dump() == {"nodes": 2, "ranks_per_node": [2, 2], "node_of_rank": [0, 0, 1, 1],
                                         "node_names": ["h#0", "h#1"]}
    assert got.by_link == got.expected_bytes_by_link == LinkBytes(intra_node=20, inter_node=20)
    assert topology_of(["b", "a", "b"]).node_of_rank == [0, 1, 0]


def test_the_dashboard_draws_inter_node_bytes_against_world_size_and_placement(tmp_path):
    import plotly.graph_objects as go

    from bench.dashboard.data import rows_from_runs
    from bench.dashboard.figures import Colours
    from bench.dashboard.views_links import links_figure
    from bench.results.store import load_run
    from tests.synthetic import commit_id, params, record, write_run

    def rec(world: int, per_node: int, inter: int, expected_inter: int):
        nodes = [r // per_node for r in range(world)]
        comm = {"backend": "gloo", "bytes_total": 1000, "bytes_max_rank": 300, "by_op": {}, "world_size": world,
                "topology": {"nodes": world // per_node, "ranks_per_node": [per_node] * (world // per_node),
                             "node_of_rank": nodes},
                "by_link": {"intra_node": 1000 - inter, "inter_node": inter},
                "expected_bytes_by_link": {"intra_node": 1000 - expected_inter, "inter_node": expected_inter}}
        return record(f"local-p{world}-{per_node}", "cp_ring", [1e-3] * 3,
                      params=params(world_size=world, heads=4), comm=comm)

    records = [rec(4, 2, 500, 500), rec(8, 2, 400, 400), rec(8, 4, 250, 250), rec(4, 4, 0, 0)]
    rows = rows_from_runs([load_run(write_run(tmp_path, commit=commit_id(1), records=records, suite="multi"))])
    fig = links_figure(rows, Colours([]))
    assert fig is not None and not fig.notes
    go.Figure(fig.plotly)
    measured = {t["name"]: (t["x"], t["y"]) for t in fig.plotly["data"] if not t["name"].endswith("closed form")}
    assert measured == {"cp_ring (2 nodes x 2)": ([4], [500]), "cp_ring (4 nodes x 2)": ([8], [400]),
                        "cp_ring (2 nodes x 4)": ([8], [250]), "cp_ring (1 node x 4)": ([4], [0])}
    one_node = [r for r in rows if len(r.comm_ranks_per_node) == 1]
    assert links_figure(one_node, Colours([])) is None  # nothing crosses a node: no view
    off = rows_from_runs([load_run(write_run(tmp_path / "off", commit=commit_id(2), records=[rec(4, 2, 500, 400)],
                                             suite="multi"))])
    assert links_figure(off, Colours([])).notes == ["1 record(s) differ from the closed form's split"]


def test_a_simulated_placement_is_read_from_the_environment(monkeypatch):
    from bench.errors import BadInput
    from bench.run.ranks import simulated_ranks_per_node

    monkeypatch.delenv("BENCH_RANKS_PER_NODE", raising=False)
    assert simulated_ranks_per_node() is None
    monkeypatch.setenv("BENCH_RANKS_PER_NODE", "2")
    assert simulated_ranks_per_node() == 2
    monkeypatch.setenv("BENCH_RANKS_PER_NODE", "0")
    with pytest.raises(BadInput, match="BENCH_RANKS_PER_NODE: got '0'; a positive integer"):
        simulated_ranks_per_node()
