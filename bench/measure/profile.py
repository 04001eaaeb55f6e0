"""`bench profile SUITE.yaml --impl NAME [--case N] [-o FILE]`: a torch.profiler trace of one (case, impl).

The implementation is prepared, called for the first time and once more untraced (compilation, autotuning
and first-call costs are setup, as in `bench run`: the same `bench.measure.pair` steps), then a few calls
are traced on the CPU and, on CUDA, on the device. The trace is
Chrome trace JSON (open it in chrome://tracing or https://ui.perfetto.dev); a table of the top operators or
kernels by self time is printed. It runs in this process: a crashing implementation ends the command.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from bench import registry
from bench.errors import BadInput, Unavailable
from bench.measure.case.case_cache import CaseCache
from bench.measure.case.prepare import prepare
from bench.measure.case.steps import call_inputs, make_inputs, skip_reason
from bench.spec.case import Case, resolve_device
from bench.spec.suite import load_suite

WARMUP_CALLS = 2
TRACED_CALLS = 3
TOP = 15


def _select(suite_path: Path, impl_name: str, index: int, device: str | None
            ) -> tuple[str, Case, registry.Impl]:
    """(suite name, the case with its device resolved, the implementation), or BadInput saying why not."""
    suite = load_suite(suite_path)
    if impl_name not in registry.names():
        raise BadInput(f"got {impl_name!r}; known implementations: {', '.join(sorted(registry.names()))}",
                       field="--impl")
    if not 0 <= index < len(suite.cases):
        raise BadInput(f"got {index}; the suite has {len(suite.cases)} cases: 0 to {len(suite.cases) - 1} "
                       "(`bench run SUITE --dry-run` lists them)", file=str(suite_path), field="--case")
    case = suite.cases[index]
    case = case.with_device(resolve_device(device or case.device))
    impl = registry.get(impl_name)
    reason = skip_reason(impl, case)
    if reason is None and case.world_size > 1:
        reason = "world_size > 1: profile one rank with torchrun instead"
    if reason:
        raise BadInput(f"cannot profile {impl_name} on case {index} ({case.label}): {reason}", field="--impl")
    return suite.name, case, impl


def _self_time_us(avg: Any, on_device: bool) -> float:
    if on_device:
        return float(getattr(avg, "self_device_time_total", getattr(avg, "self_cuda_time_total", 0.0)))
    return float(avg.self_cpu_time_total)


def top_table(prof: Any, on_device: bool, top: int = TOP) -> Table:
    """The operators (CPU) or kernels (CUDA) with the most self time over the traced calls."""
    averages = [a for a in prof.key_averages() if _self_time_us(a, on_device) > 0]
    averages.sort(key=lambda a: _self_time_us(a, on_device), reverse=True)
    total = sum(_self_time_us(a, on_device) for a in averages) or 1.0
    where = "CUDA" if on_device else "CPU"
    table = Table(title=f"top {min(top, len(averages))} by self {where} time over {TRACED_CALLS} calls")
    for column in ("name", "calls", f"self {where}", "share", "per call"):
        table.add_column(column, justify="left" if column == "name" else "right", no_wrap=column == "name")
    for avg in averages[:top]:
        self_us = _self_time_us(avg, on_device)
        table.add_row(escape(avg.key[:80]), str(avg.count), f"{self_us / 1e3:.3f} ms", f"{self_us / total:.1%}",
                      f"{self_us / TRACED_CALLS / 1e3:.3f} ms")
    return table


def default_output(suite_name: str, case: Case, impl: str) -> Path:
    return Path("profiles") / f"{suite_name}-{case.case_id}-{impl}.json"


def profile_command(suite_path: Path, impl_name: str, index: int, out: Path | None, device: str | None,
                    console: Console) -> int:
    """Trace one (case, impl) to Chrome JSON and print the top operators; returns the exit code."""
    suite_name, case, impl = _select(suite_path, impl_name, index, device)
    on_device = case.device == "cuda"
    out = out or default_output(suite_name, case, impl_name)
    out.parent.mkdir(parents=True, exist_ok=True)
    made = make_inputs(case)
    q, k, v, grad_out = call_inputs(case, made)
    sync = torch.cuda.synchronize if on_device else (lambda: None)
    t0 = time.perf_counter()
    try:  # a selection case traced end to end with its selector, a paged case through its page table
        prepared = prepare(impl, case, case.make_pattern(), q, k, v, grad_out, CaseCache(inputs=made))
    except Unavailable as exc:
        raise BadInput(f"cannot profile {impl_name}: {exc.reason}", field="--impl") from None
    step = prepared.step
    for _ in range(WARMUP_CALLS - 1):  # the first call was set_up_plain's
        step()
    sync()
    setup_s = time.perf_counter() - t0
    activities = [torch.profiler.ProfilerActivity.CPU]
    if on_device:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    label = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{impl_name} call")
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        for _ in range(TRACED_CALLS):
            with torch.profiler.record_function(label):
                step()
            sync()
    prof.export_chrome_trace(str(out))
    console.print(f"case {index}: {case.label} | {impl_name} on {case.device} ({prepared.kind} case); setup and "
                  f"{WARMUP_CALLS} warm-up calls took {setup_s:.3g} s, not traced")
    console.print(top_table(prof, on_device))
    console.print(f"trace: {out} (Chrome trace JSON: chrome://tracing or https://ui.perfetto.dev)")
    return 0
