"""The ranks' parts of a distributed pair (bench.measure.ranks.rank) assembled into one Record: the failure that
explains the others, the slowest rank's times, bytes per rank, op and level, each rank's share, imbalance and
overlap."""

from __future__ import annotations

from collections.abc import Sequence

from bench.comm.communicator import bus_factor
from bench.measure.machine.topology import links
from bench.measure.ranks.rank import PHASES
from bench.measure.ranks.rank_part import OpCount, RankPart
from bench.measure.task import Task
from bench.results.records import CommInfo, CommLevel, CommOp, MemoryInfo, RankComm, Record


def primary_failure(parts: Sequence[RankPart]) -> RankPart | None:
    """The failure that explains the others: a rank's own error before a peer's communication error."""
    failed = [p for p in parts if p.status == "failed"]
    if not failed:
        return None
    return min(failed, key=lambda p: (p.comm_error, PHASES.index(p.phase) if p.phase in PHASES else 0, p.rank))


def assemble_record(task: Task, parts: Sequence[RankPart], backend: str, started_at: str, wall_s: float) -> Record:
    """One Record from every rank's part (all present: failures without a part are the launcher's)."""
    def finish(**fields: object) -> Record:
        return Record(case_id=task.case_id, impl=task.impl, params=task.params, started_at=started_at,
                      wall_s=wall_s, **fields)

    parts = sorted(parts, key=lambda p: p.rank)
    world = len(parts)
    failure = primary_failure(parts)
    if failure is not None:
        return finish(status="failed", reason=f"rank {failure.rank}: {failure.reason}", details=failure.details,
                      setup_s=failure.setup_s, failure=failure.failure or "error")
    skipped = next((p for p in parts if p.status == "skipped"), None)
    if skipped is not None:
        return finish(status="skipped", reason=skipped.reason)
    root = parts[0]
    assert root.memory is not None and root.time_s is not None and root.base is not None
    peaks = [p.memory.peak_bytes if p.memory is not None else None for p in parts]
    known = [b for b in peaks if b is not None]
    method = root.memory.method
    memory = MemoryInfo(peak_bytes=max(known) if known else None, method=method,
                        note=f"largest of {world} ranks; per rank: {peaks}",
                        process="shared" if method == "rss_hwm" else None)  # each rank after its own timing
    config = {**root.config, "world_size": world, "backend": backend}
    if task.case.get("device") == "cpu":
        config["threads_per_rank"] = root.threads
    time_s = root.time_s
    flops = root.base.flops
    expected = root.expected
    comm = comm_info(parts, backend, expected.bytes if expected else None, expected.by_level if expected else None,
                     str(task.case.get("device")), expected.matrix if expected else None)
    busy = next((p.contention for p in parts if p.contention is not None and p.contention.verdict == "busy"),
                root.contention)  # a busy rank makes the pair busy
    return finish(**root.base.model_dump(), status="incorrect" if root.problem else "ok", reason=root.problem,
                  time_s=time_s, setup_s=max(p.setup_s or 0.0 for p in parts), setup=root.setup, memory=memory,
                  comm=comm, error=root.error, device=f"{root.device} x{world} ranks ({backend})", config=config,
                  contention=busy, flops_per_s=flops / time_s.median if time_s.median > 0 else None,
                  timing=root.timing)


def imbalance(values: list[float]) -> float | None:
    """max / mean: 1 when every rank has as much; None when there is nothing."""
    total = sum(values)
    return max(values) / (total / len(values)) if values and total > 0 else None


def rank_rows(parts: Sequence[RankPart]) -> list[RankComm]:
    """The record's comm.per_rank: per rank its bytes, useful FLOPs, memory and times per step.

    comm_s: its ops' time (started ops: in flight), hidden_s: the part that overlapped its compute,
    exposed_s = comm_s - hidden_s, compute_s = its mean step time - exposed_s (bench.comm, "Overlap").
    """
    rows = []
    for p in parts:
        ops = p.comm.values()
        comm_s = sum(s.time_s for s in ops)
        hidden_s = min(comm_s, sum(s.hidden_s for s in ops))
        step_s = p.step_s
        rows.append(RankComm(rank=p.rank, bytes=sum(s.bytes_sent for s in ops), flops=p.flops, step_s=step_s,
                             compute_s=None if step_s is None else max(0.0, step_s - (comm_s - hidden_s)),
                             comm_s=comm_s, hidden_s=hidden_s, exposed_s=comm_s - hidden_s,
                             peak_bytes=p.memory.peak_bytes if p.memory is not None else None))
    return rows


def _by_op(parts: Sequence[RankPart]) -> dict[str, CommOp]:
    """Per op kind: calls, bytes, the slowest rank's time, and nccl-tests' algbw and busbw.

    algbw = nccl-tests size / time (the busiest rank's size over the slowest rank's time: a collective ends
    when its last rank does), busbw = algbw * bus_factor (bench.comm)."""
    world = len(parts)
    by_op: dict[str, CommOp] = {}
    for op in sorted({op for p in parts for op in p.comm}):
        rows = [p.comm.get(op, OpCount(calls=0, bytes_sent=0)) for p in parts]
        seconds = max(r.time_s for r in rows)
        size = max(r.size_bytes for r in rows)
        algbw = size / seconds / 1e9 if seconds > 0 else None  # GB/s (1e9 bytes), as nccl-tests prints
        by_op[op] = CommOp(calls=max(r.calls for r in rows), bytes_total=sum(r.bytes_sent for r in rows),
                           bytes_max_rank=max(r.bytes_sent for r in rows), time_s=seconds,
                           hidden_s=max(r.hidden_s for r in rows), algbw_gbps=algbw,
                           busbw_gbps=None if algbw is None else algbw * bus_factor(op, world))
    return by_op


def _by_level(parts: Sequence[RankPart], expected_by_level: dict[str, int] | None) -> dict[str, CommLevel] | None:
    names = sorted({name for p in parts for name in p.levels} | set(expected_by_level or {}))
    if not names:
        return None
    by_level = {}
    for name in names:
        sent = [p.levels[name].bytes_sent if name in p.levels else 0 for p in parts]
        by_level[name] = CommLevel(calls=max(p.levels[name].calls if name in p.levels else 0 for p in parts),
                                   bytes_total=sum(sent), bytes_max_rank=max(sent),
                                   expected_bytes=(expected_by_level or {}).get(name))
    return by_level


def comm_info(parts: Sequence[RankPart], backend: str, expected: int | None,
              expected_by_level: dict[str, int] | None = None, device: str = "cpu",
              expected_matrix: list[list[int]] | None = None) -> CommInfo:
    """The record's `comm`: bytes per rank, per op and per level for one step, op times from the slowest rank,
    each rank's share (per_rank), the imbalance of useful FLOPs and the measured overlap fraction
    (overlap_fraction = sum over ranks of hidden_s / sum of comm_s; None without communication time)."""
    per_rank = [sum(s.bytes_sent for s in p.comm.values()) for p in parts]
    ranks = rank_rows(parts)
    comm_total = sum(r.comm_s or 0.0 for r in ranks)
    flops = [r.flops for r in ranks if r.flops is not None]
    placed = links(parts, expected_matrix)
    return CommInfo(backend=backend, bytes_total=sum(per_rank), bytes_max_rank=max(per_rank),
                    by_op=_by_op(parts), expected_bytes=expected, world_size=len(parts), bytes_per_rank=per_rank,
                    per_rank=ranks, imbalance=imbalance(flops) if len(flops) == len(ranks) else None,
                    overlap_fraction=sum(r.hidden_s or 0.0 for r in ranks) / comm_total if comm_total > 0 else None,
                    overlap_method="cuda_events" if device.startswith("cuda") else "host",
                    by_level=_by_level(parts, expected_by_level),
                    topology=placed.topology if placed else None, by_link=placed.by_link if placed else None,
                    expected_bytes_by_link=placed.expected_bytes_by_link if placed else None)
