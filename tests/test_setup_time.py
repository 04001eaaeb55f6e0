"""Compilation and other one-time setup land in `setup_s`, never in the timed samples (`time_s`)."""

from __future__ import annotations

import time

import pytest
import torch

from bench import registry
from bench.measure.pair import CaseCache, Task, measure_task
from bench.patterns import make_pattern
from bench.registry import Impl
from bench.spec.case import Case

MEASURE = {"warmup": 1, "repeat": 5, "max_time_s": 0.05, "timeout_s": 300, "check": True}
JIT_S = 0.5  # what the simulated just-in-time compiler below spends on its first call


class LazyCompiled(Impl):
    """Compiles on its first call, as torch.compile does: prepare returns at once, the first call is slow."""

    name = "test_lazy_compiled"

    def prepare(self, case, pattern, q, k, v):
        compiled: list[bool] = []
        mask = pattern.dense_mask()

        def call():
            if not compiled:
                time.sleep(JIT_S)
                compiled.append(True)
            scores = (q @ k.transpose(-1, -2) / case.head_dim**0.5).masked_fill(~mask, float("-inf"))
            return torch.softmax(scores, dim=-1) @ v

        return call


def _record(case: Case, impl: str):
    task = Task.of(case, impl, MEASURE)
    return measure_task(task, CaseCache())


def test_first_call_compilation_is_setup_not_time(monkeypatch):
    # Registered for this test only, so that no other test (conformance) sees it.
    monkeypatch.setitem(registry._REGISTRY, LazyCompiled.name, LazyCompiled)
    monkeypatch.setitem(registry._INSTANCES, LazyCompiled.name, LazyCompiled())
    record = _record(Case(heads=2, head_dim=16, seq_len=32, pattern="local", window=8, device="cpu"),
                     "test_lazy_compiled")
    assert record.status == "ok", record.reason
    assert record.setup_s >= JIT_S
    assert record.time_s.n >= MEASURE["repeat"]
    assert max(record.time_s.samples) < JIT_S


def _compiled_graphs() -> int:
    """Graphs torch.compile has built in this process (a call that reuses one adds nothing)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def test_flex_compiles_in_setup_and_not_while_timed():
    # float16 and causal_local: a graph no other test in this process compiles, so this record compiles.
    case = Case(heads=2, head_dim=16, seq_len=80, pattern="causal_local", window=9, block_size=16,
                dtype="float16", device="cpu")
    before = _compiled_graphs()
    record = _record(case, "flex")
    assert record.status == "ok", record.reason
    assert _compiled_graphs() > before, "expected flex to compile for this case"
    assert record.config["compiled"].startswith("torch.compile")
    # Compilation takes seconds, a call of this size milliseconds: no timed sample held a compile.
    assert max(record.time_s.samples) < record.setup_s / 5
    # The same pattern kind at another size and window reuses the graph: nothing compiles again.
    again = _compiled_graphs()
    other = _record(Case(heads=2, head_dim=16, seq_len=112, pattern="causal_local", window=20, block_size=16,
                         dtype="float16", device="cpu"), "flex")
    assert other.status == "ok", other.reason
    assert _compiled_graphs() == again, "flex compiled again for a new N and window"


def test_flex_has_no_cpu_backward_so_its_cpu_fwd_bwd_cases_are_skipped():
    from impls.flex import CPU_NO_BACKWARD, block_mask_for, compiled_flex

    pattern = make_pattern("local", 64, window=8)
    q, k, v = (torch.randn(1, 1, 64, 16, requires_grad=True) for _ in range(3))
    # The limitation is torch's, checked here so that the skip goes once torch gains a CPU backward.
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        compiled_flex()(q, k, v, block_mask=block_mask_for(pattern, 16, q.device))
    record = _record(Case(heads=1, head_dim=16, seq_len=64, window=8, mode="fwd_bwd", device="cpu"), "flex")
    assert record.status == "skipped" and record.reason == CPU_NO_BACKWARD
