"""Planted distributed implementations whose rank 1 misbehaves (loaded via `plugins:`).

Every rank writes its pid into $BENCH_TEST_PID_DIR (when set) during prepare, so a test can check that no
rank process outlives the run. Rank 0 meets rank 1 in an all-reduce in the call, so it is left waiting
there when rank 1 fails.
"""

import os
import signal
import time
from pathlib import Path

import torch

from bench.comm import current
from bench.registry import register
from bench.sharding import DistributedImpl


class _PlantedRankFault(DistributedImpl):
    description = "planted fault on rank 1 for tests"
    split_dim = 1

    def unsupported(self, case):
        return None

    def expected_comm_bytes(self, case):
        return None

    def prepare(self, case, pattern, q, k, v):
        comm = current()
        where = os.environ.get("BENCH_TEST_PID_DIR")
        if where:
            Path(where, f"{self.name}-rank{comm.rank}-{os.getpid()}").touch()
        if comm.rank == 1:
            self.misbehave_in_prepare()

        def call():
            if comm.rank == 1:
                self.misbehave_in_call()
            total = comm.all_reduce(torch.ones(1))
            return q * total / comm.world_size

        return call

    def misbehave_in_prepare(self):
        pass

    def misbehave_in_call(self):
        pass


@register
class RankRaises(_PlantedRankFault):
    name = "fault_rank_raise"

    def misbehave_in_call(self):
        raise RuntimeError("planted failure on rank 1")


@register
class RankHangs(_PlantedRankFault):
    name = "fault_rank_hang"

    def misbehave_in_prepare(self):
        time.sleep(3600)


@register
class RankDies(_PlantedRankFault):
    name = "fault_rank_kill"

    def misbehave_in_call(self):
        os.kill(os.getpid(), signal.SIGKILL)
