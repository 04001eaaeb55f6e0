"""Measure one (case, impl) on one rank of a process group, and assemble the ranks' parts into one Record.

Every rank runs bench.measure's phases in lockstep (inputs, prepare, first call, check, timing, memory) plus
`comm`, one step counted op by op through bench.comm. Every rank must call the implementation the same number
of times, because each call holds collectives:

- timing: before each sample the ranks meet at a barrier (after a CUDA synchronize and L2 flush); each rank
  times its own call; the sample kept is the slowest rank's (an all-reduce of the maximum, outside the
  timed interval). Every rank sees the same samples and the sampling clock is rank 0's, so all ranks stop
  after the same sample.
- check: outside the timed region and uncounted, the output shards (and in fwd_bwd the parts of dq, dk, dv
  each rank owns) are gathered to rank 0 and checked there against the float64 oracle, as in bench.measure.

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

from bench import flops as flop_counts
from bench import registry
from bench.case import Case
from bench.comm import Communicator, bus_factor, use
from bench.env import device_description
from bench.errors import Unavailable
from bench.measure import Task, checkpointed, describe_failure, make_inputs, sync_device, upstream_grad
from bench.memory import measure_peak
from bench.records import Record
from bench.reference import compare, reference_attention, rows_to_check, tolerance_for
from bench.sharding import Shard
from bench.timing import CpuTimer, TimingPolicy, measure

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
    comm = Communicator.from_group(ctx.group)
    current = "inputs"
    try:
        phase(current)
        pattern = case.make_pattern()
        inputs = make_inputs(case)
        q, k, v = (t.detach().requires_grad_(case.mode == "fwd_bwd") for t in inputs)
        grad_out = upstream_grad(case) if case.mode == "fwd_bwd" else None
        with use(comm):
            current = "prepare"
            phase(current)
            t0 = time.perf_counter()
            fn = impl.prepare(case, pattern, q, k, v)
            if case.checkpoint:
                fn = checkpointed(fn)
            current = "first call"
            phase(current)
            result = fn()
            sync_device(ctx.device)
            out["setup_s"] = time.perf_counter() - t0
            out["config"] = impl.record_extras() or {}
            shards = [impl.shard(case, r) for r in range(ctx.world_size)]
            kv_shards = [impl.kv_shard(case, r) for r in range(ctx.world_size)]
            held = _held_output(result, shards[ctx.rank], case)  # raises on a wrong shape

            current = "check"
            phase(current)
            with comm.paused():
                out["error"], out["problem"] = _check(case, impl, pattern, ctx, (shards, kv_shards), q, k, v,
                                                      result, held, grad_out, full=task.measure["check"])
            del result, held
            step = _timed_step(fn, q, k, v, grad_out, shards[ctx.rank], case)

            current = "comm"
            phase(current)
            comm.reset()
            step()
            sync_device(ctx.device)
            counted = comm.snapshot()

            current = "timing"
            phase(current)
            policy = TimingPolicy(warmup=task.measure["warmup"], repeat=task.measure["repeat"],
                                  max_time_s=task.measure["max_time_s"])
            timer = RankTimer(ctx)
            for _ in range(policy.warmup):
                timer.time_call(step)
            comm.reset()
            out["time_s"] = measure(step, replace(policy, warmup=0), timer)
            timed = comm.snapshot()
            for op, stats in counted.items():  # op time per step, averaged over the timed steps
                stats["time_s"] = timed.get(op, {}).get("time_s", 0.0) / out["time_s"]["n"]
            out["comm"] = counted

            current = "memory"
            phase(current)
            out["memory"] = measure_peak(step, ctx.device)
    except Unavailable as exc:
        return {**out, "status": "skipped", "reason": exc.reason}
    except Exception as exc:
        reason, details = describe_failure(current, exc)
        return {**out, "status": "failed", "reason": reason, "details": details, "phase": current,
                "comm_error": _is_comm_error(exc)}
    out["device"] = device_description(ctx.device)
    out["threads"] = torch.get_num_threads()
    if ctx.rank == 0:
        out["base"] = {"density": pattern.density, "block_density": pattern.block_density(case.block_size),
                       "flops": flop_counts.useful_flops(case, pattern.nnz),
                       "flops_dense": flop_counts.dense_flops(case)}
        out["expected_bytes"] = impl.expected_comm_bytes(case)
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


def _upstream_for(result: Tensor, grad: Tensor, shard: Shard) -> Tensor:
    """The upstream gradient of what the call returned (the full output, or this rank's shard)."""
    return grad if result.shape == grad.shape else shard.take(grad)


def _timed_step(fn: Callable[[], Tensor], q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor | None,
                shard: Shard, case: Case) -> Callable[[], Any]:
    if grad_out is None:
        return fn

    def fwd_bwd() -> None:
        q.grad = k.grad = v.grad = None
        result = fn()
        result.backward(_upstream_for(result, grad_out, shard))

    return fwd_bwd


class RankTimer:
    """bench.timing's Timer protocol across ranks: barrier, time the call, keep the slowest rank's time."""

    def __init__(self, ctx: RankContext) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.ctx = ctx
        self.root = dist.get_global_rank(ctx.control, 0)
        self._flush = None
        if ctx.device == "cuda":
            from bench.timing import CudaTimer

            self._flush = CudaTimer().flush_l2

    def time_call(self, fn: Callable[[], Any]) -> float:
        if self._flush is not None:
            self._flush()  # outside the timed interval, as in bench.timing.CudaTimer
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
    shards[0].take(whole).copy_(local)
    for r in range(1, ctx.world_size):
        part = torch.empty(shards[r].shape(full), dtype=local.dtype, device=local.device)
        dist.recv(part, dist.get_global_rank(ctx.group, r), group=ctx.group)
        shards[r].take(whole).copy_(part)
    return whole


def _check(case: Case, impl: registry.Impl, pattern: Any, ctx: RankContext,
           shards: tuple[list[Shard], list[Shard]], q: Tensor, k: Tensor, v: Tensor, result: Tensor, held: Tensor,
           grad_out: Tensor | None, full: bool) -> tuple[dict[str, Any] | None, str | None]:
    """Gather the output (and owned gradients) to rank 0 and compare with the oracle there.

    `shards`: every rank's part of q and the output, and of k and v.
    """
    q_shards, kv_shards = shards
    whole = _gather_to_rank0(held, q_shards, tuple(q.shape), ctx)
    rows = rows_to_check(case.batch, case.heads, case.seq_len, seed=case.seed, q_len=case.n_queries)
    tol = tolerance_for(case.dtype, impl.tf32(case))
    grads_whole: list[Tensor | None] = []
    if grad_out is not None and full:
        row_mask = torch.zeros(case.n_queries, dtype=torch.bool, device=q.device)
        row_mask[rows.to(q.device)] = True
        g = grad_out * row_mask[:, None].to(grad_out.dtype)  # upstream gradient only on the checked rows
        got = torch.autograd.grad(result, (q, k, v), _upstream_for(result, g, q_shards[ctx.rank]),
                                  allow_unused=True)
        for leaf, grad, parts in zip((q, k, v), got, (q_shards, kv_shards, kv_shards), strict=True):
            owned = parts[ctx.rank].take(torch.zeros_like(leaf) if grad is None else grad)
            grads_whole.append(_gather_to_rank0(owned, parts, tuple(leaf.shape), ctx))
    if ctx.rank != 0:
        return None, None
    assert whole is not None
    if not full:
        nonfinite = int((~torch.isfinite(whole)).sum())
        error = {"max_abs": None, "rel_l2": None, "tolerance": tol, "rows_checked": 0, "nonfinite": nonfinite}
        return error, (f"output has {nonfinite} NaN/Inf values" if nonfinite else None)
    with torch.no_grad():
        expected = reference_attention(q.detach(), k.detach(), v.detach(), pattern, rows)
    stats = compare(whole[:, :, rows.to(whole.device)], expected, tol)
    error: dict[str, Any] = {"max_abs": stats.max_abs, "rel_l2": stats.rel_l2, "tolerance": tol,
                             "rows_checked": stats.rows_checked, "nonfinite": stats.nonfinite}
    problem = None if stats.passed else _problem("output", stats.rel_l2, tol, stats.nonfinite)
    if grads_whole:
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref = reference_attention(*leaves, pattern, rows)
        expected_grads = torch.autograd.grad(ref, leaves, g[:, :, rows.to(g.device)].double())
        error["grads"] = {}
        for name, actual, exp in zip(("dq", "dk", "dv"), grads_whole, expected_grads, strict=True):
            s = compare(actual, exp, tol)
            error["grads"][name] = {"max_abs": s.max_abs, "rel_l2": s.rel_l2, "tolerance": tol,
                                    "nonfinite": s.nonfinite}
            if problem is None and not s.passed:
                problem = _problem(name, s.rel_l2, tol, s.nonfinite)
    return error, problem


def _problem(what: str, rel_l2: float | None, tol: float, nonfinite: int) -> str:
    if nonfinite:
        return f"{what} has {nonfinite} NaN/Inf values"
    return f"{what} off the float64 oracle: rel_l2 {rel_l2:.3g} > tolerance {tol:g}"


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
                      details=failure.get("details"), setup_s=failure.get("setup_s"))
    if any(p["status"] == "skipped" for p in parts):
        return Record(**base, status="skipped", reason=next(p["reason"] for p in parts if p["status"] == "skipped"))
    root = parts[0]
    peaks = [p["memory"]["peak_bytes"] for p in parts]
    known = [b for b in peaks if b is not None]
    memory = {"peak_bytes": max(known) if known else None, "method": root["memory"]["method"],
              "note": f"largest of {world} ranks; per rank: {peaks}"}
    config = {**root.get("config", {}), "world_size": world, "backend": backend}
    if task.case.get("device") == "cpu":
        config["threads_per_rank"] = root.get("threads")
    time_s = root["time_s"]
    flops = root["base"]["flops"]
    return Record(**base, **root["base"], status="incorrect" if root["problem"] else "ok", reason=root["problem"],
                  time_s=time_s, setup_s=max(p["setup_s"] for p in parts), memory=memory,
                  comm=comm_info(parts, backend, root.get("expected_bytes")), error=root["error"],
                  device=f"{root['device']} x{world} ranks ({backend})", config=config,
                  flops_per_s=flops / time_s["median"] if time_s["median"] > 0 else None)


def comm_info(parts: list[dict[str, Any]], backend: str, expected: int | None) -> dict[str, Any]:
    """The record's `comm`: bytes per rank and per op for one step, op times from the slowest rank.

    algbw = nccl-tests size / time (the busiest rank's size over the slowest rank's time: a collective ends
    when its last rank does), busbw = algbw * bus_factor (bench.comm).
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
                     "algbw_gbps": algbw, "busbw_gbps": None if algbw is None else algbw * bus_factor(op, world)}
    return {"backend": backend, "bytes_total": sum(per_rank), "bytes_max_rank": max(per_rank), "by_op": by_op,
            "expected_bytes": expected, "world_size": world, "bytes_per_rank": per_rank}
