"""A case with world_size P: P fresh rank processes per (case, impl), gloo on CPU, nccl with one GPU per rank.

Both sides live here. The runner calls `run_pair`: it hosts the ranks' rendezvous (a TCPStore on an ephemeral
port, so parallel runs never collide), starts `python -m bench.run.ranks` P times through `bench.run.child`,
and reads `Ready`, `PhaseChanged` and then the rank's `RankPartDone` (its RankPart) from each, which it
assembles into one Record.

- A rank that cannot start (a plugin that fails to import) gives a `failed` record with that cause.
- A rank that raises sends its failure; the runner kills every rank at once and records `failed`, naming the
  rank and its error (a peer's "connection closed" that follows is recognised as a consequence).
- A rank that dies, or ranks still running timeout_s after all were ready: every rank's process group gets
  SIGKILL; the record is `failed`, naming the rank that is furthest behind and its phase.
- Ranks die with the runner (PR_SET_PDEATHSIG); the process-group timeout is timeout_s, so a collective
  waiting for a dead peer gives up on its own too.

More ranks than visible GPUs is a skip with the reason; on CPU up to MAX_CPU_RANKS ranks share the cores,
each with an equal share of threads.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import select
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from bench import registry
from bench.errors import BadInput
from bench.measure.case.steps import describe_failure, failure_kind, skip_reason
from bench.measure.ranks.rank_part import RankPart
from bench.measure.task import Task
from bench.results.records import FailureKind, Record
from bench.results.store import utc_now
from bench.run import messages
from bench.run.child import STARTUP_TIMEOUT_S, Child, ChildSide, describe_exit
from bench.spec.case import Case

RANK_MODULE = "bench.run.ranks"
MAX_CPU_RANKS = 8
EXIT_GRACE_S = 10.0  # a rank that reported its part gets this long to leave the process group cleanly
FAILURE_GRACE_S = 0.5  # after a peer's communication error, wait this long for the error that caused it


def launch_problem(world_size: int, device: str) -> str | None:
    """Why P ranks cannot start here (a skip reason), or None."""
    if device == "cuda":
        import torch

        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if world_size > visible:
            return f"world_size {world_size} needs {world_size} GPUs (one per rank); {visible} visible"
    elif world_size > MAX_CPU_RANKS:
        return f"CPU runs allow up to {MAX_CPU_RANKS} ranks sharing the cores; got world_size {world_size}"
    return None


def backend_for(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def threads_per_rank(world_size: int) -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, cores // world_size)


@dataclass
class _Rank:
    rank: int
    child: Child
    phase: str = "start"
    ready: bool = False
    start_error: str | None = None
    part: RankPart | None = None


def run_pair(task: Task, plugins: list[tuple[str, str | None]], timeout_s: float,
             log_path: Path | None = None) -> Record:
    """Measure one (case, impl) over case.world_size rank processes; always returns a Record."""
    import torch.distributed as dist

    from bench.measure.ranks.rank_record import assemble_record

    started, t_start = utc_now(), time.perf_counter()
    world, device = int(task.case["world_size"]), str(task.case["device"])

    def finish(status: str, reason: str, failure: FailureKind | None = None) -> Record:
        return Record(case_id=task.case_id, impl=task.impl, params=task.params, status=status, reason=reason,
                      started_at=started, wall_s=time.perf_counter() - t_start, failure=failure)

    impl = registry.get(task.impl)
    why = launch_problem(world, device) or skip_reason(impl, Case(**task.case))
    if why:
        return finish("skipped", why)

    store = dist.TCPStore("127.0.0.1", 0, world + 1, True, timeout=timedelta(seconds=timeout_s + 60),
                          wait_for_workers=False)
    ranks = _start_ranks(task, plugins, timeout_s, store.port, log_path)
    try:
        failure = _watch(ranks, timeout_s)
        if failure is not None:
            return finish("failed", *failure)
        parts = [r.part for r in ranks if r.part is not None]
        return assemble_record(task, parts, backend_for(device), started, time.perf_counter() - t_start)
    finally:
        _stop(ranks)
        del store


def _start_ranks(task: Task, plugins: list[tuple[str, str | None]], timeout_s: float, port: int,
                 log_path: Path | None) -> list[_Rank]:
    world = int(task.case["world_size"])
    env = {"OMP_NUM_THREADS": str(threads_per_rank(world)),
           "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}  # every rank is on this host
    per_node = simulated_ranks_per_node()
    return [_Rank(rank, Child(RANK_MODULE, ["--rank", str(rank), "--store-port", str(port), "--timeout",
                                           str(timeout_s), "--plugins", json.dumps(plugins),
                                           "--task", task.model_dump_json()],
                              env=env if per_node is None else {**env, "BENCH_NODE": f"node{rank // per_node}"},
                              log_path=log_path))
            for rank in range(world)]


def simulated_ranks_per_node() -> int | None:
    """BENCH_RANKS_PER_NODE=K: the ranks started here declare themselves K to a node (rank r on node r // K), so
    that a one-machine run counts the bytes a K-per-node placement would send between nodes (docs/cluster.md)."""
    text = os.environ.get("BENCH_RANKS_PER_NODE")
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise BadInput(f"got {text!r}; a positive integer (ranks per simulated node)", field="BENCH_RANKS_PER_NODE")
    return int(text)


def _watch(ranks: list[_Rank], timeout_s: float) -> tuple[str, FailureKind] | None:
    """Follow the ranks until each has sent its part; the failure's reason and kind (as the worker's: startup,
    died, timeout), or None when every rank sent its part (a rank's own failure is in its part)."""
    world = len(ranks)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    started_clock = False
    first_failure_at: float | None = None
    while True:
        unable = [r for r in ranks if r.start_error]
        if unable:
            first = unable[0]
            return f"rank {first.rank} could not start: {first.start_error}; all {world} ranks killed", "startup"
        if not started_clock and all(r.ready for r in ranks):
            deadline, started_clock = time.monotonic() + timeout_s, True  # the case's clock starts now
        dead = [r for r in ranks if r.child.closed and r.part is None]
        if dead:  # a death explains its peers' communication errors, never the other way round
            r = dead[0]
            code = r.child.wait(1.0)
            return f"rank {r.rank} died during {r.phase} ({describe_exit(code)}); all {world} ranks killed", "died"
        parts = [r.part for r in ranks if r.part is not None]
        failed = [p for p in parts if p.status == "failed"]
        if failed:
            first_failure_at = first_failure_at or time.monotonic()
            own_error = any(not p.comm_error for p in failed)
            if own_error or time.monotonic() - first_failure_at >= FAILURE_GRACE_S:
                return None  # assemble_record names the rank whose own error came first
        elif len(parts) == world:
            return None
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            if not started_clock:
                slow = [r.rank for r in ranks if not r.ready]
                return f"rank(s) {slow} did not start within {STARTUP_TIMEOUT_S:g} s; all {world} ranks killed", \
                    "startup"
            return _timeout_reason(ranks, timeout_s), "timeout"
        wait = min(remaining, 0.2 if failed else 1.0)
        open_fds = [r.child.fd for r in ranks if not r.child.closed]
        readable, _, _ = select.select(open_fds, [], [], wait) if open_fds else ([], [], [])
        for r in ranks:
            if r.child.fd in readable and r.child.read_available():
                while (obj := r.child.next_message()) is not None:
                    _take(r, messages.from_child(obj))


def _take(r: _Rank, message: Any) -> None:
    if isinstance(message, messages.Ready):
        r.ready, r.start_error = message.error is None, message.error
    elif isinstance(message, messages.PhaseChanged):
        r.phase = message.phase
    elif isinstance(message, messages.RankPartDone):
        r.part = message.part


def _timeout_reason(ranks: list[_Rank], timeout_s: float) -> str:
    from bench.measure.ranks.rank import PHASES

    pending = [r for r in ranks if r.part is None]
    order = {p: i for i, p in enumerate(PHASES)}
    behind = min(order.get(r.phase, 0) for r in pending)
    stuck = [r for r in pending if order.get(r.phase, 0) == behind]
    waiting = [r for r in pending if r not in stuck]
    names = ", ".join(str(r.rank) for r in stuck)
    reason = f"timed out after {timeout_s:g} s: rank {names} during {stuck[0].phase}"
    if waiting:
        reason += " (" + ", ".join(f"rank {r.rank} waiting in {r.phase}" for r in waiting) + ")"
    return reason + f"; all {len(ranks)} ranks killed"


def _stop(ranks: list[_Rank]) -> None:
    """Let ranks that finished leave cleanly, then SIGKILL every rank's process group and reap it."""
    finished = all(r.part is not None and r.part.status != "failed" for r in ranks)
    deadline = time.monotonic() + (EXIT_GRACE_S if finished else 0.0)
    for r in ranks:
        r.child.close(grace_s=max(0.0, deadline - time.monotonic()) if finished else 0.0)


# --- the rank side -----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=RANK_MODULE)
    ChildSide.add_arguments(parser)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--store-port", type=int, required=True)
    parser.add_argument("--timeout", type=float, required=True)
    parser.add_argument("--plugins", default="[]")
    parser.add_argument("--task", required=True)
    args = parser.parse_args(argv)
    side = ChildSide.from_args(args)
    if not side.start():
        return 1
    rank, phase = args.rank, "start"
    import torch
    import torch.distributed as dist

    try:
        from bench.measure.ranks.rank import RankContext, measure_on_rank
        from bench.registry import names
        from bench.spec.plugins import load_plugin

        for spec, base in json.loads(args.plugins):
            load_plugin(spec, base_dir=Path(base) if base else None, file="plugin", field=spec)
        names()  # the built-in implementations, imported before the case's clock starts
        gc.freeze()  # what imports created is permanent: the memory phase's gc.collect() skips it
        task = Task.model_validate_json(args.task)
    except Exception as exc:
        from bench.errors import BadInput

        side.send(messages.Ready(error=exc.detail if isinstance(exc, BadInput) else f"{type(exc).__name__}: {exc}"))
        return 1
    world, device = int(task.case["world_size"]), str(task.case["device"])
    side.send(messages.Ready())
    try:
        phase = "init"
        side.send(messages.PhaseChanged(phase=phase))
        torch.set_num_threads(threads_per_rank(world))
        if device == "cuda":
            torch.cuda.set_device(rank)
        timeout = timedelta(seconds=args.timeout)
        store = dist.TCPStore("127.0.0.1", args.store_port, None, False, timeout=timeout)
        backend = backend_for(device)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        control = dist.new_group(backend="gloo", timeout=timeout)
        ctx = RankContext(rank, world, dist.group.WORLD, control, backend, device)
        part = measure_on_rank(task, ctx, lambda p: side.send(messages.PhaseChanged(phase=p)))
    except Exception as exc:
        reason, details = describe_failure(phase, exc)
        part = RankPart(rank=rank).failed(reason, details, phase, False, failure_kind(exc))
    side.send(messages.RankPartDone(part=part))
    if part.status == "failed":
        os._exit(1)  # the group may be broken; the runner ends the other ranks
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
