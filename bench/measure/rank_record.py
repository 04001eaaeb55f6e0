"""The ranks' parts of a distributed pair (bench.measure.rank) assembled into one Record: the failure that explains
the others, the slowest rank's times, bytes per rank, op and level, each rank's share, imbalance and overlap."""

from __future__ import annotations

from typing import Any

from bench.comm import bus_factor
from bench.measure.rank import PHASES
from bench.measure.task import Task
from bench.measure.topology import links
from bench.results.records import Record


def primary_failure(parts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The failure that explains the others: a rank's own error before a peer's communication error."""
    failed = [p for p in parts if p.get("status") == "failed"]
    if not failed:
        return None
    return min(failed, key=lambda p: (bool(p.get("comm_error")), PHASES.index(p.get("phase", "start"))
                                      if p.get("phase") in PHASES else 0, p["rank"]))


def assemble_record(task: Task, parts: list[dict[str, Any]], backend: str, started_at: str,
                    wall_s: float) -> Record:
    """One Record from every rank's part (all present: failures without a part are the launcher's)."""
    base: dict[str, Any] = {"case_id": task.case_id, "impl": task.impl, "params": task.params,
                            "started_at": started_at, "wall_s": wall_s}
    parts = sorted(parts, key=lambda p: p["rank"])
    world = len(parts)
    failure = primary_failure(parts)
    if failure is not None:
        return Record(**base, status="failed", reason=f"rank {failure['rank']}: {failure['reason']}",
                      details=failure.get("details"), setup_s=failure.get("setup_s"),
                      failure=failure.get("failure", "error"))
    if any(p["status"] == "skipped" for p in parts):
        return Record(**base, status="skipped", reason=next(p["reason"] for p in parts if p["status"] == "skipped"))
    root = parts[0]
    peaks = [p["memory"]["peak_bytes"] for p in parts]
    known = [b for b in peaks if b is not None]
    method = root["memory"]["method"]
    memory = {"peak_bytes": max(known) if known else None, "method": method,
              "note": f"largest of {world} ranks; per rank: {peaks}",
              "process": "shared" if method == "rss_hwm" else None}  # each rank after its own timing
    config = {**root.get("config", {}), "world_size": world, "backend": backend}
    if task.case.get("device") == "cpu":
        config["threads_per_rank"] = root.get("threads")
    time_s = root["time_s"]
    flops = root["base"]["flops"]
    comm = comm_info(parts, backend, root.get("expected_bytes"), root.get("expected_by_level"),
                     str(task.case.get("device")), root.get("expected_matrix"))
    return Record(**base, **root["base"], status="incorrect" if root["problem"] else "ok", reason=root["problem"],
                  time_s=time_s, setup_s=max(p["setup_s"] for p in parts), setup=root.get("setup"), memory=memory,
                  comm=comm, error=root["error"],
                  device=f"{root['device']} x{world} ranks ({backend})", config=config,
                  contention=next((p["contention"] for p in parts if (p.get("contention") or {}).get("verdict")
                                   == "busy"), root.get("contention")),  # a busy rank makes the pair busy
                  flops_per_s=flops / time_s["median"] if time_s["median"] > 0 else None)


def imbalance(values: list[float]) -> float | None:
    """max / mean: 1 when every rank has as much; None when there is nothing."""
    total = sum(values)
    return max(values) / (total / len(values)) if values and total > 0 else None


def rank_rows(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The record's comm.per_rank: per rank its bytes, useful FLOPs, memory and times per step.

    comm_s: its ops' time (started ops: in flight), hidden_s: the part that overlapped its compute,
    exposed_s = comm_s - hidden_s, compute_s = its mean step time - exposed_s (bench.comm, "Overlap").
    """
    rows = []
    for p in parts:
        ops = p["comm"].values()
        comm_s = sum(float(s["time_s"]) for s in ops)
        hidden_s = min(comm_s, sum(float(s.get("hidden_s", 0.0)) for s in ops))
        step_s = p.get("step_s")
        rows.append({"rank": p["rank"], "bytes": sum(int(s["bytes_sent"]) for s in ops), "flops": p.get("flops"),
                     "step_s": step_s, "compute_s": None if step_s is None else max(0.0, step_s - (comm_s - hidden_s)),
                     "comm_s": comm_s, "hidden_s": hidden_s, "exposed_s": comm_s - hidden_s,
                     "peak_bytes": p["memory"]["peak_bytes"]})
    return rows


def comm_info(parts: list[dict[str, Any]], backend: str, expected: int | None,
              expected_by_level: dict[str, int] | None = None, device: str = "cpu",
              expected_matrix: list[list[int]] | None = None) -> dict[str, Any]:
    """The record's `comm`: bytes per rank, per op and per level for one step, op times from the slowest rank,
    each rank's share (per_rank), the imbalance of useful FLOPs and the measured overlap fraction.

    algbw = nccl-tests size / time (the busiest rank's size over the slowest rank's time: a collective ends
    when its last rank does), busbw = algbw * bus_factor (bench.comm). overlap_fraction = sum over ranks of
    hidden_s / sum of comm_s (None without communication time).
    """
    world = len(parts)
    per_rank = [sum(int(s["bytes_sent"]) for s in p["comm"].values()) for p in parts]
    by_op: dict[str, dict[str, Any]] = {}
    for op in sorted({op for p in parts for op in p["comm"]}):
        rows = [p["comm"].get(op, {"calls": 0, "bytes_sent": 0, "size_bytes": 0, "time_s": 0.0}) for p in parts]
        seconds = max(float(r["time_s"]) for r in rows)
        size = max(int(r["size_bytes"]) for r in rows)
        algbw = size / seconds / 1e9 if seconds > 0 else None  # GB/s (1e9 bytes), as nccl-tests prints
        by_op[op] = {"calls": max(int(r["calls"]) for r in rows),
                     "bytes_total": sum(int(r["bytes_sent"]) for r in rows),
                     "bytes_max_rank": max(int(r["bytes_sent"]) for r in rows), "time_s": seconds,
                     "hidden_s": max(float(r.get("hidden_s", 0.0)) for r in rows),
                     "algbw_gbps": algbw, "busbw_gbps": None if algbw is None else algbw * bus_factor(op, world)}
    by_level: dict[str, dict[str, Any]] | None = None
    names = sorted({name for p in parts for name in p.get("levels", {})} | set(expected_by_level or {}))
    if names:
        by_level = {}
        for name in names:
            sent = [int(p.get("levels", {}).get(name, {}).get("bytes_sent", 0)) for p in parts]
            by_level[name] = {"calls": max(int(p.get("levels", {}).get(name, {}).get("calls", 0)) for p in parts),
                              "bytes_total": sum(sent), "bytes_max_rank": max(sent),
                              "expected_bytes": (expected_by_level or {}).get(name)}
    ranks = rank_rows(parts)
    comm_total = sum(r["comm_s"] for r in ranks)
    flops = [r["flops"] for r in ranks]
    return {"backend": backend, "bytes_total": sum(per_rank), "bytes_max_rank": max(per_rank), "by_op": by_op,
            "expected_bytes": expected, "world_size": world, "bytes_per_rank": per_rank, "per_rank": ranks,
            "imbalance": imbalance(flops) if all(f is not None for f in flops) else None,
            "overlap_fraction": sum(r["hidden_s"] for r in ranks) / comm_total if comm_total > 0 else None,
            "overlap_method": "cuda_events" if device.startswith("cuda") else "host", "by_level": by_level,
            **links(parts, expected_matrix)}
