"""bench.comm: ring accounting in closed form, and every counted collective on real gloo ranks.

The multi-rank tests start P = 2 and P = 4 processes (tests/comm_rank_program.py) that run each op once;
the bytes each rank reports must equal the ring accounting written out here by hand, and every op must
produce the right values (checked in the rank program).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from functools import cache

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from bench.comm import Communicator, all_reduce_sent, broadcast_sent, bus_factor, ring_chunks
from tests.conftest import ROOT

F32 = 4  # bytes per float32 element


@given(numel=st.integers(0, 10_000), world=st.integers(1, 64))
def test_ring_all_reduce_sends_2_p_minus_1_times_the_buffer_in_all(numel, world):
    per_rank = [all_reduce_sent(numel, F32, r, world) for r in range(world)]
    assert sum(per_rank) == 2 * (world - 1) * numel * F32
    assert sum(ring_chunks(numel, world)) == numel
    if numel % world == 0:  # even chunks: every rank sends 2 (P-1)/P of the buffer
        assert per_rank == [2 * (world - 1) * numel * F32 // world] * world


@given(nbytes=st.integers(0, 10_000), world=st.integers(1, 64), src=st.integers(0, 63))
def test_ring_broadcast_crosses_p_minus_1_links(nbytes, world, src):
    src %= world
    per_rank = [broadcast_sent(nbytes, r, src, world) for r in range(world)]
    assert sum(per_rank) == (world - 1) * nbytes
    assert per_rank[(src - 1) % world] == 0 or world == 1


def test_bus_factors_are_nccl_tests():
    assert bus_factor("all_reduce", 4) == 2 * 3 / 4
    assert bus_factor("all_gather_into_tensor", 4) == bus_factor("reduce_scatter_tensor", 4) == 3 / 4
    assert bus_factor("all_to_all_single", 8) == 7 / 8
    assert bus_factor("broadcast", 8) == bus_factor("batch_isend_irecv", 8) == bus_factor("send", 2) == 1.0


def test_single_process_ops_are_local_and_count_nothing():
    comm = Communicator()
    x = torch.arange(6.0)
    assert comm.all_reduce(x) is x
    assert torch.equal(comm.all_gather_into_tensor(torch.empty(6), x), x)
    assert torch.equal(comm.all_to_all_single(torch.empty(6), x, [6], [6]), x)
    assert comm.snapshot() == {}
    with pytest.raises(ValueError, match="input_split_sizes"):
        Communicator(None, 0, 2).all_to_all_single(torch.empty(6), x, [3, 3], [2, 2])


@cache
def ranks(world: int) -> list[dict]:
    """Run tests/comm_rank_program.py on `world` gloo ranks (once per world size); their reports."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world + 1, True, timeout=timedelta(seconds=60), wait_for_workers=False)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.comm_rank_program", str(r), str(world),
                               str(store.port)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in range(world)]
    reports = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return sorted(reports, key=lambda r: r["rank"])


def sent(reports: list[dict], section: str, name: str, op: str) -> list[int]:
    return [r[section][name][1].get(op, {}).get("bytes_sent", 0) for r in reports]


@pytest.mark.parametrize("world", [2, 4])
def test_every_collective_gives_the_right_values_on_gloo(world):
    reports = ranks(world)
    assert all(r["backend"] == "gloo" for r in reports)
    for section in ("ops", "autograd"):
        for name in reports[0][section]:
            if name in ("paused", "started"):
                continue
            assert all(r[section][name][0] for r in reports), f"{section}.{name} gave wrong values"


@pytest.mark.parametrize("world", [2, 4])
def test_counted_bytes_follow_the_ring_accounting(world):
    reports = ranks(world)
    p = world
    # all_reduce of 10 float32: the ring's chunks are [5, 5] (P=2) or [3, 3, 2, 2] (P=4); rank r sends every
    # chunk but (r+1) % P in the reduce-scatter and every chunk but (r+2) % P in the all-gather.
    assert sent(reports, "ops", "all_reduce", "all_reduce") == {2: [40, 40], 4: [60, 64, 60, 56]}[p]
    assert sum(sent(reports, "ops", "all_reduce", "all_reduce")) == 2 * (p - 1) * 10 * F32
    # all-gather of 3 elements per rank, reduce-scatter to 2 per rank: (P-1) * the rank's part
    assert sent(reports, "ops", "all_gather_into_tensor", "all_gather_into_tensor") == [(p - 1) * 3 * F32] * p
    assert sent(reports, "ops", "reduce_scatter_tensor", "reduce_scatter_tensor") == [(p - 1) * 2 * F32] * p
    # all-to-all: rank r sends d + 1 rows of 2 floats to each d != r; its own split stays home
    assert sent(reports, "ops", "all_to_all_single", "all_to_all_single") == [
        sum((d + 1) * 2 * F32 for d in range(p) if d != r) for r in range(p)]
    # broadcast of 5 floats from rank 1: every rank forwards it but the one before rank 1 in the ring
    assert sent(reports, "ops", "broadcast", "broadcast") == [0 if r == 0 else 5 * F32 for r in range(p)]
    assert sent(reports, "ops", "send_recv", "send") == [7 * F32] + [0] * (p - 1)
    assert sent(reports, "ops", "send_recv", "recv") == [0] * p
    assert reports[1]["ops"]["send_recv"][1]["recv"]["calls"] == 1
    assert sent(reports, "ops", "batch_isend_irecv", "batch_isend_irecv") == [4 * F32] * p
    assert all(r["ops"]["paused"] == {} for r in reports)  # uncounted while paused
    for r in reports:
        for name, outcome in r["ops"].items():
            for op, s in ({} if name in ("paused", "started") else outcome[1]).items():
                assert s["calls"] == 1 and s["time_s"] > 0 and s["hidden_s"] == 0, (name, op, s)  # blocking


@pytest.mark.parametrize("world", [2, 4])
def test_started_transfers_overlap_compute_and_count_their_level(world):
    """Two shifts started at once, compute, then wait: right values, bytes as a blocking shift, counted under
    the level they were started in; their time in flight measured and the hidden part within it."""
    for r in ranks(world):
        ok, snapshot, levels = r["ops"]["started"]
        assert ok, r["rank"]
        s = snapshot["batch_isend_irecv"]
        assert s["calls"] == 2 and s["bytes_sent"] == (4 + 6) * F32
        assert levels == {"ring": {"calls": 2, "bytes_sent": (4 + 6) * F32}}
        assert s["time_s"] > 0 and 0 <= s["hidden_s"] <= s["time_s"]


@pytest.mark.parametrize("world", [2, 4])
def test_backward_collectives_are_counted(world):
    reports = ranks(world)
    p = world
    ag = [r["autograd"]["all_gather"][1] for r in reports]
    assert all(s["all_gather_into_tensor"]["bytes_sent"] == (p - 1) * 6 * F32 for s in ag)
    assert all(s["reduce_scatter_tensor"]["bytes_sent"] == (p - 1) * 6 * F32 for s in ag)  # its adjoint
    shift = [r["autograd"]["ring_shift"][1]["batch_isend_irecv"] for r in reports]
    assert all(s["calls"] == 2 and s["bytes_sent"] == 2 * 4 * F32 for s in shift)  # forward + reverse shift
    a2a = [r["autograd"]["all_to_all"][1]["all_to_all_single"] for r in reports]
    assert all(s["calls"] == 2 and s["bytes_sent"] == 2 * (p - 1) * 2 * F32 for s in a2a)
    # reduce_from_ranks: all-reduce of 3 forward; copy_to_ranks: ONE all-reduce of 3 + 2 gradients backward
    tp = [r["autograd"]["copy_reduce"][1]["all_reduce"] for r in reports]
    assert all(s["calls"] == 2 for s in tp)
    assert sum(s["bytes_sent"] for s in tp) == 2 * (p - 1) * (3 + 5) * F32
