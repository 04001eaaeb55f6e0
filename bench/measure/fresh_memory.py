"""A pair's memory figure measured in a fresh process: what the worker's fork server runs (`memory_alone`).

The fresh process repeats the pair's setup from nothing, so that no earlier case moves the figure. A case of a
reference selector (oracle_topk, oracle_topp...) is the exception to repeating everything: the reference is the
yardstick, not a method, and costs dense attention and more (57 s at 16K on a 2-core CPU, again in every fresh
process). Its selection, made once in the worker, travels to the fresh process in a file, and the figure is the
attention's over it (`PreparedCase.memory_step`); the record's memory note says so.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

from pydantic import BaseModel, ConfigDict
from safetensors import safe_open
from safetensors.torch import save_file

from bench import registry
from bench.measure.case.case_cache import CaseCache
from bench.measure.case.prepare import PreparedCase, StagedCase, prepare_case, stage_case
from bench.measure.case.steps import call_inputs, make_inputs
from bench.measure.memory import measure_peak, track_allocations
from bench.measure.task import Task
from bench.results.records import MemoryInfo
from bench.selection import Selection
from bench.spec.case import Case

REFERENCE_NOTE = "the attention over the reference selection (the reference selector is a yardstick, not a method)"


class FreshMemoryFailed(Exception):
    """The fresh process could not measure the pair's memory (the reason is the message)."""


class FreshRequest(BaseModel):
    """What the fork server's fresh process is given: the task, and the file of a reference selection."""

    model_config = ConfigDict(extra="forbid")
    task: Task
    selection_file: str | None = None


# The pair's memory figure measured in a fresh process (`memory_alone` there): the task and a reference
# selection's file (or None); raises FreshMemoryFailed
FreshMemory = Callable[[Task, str | None], MemoryInfo]


def pair_memory(prepared: PreparedCase, task: Task, fresh: FreshMemory | None) -> MemoryInfo:
    """A prepared pair's memory figure: on CPU in a fresh process where the caller can fork one (`fresh`) and the
    suite asks for it, else in this process after its timing (`process: shared`, with why where the fresh one
    failed). A reference selector's case measures the attention over its selection, which travels in a file."""
    case = prepared.staged.case
    note = None
    reference = reference_selection(prepared.staged)
    if fresh is not None and case.device == "cpu" and task.measure.memory == "fresh":
        try:
            with selection_file(reference) as path:
                return fresh(task, path)
        except FreshMemoryFailed as exc:
            note = f"measured in the worker after earlier cases: the fresh process failed ({exc})"
    measured = measure_peak(prepared.memory_step, case.device)
    if reference is not None:
        measured = measured.model_copy(update={"note": REFERENCE_NOTE})
    if measured.method != "rss_hwm":
        return measured
    return measured.model_copy(update={"process": "shared", "note": measured.note or note})


def reference_selection(staged: StagedCase) -> Selection | None:
    """The staged case's selection when a reference selector made it, else None."""
    selector = staged.selector
    return staged.selection if selector is not None and selector.reference else None


@contextlib.contextmanager
def selection_file(selection: Selection | None) -> Iterator[str | None]:
    """A temporary file holding `selection` for the fresh process (removed after); None for None."""
    if selection is None:
        yield None
        return
    handle, path = tempfile.mkstemp(prefix="bench-selection-", suffix=".safetensors")
    os.close(handle)
    try:
        # safetensors, not torch.save: nothing in the suite unpickles a file (tests/test_security.py)
        save_file({"indices": selection.indices.cpu().contiguous()}, path,
                  metadata={"q_unit": str(selection.q_unit), "kv_unit": str(selection.kv_unit),
                            "shared": selection.shared})
        yield path
    finally:
        os.unlink(path)


def load_selection(path: str, device: str) -> Selection:
    with safe_open(path, framework="pt") as saved:
        indices = saved.get_tensor("indices")
        meta = saved.metadata()
    shared = meta["shared"]
    if shared not in ("head", "kv_group", "all"):
        raise ValueError(f"selection file {path}: shared {shared!r}; allowed: head, kv_group, all")
    return Selection(indices.to(device), int(meta["q_unit"]), int(meta["kv_unit"]), shared)


def memory_alone(request_json: dict[str, Any]) -> MemoryInfo:
    """The task's memory figure (PairSession.memory's) measured in this process as its only case: pattern,
    inputs, the case staged and prepared (plans, buffers and compiled code made, the first call run; in fwd_bwd one
    more step, so that the backward has run once too), then the measured call, every large allocation mapped
    afresh from the start (`track_allocations`). A reference selection comes from its file (module docstring).
    Run in a fresh process (bench.run.forkserver); raises what the implementation raises."""
    request = FreshRequest.model_validate(request_json)
    task = request.task
    case = Case(**task.case)
    if case.device == "cpu":
        track_allocations()  # no large free chunk on the heap for the measured call to reuse
    impl = registry.get(task.impl)
    made = make_inputs(case)
    q, k, v, grad_out = call_inputs(case, made)
    cache = CaseCache(inputs=made)
    given = None if request.selection_file is None else load_selection(request.selection_file, case.device)
    prepared = prepare_case(impl, stage_case(case, case.make_pattern(), q, k, v, grad_out, cache, selection=given))
    step = prepared.memory_step
    del prepared, cache, made
    if grad_out is not None:
        step()  # the first call ran forward only: the measured one is not the first backward
    q.grad = k.grad = v.grad = None
    figure = measure_peak(step, case.device).model_copy(update={"process": "fresh"})
    return figure if given is None else figure.model_copy(update={"note": REFERENCE_NOTE})
