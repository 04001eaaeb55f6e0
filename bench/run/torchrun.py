"""`bench run` under torchrun (WORLD_SIZE set): join the launcher's process group instead of starting ranks.

torchrun, or any launcher that sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, starts the
same `bench run SUITE` on every rank, possibly over several machines. Rank 0 leads: it owns the run
directory, the records, the progress and the summary, and runs world_size-1 pairs in its worker process as
usual. Before each pair it broadcasts the task to every rank (the ranks move in lockstep, pair by pair).
For a pair with world_size P <= WORLD_SIZE, ranks 0..P-1 form a fresh process group for it (nccl for CUDA
cases, gloo otherwise, timeout timeout_s) and a gloo control group, each measures its part in-process
(bench.measure.ranks.rank), and rank 0 gathers the parts and assembles the record. P > WORLD_SIZE is a skip.

Failures: a rank that raises records its failure, and its peers' collectives give up after timeout_s.
torchrun owns the processes, so nothing here can kill a rank that hangs outside a collective: a watchdog
(faulthandler) makes a rank still inside one pair timeout_s + WATCHDOG_MARGIN_S later print its stacks and
exit; torchrun then ends every rank. Records written so far are kept and `--resume` finishes the run.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import sys
import time
from datetime import timedelta
from typing import Any

from bench.measure.case.steps import describe_failure, skip_reason
from bench.measure.ranks.rank_part import RankPart
from bench.measure.task import Task
from bench.results.records import Record
from bench.results.store import utc_now
from bench.run.child import STARTUP_TIMEOUT_S
from bench.run.ranks import backend_for, threads_per_rank

WATCHDOG_MARGIN_S = 120.0


def launched() -> bool:
    """True when a launcher such as torchrun started this process as one of several ranks."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


class Session:
    """This process's place in the launcher's job: rank, world size, and the coordination group."""

    def __init__(self, timeout_s: float, uses_cuda: bool) -> None:
        import torch
        import torch.distributed as dist

        self.dist = dist
        self.rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        self.timeout_s = timeout_s
        if uses_cuda and torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        else:
            torch.set_num_threads(threads_per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))))
        # A rank waits here for at most one pair: the leader's worker start plus the pair's timeout.
        self.pair_wait = timedelta(seconds=timeout_s + STARTUP_TIMEOUT_S + WATCHDOG_MARGIN_S)
        if not dist.is_initialized():
            dist.init_process_group("cpu:gloo,cuda:nccl" if uses_cuda else "gloo", timeout=self.pair_wait)
        self.coord = dist.new_group(backend="gloo", timeout=self.pair_wait)
        gc.freeze()  # imports are permanent: the memory phase's gc.collect() need not walk them every pair

    @property
    def leader(self) -> bool:
        return self.rank == 0

    # --- the leader ---

    def measure(self, task: Task) -> Record | None:
        """Announce the pair and measure it across ranks; None for a world_size-1 pair (the worker's)."""
        from bench import registry
        from bench.spec.case import Case

        started, t0 = utc_now(), time.perf_counter()
        world = int(task.case["world_size"])
        why = None
        if world > self.world_size:
            why = f"world_size {world} needs {world} ranks; the launcher started {self.world_size}"
        elif world > 1:
            why = skip_reason(registry.get(task.impl), Case(**task.case))
        self._broadcast({"task": task.model_dump(mode="json"), "skip": why})
        if why is not None:
            return Record(case_id=task.case_id, impl=task.impl, params=task.params, status="skipped",
                          reason=why, started_at=started, wall_s=time.perf_counter() - t0)
        if world == 1:
            return None
        parts = self._run(task)
        from bench.measure.ranks.rank_record import assemble_record

        return assemble_record(task, [p for p in parts if p is not None],
                               backend_for(str(task.case["device"])), started, time.perf_counter() - t0)

    def finish(self) -> None:
        self._broadcast(None)
        self.dist.destroy_process_group()

    # --- the other ranks ---

    def follow(self) -> int:
        """Take part in every pair the leader announces, until it announces the end."""
        while True:
            message = self._broadcast(None)
            if message is None:
                break
            task = Task.model_validate(message["task"])
            if message["skip"] is None and int(task.case["world_size"]) > 1:
                self._run(task)
        self.dist.destroy_process_group()
        return 0

    # --- both ---

    def _broadcast(self, message: Any) -> Any:
        box = [message if self.leader else None]
        self.dist.broadcast_object_list(box, src=0, group=self.coord)
        return box[0]

    def _run(self, task: Task) -> list[RankPart | None]:
        """Every rank: build the pair's groups, measure on ranks 0..P-1, gather the parts to the leader."""
        dist = self.dist
        world, device = int(task.case["world_size"]), str(task.case["device"])
        members = list(range(world))
        timeout = timedelta(seconds=self.timeout_s)
        backend = backend_for(device)
        group = dist.new_group(members, backend=backend, timeout=timeout)
        control = dist.new_group(members, backend="gloo", timeout=timeout)
        part: RankPart | None = None
        if self.rank < world:
            faulthandler.dump_traceback_later(self.timeout_s + WATCHDOG_MARGIN_S, exit=True, file=sys.stderr)
            try:
                from bench.measure.ranks.rank import RankContext, measure_on_rank

                ctx = RankContext(dist.get_rank(group), world, group, control, backend, device)
                part = measure_on_rank(task, ctx)
            except Exception as exc:
                reason, details = describe_failure("start", exc)
                part = RankPart(rank=self.rank).failed(reason, details, "start", False, "error")
            finally:
                faulthandler.cancel_dump_traceback_later()
        parts: list[RankPart | None] | None = [None] * self.world_size if self.leader else None
        dist.gather_object(part, parts, dst=0, group=self.coord)
        if self.rank < world:
            dist.destroy_process_group(group)
            dist.destroy_process_group(control)
        return parts or []
