"""One (case, impl) on one rank of a process group, with the steps of `bench.measure.case.steps`; and the ranks' parts
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
from bench.comm.communicator import Communicator, use
from bench.comm.sharding import DistributedImpl, Shard
from bench.errors import Unavailable
from bench.measure.case import flops as flop_counts
from bench.measure.case.case_cache import CaseCache
from bench.measure.case.prepare import prepare_case, stage_case
from bench.measure.case.steps import call_inputs, describe_failure, failure_kind, make_inputs, policy_of, skip_reason
from bench.measure.cold import InputSets, TimedCalls, evictor_for, timing_info
from bench.measure.machine.contention import ContentionMeter
from bench.measure.machine.env import device_description
from bench.measure.machine.topology import node_label, node_of_rank
from bench.measure.memory import measure_peak
from bench.measure.oracle.check import checked_rows, nonfinite_only, oracle_errors, rows_only
from bench.measure.oracle.numerics import strict_problem
from bench.measure.oracle.reference import tolerance_for
from bench.measure.ranks.rank_part import CaseFigures, ExpectedComm, LevelCount, OpCount, RankPart
from bench.measure.task import Task
from bench.measure.timed_check import input_sets
from bench.measure.timing import CpuTimer, measure
from bench.patterns import Pattern
from bench.results.records import ErrorInfo
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


class _Phases:
    """The phase a rank is in: reported as it enters one, named by a failure."""

    def __init__(self, report: Phase) -> None:
        self.report, self.current = report, "inputs"

    def enter(self, name: str) -> None:
        self.current = name
        self.report(name)


def measure_on_rank(task: Task, ctx: RankContext, phase: Phase = lambda p: None) -> RankPart:
    """This rank's part of the record; never raises for the implementation's faults."""
    case = Case(**task.case)
    impl = registry.get(task.impl)
    out = RankPart(rank=ctx.rank)
    reason = skip_reason(impl, case)
    if reason:
        return out.model_copy(update={"status": "skipped", "reason": reason})
    assert isinstance(impl, DistributedImpl), f"{task.impl} runs on ranks but is no DistributedImpl"
    comm = Communicator.from_group(ctx.group)
    phases = _Phases(phase)
    try:
        phases.enter("inputs")
        out.node = node_label()
        # Before prepare: cp_usp places its Ulysses groups by the ranks' nodes.
        comm.node_of_rank = node_of_rank(ctx.control, ctx.world_size, out.node)
        pattern = case.make_pattern()
        with use(comm):
            held = _prepare_and_check(task, case, impl, pattern, ctx, comm, phases, out)
            _count_and_time(task, case, impl, pattern, ctx, comm, held, phases, out)
            phases.enter("memory")
            out.memory = measure_peak(held.step, ctx.device)
    except Unavailable as exc:
        return out.model_copy(update={"status": "skipped", "reason": exc.reason})
    except Exception as exc:
        reason, details = describe_failure(phases.current, exc)
        return out.failed(reason, details, phases.current, _is_comm_error(exc), failure_kind(exc))
    out.device = device_description(ctx.device)
    out.threads = torch.get_num_threads()
    if ctx.rank == 0:
        out.base = CaseFigures(density=pattern.density, block_density=pattern.block_density(case.block_size),
                               flops=flop_counts.useful_flops(case, pattern.nnz),
                               flops_dense=flop_counts.dense_flops(case))
        with use(comm):  # the closed forms see the topology the call saw (cp_usp's default degree)
            out.expected = ExpectedComm(bytes=impl.expected_comm_bytes(case),
                                        by_level=impl.expected_comm_bytes_by_level(case),
                                        matrix=impl.expected_comm_matrix(case))
    return out


@dataclass
class _RankCase:
    """What a rank holds of its pair after the first call: the timed step, its inputs and their sets, the shards."""

    step: Callable[[], Any]
    q: Tensor
    k: Tensor
    v: Tensor
    sets: InputSets | None
    shards: tuple[list[Shard], list[Shard]]  # every rank's part of q and the output, and of k and v


def _prepare_and_check(task: Task, case: Case, impl: DistributedImpl, pattern: Pattern, ctx: RankContext,
                       comm: Communicator, phases: _Phases, out: RankPart) -> _RankCase:
    """Inputs and their other sets, prepare and the first call (bench.measure.case.prepare, as every caller), the oracle
    check (gathered to rank 0, uncounted); the timed step."""
    cache = CaseCache(inputs=make_inputs(case))
    q, k, v, grad_out = call_inputs(case, cache.inputs)
    shards = [impl.shard(case, r) for r in range(ctx.world_size)]
    kv_shards = [impl.kv_shard(case, r) for r in range(ctx.world_size)]
    mine = shards[ctx.rank]

    def upstream(result: Tensor) -> Tensor:  # the gradient of what the call returned: all, or a shard
        assert grad_out is not None
        return grad_out if result.shape == grad_out.shape else mine.take(grad_out)

    phases.enter("prepare")
    prepared = prepare_case(impl, stage_case(case, pattern, q, k, v, grad_out, cache), phases.enter, upstream)
    # every rank draws the same sets from the case's seed (a paged case's pool included)
    sets = input_sets(prepared.staged, cache, task.measure.rotate)
    out.setup_s, out.setup, out.config = prepared.call.setup_s, prepared.call.setup, prepared.call.config or {}
    result = prepared.output
    held = _held_output(result, mine, case)  # raises on a wrong shape

    phases.enter("check")
    with comm.paused():
        out.error, out.problem = _check(case, impl, pattern, ctx, (shards, kv_shards), q, k, v, result, held,
                                        grad_out, full=task.measure.check)
        out.problem = out.problem or strict_problem(out.error, task.measure.numerics)
    del result, held
    prepared.call.first_output = None
    return _RankCase(prepared.step, q, k, v, sets, (shards, kv_shards))


def _count_and_time(task: Task, case: Case, impl: DistributedImpl, pattern: Pattern, ctx: RankContext,
                    comm: Communicator, held: _RankCase, phases: _Phases, out: RankPart) -> None:
    """One step counted op by op, then the timed steps (the slowest rank's time per sample) on fresh inputs and
    cold caches, their kept outputs checked, each op's time and hidden time per step, this rank's own step time
    and useful work, and the contention while timed."""
    step = held.step
    phases.enter("comm")
    comm.reset()
    step()
    if ctx.device.startswith("cuda"):
        torch.cuda.synchronize()
    counted = comm.snapshot()
    out.levels = {name: LevelCount.model_validate(level) for name, level in comm.levels_snapshot().items()}
    out.peers = {str(peer): sent for peer, sent in comm.peers_snapshot().items()}

    phases.enter("timing")
    policy = policy_of(task.measure)
    timer = RankTimer(ctx, task.measure.cache)
    nodes = comm.node_of_rank
    first_on_node = nodes is None or nodes.index(nodes[ctx.rank]) == ctx.rank
    # the ranks of a node share its last-level cache: the first one evicts it for all (before the barrier)
    evict = evictor_for(ctx.device, task.measure.cache) if first_on_node else None
    calls = TimedCalls(timer, held.sets, evict, check_from=policy.warmup, check_to=policy.warmup + policy.repeat)
    calls.drawn = _same_on_every_rank(calls.drawn, ctx)
    for _ in range(policy.warmup):
        calls.time_call(step)
    comm.reset()
    timer.own.clear()
    meter = ContentionMeter()
    meter.start()
    out.time_s = measure(step, replace(policy, warmup=0), calls)
    meter.stop()
    out.contention = meter.result(ctx.device)
    timed = comm.snapshot()
    with comm.paused():
        _check_timed(task, case, impl, pattern, ctx, held, calls, out)
    n = out.time_s.n
    # op time (and its hidden part) per step, averaged over the timed steps
    out.comm = {op: OpCount(calls=int(stats["calls"]), bytes_sent=int(stats["bytes_sent"]),
                            size_bytes=int(stats["size_bytes"]), time_s=timed.get(op, {}).get("time_s", 0.0) / n,
                            hidden_s=timed.get(op, {}).get("hidden_s", 0.0) / n) for op, stats in counted.items()}
    out.step_s = sum(timer.own) / len(timer.own) if timer.own else None
    out.pairs = impl.rank_pairs(case, pattern, ctx.rank)
    out.flops = flop_counts.attention_flops(case, out.pairs) / case.heads


def _same_on_every_rank(drawn: int | None, ctx: RankContext) -> int | None:
    """Rank 0's draw of the call to check, for every rank (each rank takes part in gathering its output)."""
    value = torch.tensor([-1 if drawn is None else drawn], dtype=torch.int64)
    torch.distributed.broadcast(value, torch.distributed.get_global_rank(ctx.control, 0), group=ctx.control)
    return None if int(value) < 0 else int(value)


def _check_timed(task: Task, case: Case, impl: registry.Impl, pattern: Pattern, ctx: RankContext,
                 held: _RankCase, calls: TimedCalls, out: RankPart) -> None:
    """Each kept output of a timed call gathered to rank 0 and checked there against the oracle for the input set
    it was given (bench.measure.timed_check says why); rank 0's part gets the record's `timing`."""
    q_shards = held.shards[0]
    worst, kept = None, calls.to_check()
    for call in kept:
        if held.sets is not None:
            held.sets.load(call.input_set)
        shard = _held_output(call.output, q_shards[ctx.rank], case)
        error, problem = _check(case, impl, pattern, ctx, held.shards, held.q, held.k, held.v, call.output, shard,
                                None, full=task.measure.check)
        if error is not None and error.rel_l2 is not None:
            worst = error.rel_l2 if worst is None else max(worst, error.rel_l2)
        if problem and out.problem is None:
            out.problem = (f"a timed call's output differed from the float64 oracle for its own inputs (timed call "
                           f"{call.index + 1}, input set {call.input_set}): {problem}; the first call's output is "
                           "not what was timed")
    calls.release()
    if held.sets is not None:
        held.sets.load(0)
    out.timing = timing_info(task.measure.cache, ctx.device, held.sets, len(kept), [calls], worst)


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

    def __init__(self, ctx: RankContext, cache: str = "cold") -> None:
        import torch.distributed as dist

        self.dist = dist
        self.ctx = ctx
        self.root = dist.get_global_rank(ctx.control, 0)
        self.own: list[float] = []  # this rank's own call times (the samples are the slowest rank's)
        self._flush = None
        self.cuda = ctx.device == "cuda"
        if self.cuda and cache == "cold":
            from bench.measure.timing import CudaTimer

            self._flush = CudaTimer().flush_l2

    def run(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        if self._flush is not None:
            self._flush()  # outside the timed interval, as in bench.measure.timing.CudaTimer
        if self.cuda:
            torch.cuda.synchronize()
        self.dist.barrier(group=self.ctx.control)
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            result = fn()
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            seconds, result = CpuTimer().run(fn)
        self.own.append(seconds)
        slowest = torch.tensor([seconds], dtype=torch.float64)
        self.dist.all_reduce(slowest, op=self.dist.ReduceOp.MAX, group=self.ctx.control)
        return float(slowest), result

    def time_call(self, fn: Callable[[], Any]) -> float:
        return self.run(fn)[0]

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


def _check(case: Case, impl: registry.Impl, pattern: Pattern, ctx: RankContext,
           shards: tuple[list[Shard], list[Shard]], q: Tensor, k: Tensor, v: Tensor, result: Tensor, held: Tensor,
           grad_out: Tensor | None, full: bool) -> tuple[ErrorInfo | None, str | None]:
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
