"""One (case, impl) on one rank of a process group, with the steps of `bench.measure.steps`; and the ranks' parts
assembled into one Record.

Every rank goes through the same phases in lockstep (inputs, prepare, first call, check, comm, timing, memory),
because every call holds collectives and every rank must make the same number of calls:

- check: outside the timed region and uncounted, the output shards (and in fwd_bwd the parts of dq, dk, dv each
  rank owns) are gathered to rank 0 and checked there against the float64 oracle (`pair.oracle_errors`).
- comm: one step counted op by op (and level by level) through bench.comm.
- timing: before each sample the ranks meet at a barrier (after a CUDA synchronize and L2 flush); each rank
  times its own call; the sample kept is the slowest rank's (an all-reduce of the maximum, outside the timed
  interval). Every rank sees the same samples and the sampling clock is rank 0's, so all ranks stop together.
  Each rank also keeps its own times: its mean step time, and its ops' times and hidden times (bench.comm,
  "Overlap") averaged over the timed steps, give the record's per-rank compute_s, comm_s and hidden_s.

Barriers, clocks and the gather of results use a separate gloo "control" group, so they never mix with the
implementation's collectives (which on CUDA go through nccl).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from bench import registry
from bench.comm import Communicator, bus_factor, use
from bench.errors import Unavailable
from bench.measure import flops as flop_counts
from bench.measure.check import checked_rows, nonfinite_only, oracle_errors, rows_only
from bench.measure.contention import ContentionMeter
from bench.measure.env import device_description
from bench.measure.memory import measure_peak
from bench.measure.reference import tolerance_for
from bench.measure.steps import call_inputs, describe_failure, failure_kind, policy_of, prepare_call, timed_step
from bench.measure.task import Task
from bench.measure.timing import CpuTimer, measure
from bench.results.records import Record
from bench.sharding import DistributedImpl, Shard
from bench.spec.case import Case

Phase = Callable[[str], None]

# Phases in the order a rank goes through them; a timeout names the rank that is furthest behind.
PHASES = ("start", "init", "inputs", "prepare", "first call", "check", "comm", "timing", "memory", "done")


@dataclass
class RankContext:
    rank: int
    world_size: int
    group: Any  # process group of the implementation's collectives
    control: Any  # gloo group for barriers, the clock and small reductions
    backend: str  # gloo | nccl
    device: str  # cpu | cuda


def measure_on_rank(task: Task, ctx: RankContext, phase: Phase = lambda p: None) -> dict[str, Any]:
    """This rank's part of the record, as a JSON-able dict; never raises for the implementation's faults."""
    case = Case(**task.case)
    impl = registry.get(task.impl)
    out: dict[str, Any] = {"rank": ctx.rank}
    reason = impl.unavailable() or impl.unsupported(case)
    if reason:
        return {**out, "status": "skipped", "reason": reason}
    assert isinstance(impl, DistributedImpl), f"{task.impl} runs on ranks but is no DistributedImpl"
    comm = Communicator.from_group(ctx.group)
    current = "inputs"

    def enter(name: str) -> None:
        nonlocal current
        current = name
        phase(name)

    try:
        enter("inputs")
        pattern = case.make_pattern()
        q, k, v, grad_out = call_inputs(case)
        with use(comm):
            enter("prepare")
            prepared = prepare_call(impl, case, pattern, q, k, v, enter)
            out["setup_s"] = prepared.setup_s
            out["setup"] = prepared.setup.model_dump()
            out["config"] = prepared.config or {}
            shards = [impl.shard(case, r) for r in range(ctx.world_size)]
            kv_shards = [impl.kv_shard(case, r) for r in range(ctx.world_size)]
            result = prepared.first_output
            held = _held_output(result, shards[ctx.rank], case)  # raises on a wrong shape

            enter("check")
            with comm.paused():
                out["error"], out["problem"] = _check(case, impl, pattern, ctx, (shards, kv_shards), q, k, v,
                                                      result, held, grad_out, full=task.measure.check)
            del result, held, prepared.first_output
            mine = shards[ctx.rank]

            def upstream(result: Tensor) -> Tensor:  # the gradient of what the call returned: all, or a shard
                assert grad_out is not None
                return grad_out if result.shape == grad_out.shape else mine.take(grad_out)

            step = timed_step(prepared.fn, q, k, v, grad_out, upstream)

            enter("comm")
            comm.reset()
            step()
            if ctx.device.startswith("cuda"):
                torch.cuda.synchronize()
            counted = comm.snapshot()
            out["levels"] = comm.levels_snapshot()

            enter("timing")
            policy = policy_of(task.measure)
            timer = RankTimer(ctx)
            for _ in range(policy.warmup):
                timer.time_call(step)
            comm.reset()
            timer.own.clear()
            meter = ContentionMeter()
            meter.start()
            out["time_s"] = measure(step, replace(policy, warmup=0), timer)
            meter.stop()
            out["contention"] = meter.result(ctx.device)
            timed = comm.snapshot()
            n = out["time_s"]["n"]
            for op, stats in counted.items():  # op time (and its hidden part) per step, averaged over the timed steps
                stats["time_s"] = timed.get(op, {}).get("time_s", 0.0) / n
                stats["hidden_s"] = timed.get(op, {}).get("hidden_s", 0.0) / n
            out["comm"] = counted
            out["step_s"] = sum(timer.own) / len(timer.own) if timer.own else None
            out["pairs"] = impl.rank_pairs(case, pattern, ctx.rank)
            out["flops"] = flop_counts.attention_flops(case, out["pairs"]) / case.heads

            enter("memory")
            out["memory"] = measure_peak(step, ctx.device)
    except Unavailable as exc:
        return {**out, "status": "skipped", "reason": exc.reason}
    except Exception as exc:
        reason, details = describe_failure(current, exc)
        return {**out, "status": "failed", "reason": reason, "details": details, "phase": current,
                "comm_error": _is_comm_error(exc), "failure": failure_kind(exc)}
    out["device"] = device_description(ctx.device)
    out["threads"] = torch.get_num_threads()
    if ctx.rank == 0:
        out["base"] = {"density": pattern.density, "block_density": pattern.block_density(case.block_size),
                       "flops": flop_counts.useful_flops(case, pattern.nnz),
                       "flops_dense": flop_counts.dense_flops(case)}
        out["expected_bytes"] = impl.expected_comm_bytes(case)
        out["expected_by_level"] = impl.expected_comm_bytes_by_level(case)
    return {**out, "status": "ok"}


def _is_comm_error(exc: BaseException) -> bool:
    """Errors of the communication layer itself (a peer died, a collective timed out): consequences.

    nccl raises torch.distributed.DistError subclasses; gloo raises a plain RuntimeError whose message names
    its transport ("[.../gloo/transport/tcp/pair.cc:553] Connection closed by peer").
    """
    dist_error = getattr(torch.distributed, "DistError", None)
    return (dist_error is not None and isinstance(exc, dist_error)) or "/gloo/transport/" in str(exc)


def _held_output(result: Any, shard: Shard, case: Case) -> Tensor:
    """The rank's shard of the output, from a call that returned the full output or the shard."""
    full = case.q_shape()
    if isinstance(result, Tensor) and tuple(result.shape) == shard.shape(full):
        return result
    if isinstance(result, Tensor) and tuple(result.shape) == full:
        return shard.take(result)
    got = tuple(result.shape) if isinstance(result, Tensor) else type(result).__name__
    raise ValueError(f"wrong output: got {got}, expected the full output {full} or this rank's shard "
                     f"{shard.shape(full)}")


class RankTimer:
    """bench.measure.timing's Timer protocol across ranks: barrier, time the call, keep the slowest rank's time."""

    def __init__(self, ctx: RankContext) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.ctx = ctx
        self.root = dist.get_global_rank(ctx.control, 0)
        self.own: list[float] = []  # this rank's own call times (the samples are the slowest rank's)
        self._flush = None
        if ctx.device == "cuda":
            from bench.measure.timing import CudaTimer

            self._flush = CudaTimer().flush_l2

    def time_call(self, fn: Callable[[], Any]) -> float:
        if self._flush is not None:
            self._flush()  # outside the timed interval, as in bench.measure.timing.CudaTimer
            torch.cuda.synchronize()
        self.dist.barrier(group=self.ctx.control)
        if self._flush is not None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            seconds = CpuTimer().time_call(fn)
        self.own.append(seconds)
        slowest = torch.tensor([seconds], dtype=torch.float64)
        self.dist.all_reduce(slowest, op=self.dist.ReduceOp.MAX, group=self.ctx.control)
        return float(slowest)

    def clock(self) -> float:
        now = torch.tensor([time.perf_counter()], dtype=torch.float64)
        self.dist.broadcast(now, self.root, group=self.ctx.control)  # rank 0's clock decides for all
        return float(now)


def _gather_to_rank0(local: Tensor, shards: list[Shard], full: tuple[int, ...], ctx: RankContext) -> Tensor | None:
    """Rank 0 gets the full tensor assembled from every rank's shard (raw send/recv: not counted)."""
    import torch.distributed as dist

    local = local.detach().contiguous()
    if ctx.rank != 0:
        dist.send(local, dist.get_global_rank(ctx.group, 0), group=ctx.group)
        return None
    whole = torch.empty(full, dtype=local.dtype, device=local.device)
    shards[0].put(whole, local)
    for r in range(1, ctx.world_size):
        part = torch.empty(shards[r].shape(full), dtype=local.dtype, device=local.device)
        dist.recv(part, dist.get_global_rank(ctx.group, r), group=ctx.group)
        shards[r].put(whole, part)
    return whole


def _check(case: Case, impl: registry.Impl, pattern: Any, ctx: RankContext,
           shards: tuple[list[Shard], list[Shard]], q: Tensor, k: Tensor, v: Tensor, result: Tensor, held: Tensor,
           grad_out: Tensor | None, full: bool) -> tuple[dict[str, Any] | None, str | None]:
    """Gather the output (and owned gradients) to rank 0 and compare with the oracle there.

    `shards`: every rank's part of q and the output, and of k and v.
    """
    q_shards, kv_shards = shards
    whole = _gather_to_rank0(held, q_shards, tuple(q.shape), ctx)
    tol = tolerance_for(case.dtype, impl.tf32(case))
    grads_whole: list[Tensor | None] = []
    g = None
    if grad_out is not None and full:
        g = rows_only(case, grad_out, checked_rows(case))
        upstream = g if result.shape == g.shape else q_shards[ctx.rank].take(g)
        got = torch.autograd.grad(result, (q, k, v), upstream, allow_unused=True)
        for leaf, grad, parts in zip((q, k, v), got, (q_shards, kv_shards, kv_shards), strict=True):
            owned = parts[ctx.rank].take(torch.zeros_like(leaf) if grad is None else grad)
            grads_whole.append(_gather_to_rank0(owned, parts, tuple(leaf.shape), ctx))
    if ctx.rank != 0:
        return None, None
    assert whole is not None
    if not full:
        return nonfinite_only(whole, tol)
    return oracle_errors(case, pattern, q, k, v, whole, tol, tuple(grads_whole) if grads_whole else None, g)


# --- the ranks' parts -> one Record -----------------------------------------------------------------------

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
                     str(task.case.get("device")))
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
              expected_by_level: dict[str, int] | None = None, device: str = "cpu") -> dict[str, Any]:
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
            "overlap_method": "cuda_events" if device.startswith("cuda") else "host", "by_level": by_level}
