"""FlashInfer-Bench callables as implementations: `flashinfer_reference` and one per Solution.

`flashinfer_reference` runs the reference `run()` of each case's definition (the dataset's own for an imported
case, ours for any other case that maps: bench.interop.flashinfer.synth). A Solution of language python or
triton registers as an implementation named after it (lowercase, other characters as '_') that runs the
definition it solves and skips every other case with the reason. Both are measured as every implementation is:
the harness checks their output against the float64 oracle, times the call, reads memory and contention.

The call: untimed, the case's tensors are put into their layout (bench.interop.flashinfer.layout) and, in
destination-passing style, the outputs allocated; timed, the callable alone; its output comes back as a view.
Paged cases read the pool through the page table (`paged_native`), as FlashInfer's kernels do. The LSE, which
the harness does not check outside selections, is checked once after the first call by FlashInfer-Bench's rules
(bench.interop.flashinfer.compare) and kept in the record's `config.flashinfer.lse`; `bench export` turns a
failed LSE into INCORRECT_NUMERICAL.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import torch
from pydantic import BaseModel
from torch import Tensor

from bench.errors import BadInput
from bench.inputs.paged import PagedKV
from bench.interop.flashinfer.compare import ElementCheck
from bench.interop.flashinfer.crosscheck import check_dtypes, lse_check, normalise
from bench.interop.flashinfer.dataset import LoadedSolution, read_dataset
from bench.interop.flashinfer.entries import LOADABLE, EntryError, reference_run, solution_key, solution_run
from bench.interop.flashinfer.layout import allocate_outputs, call_inputs, ours
from bench.interop.flashinfer.schema import Solution
from bench.interop.flashinfer.synth import Target, target
from bench.patterns import Pattern
from bench.registry import Impl, register
from bench.spec.case import Case

REFERENCE = "flashinfer_reference"


class FlashInferInfo(BaseModel):
    """The record's `config.flashinfer`: which definition ran, from where, and its LSE against the oracle."""

    definition: str
    definition_file: str | None  # under root; None: the definition made from the case
    root: str | None
    solution: str | None  # the Solution's own name; None for the reference
    solution_file: str | None
    lse: ElementCheck | None


class _Run:
    """What the first call leaves for the LSE check."""

    def __init__(self, case: Case, q: Tensor, kv: tuple[Tensor, Tensor] | PagedKV, target: Target) -> None:
        self.case, self.q, self.kv, self.target = case, q, kv, target
        self.outputs: list[Tensor] | None = None


class FlashInferImpl(Impl):
    """A callable of a FlashInfer-Bench dataset over the cases of its definition."""

    patterns: ClassVar[frozenset[str] | None] = frozenset({"causal", "dense"})
    solves: ClassVar[str | None] = None  # the definition a solution is for; None: each case's own
    destination_passing: ClassVar[bool] = False
    solution: ClassVar[Solution | None] = None
    solution_file: ClassVar[str | None] = None

    def __init__(self) -> None:
        self._last: _Run | None = None

    def entry(self, target: Target) -> Callable[..., Any]:
        raise NotImplementedError

    def unsupported(self, case: Case) -> str | None:
        reason = super().unsupported(case)
        if reason is not None:
            return reason
        found = target(case)
        if isinstance(found, str):
            return found
        if self.solves is not None and found.definition.name != self.solves:
            return f"{self.name} solves {self.solves}, not this case's definition {found.definition.name}"
        if found.layout.dtype != case.dtype:
            return f"definition {found.definition.name} holds q, k, v in {found.layout.dtype}, not {case.dtype}"
        return None

    def paged_native(self, case: Case) -> bool:
        return True

    def prepare(self, case: Case, pattern: Pattern, q: Tensor, k: Tensor, v: Tensor) -> Callable[[], Tensor]:
        return self._prepare(case, q, (k, v))

    def prepare_paged(self, case: Case, pattern: Pattern, q: Tensor, cache: Any,
                      patterns: list[Pattern] | None) -> Callable[[], Tensor]:
        return self._prepare(case, q, cache)

    def _prepare(self, case: Case, q: Tensor, kv: tuple[Tensor, Tensor] | PagedKV) -> Callable[[], Tensor]:
        found = target(case)
        assert not isinstance(found, str), found
        fn = self.entry(found)
        inputs = call_inputs(found.definition, found.layout, case, q, kv)
        names = list(found.definition.outputs)
        outs = allocate_outputs(found.definition, inputs, q.device) if self.destination_passing else None
        run = self._last = _Run(case, q, kv, found)
        index = names.index("output")

        def call() -> Tensor:
            result = fn(*inputs, *outs) if outs is not None else fn(*inputs)
            got = outs if outs is not None else normalise(result, names)
            check_dtypes(found, got)
            run.outputs = got
            return ours(got[index], case, "output")

        def refresh_inputs() -> None:
            """The definition's inputs made again from the case's tensors, in place: the harness writes new values
            into those between timed calls (bench.measure.cold) and calls this, untimed, after each."""
            with torch.no_grad():
                for held, fresh in zip(inputs, call_inputs(found.definition, found.layout, case, q, kv),
                                       strict=True):
                    if isinstance(held, Tensor) and isinstance(fresh, Tensor):
                        held.copy_(fresh)

        call.refresh_inputs = refresh_inputs  # type: ignore[attr-defined]
        return call

    def record_extras(self) -> dict[str, object]:
        run = self._last
        if run is None:
            return {}
        names = list(run.target.definition.outputs)
        lse = None
        if run.outputs is not None and "lse" in names:
            lse = lse_check(run.case, run.q, run.kv, run.outputs[names.index("lse")])
        info = FlashInferInfo(definition=run.target.definition.name, definition_file=run.target.file,
                              root=None if run.target.root is None else str(run.target.root),
                              solution=self.solution.name if self.solution is not None else None,
                              solution_file=self.solution_file, lse=lse)
        return {"flashinfer": info.model_dump(mode="json")}


@register
class FlashInferReference(FlashInferImpl):
    name = REFERENCE
    description = "the reference run() of each case's FlashInfer-Bench definition (plain torch, float32)"

    def entry(self, target: Target) -> Callable[..., Any]:
        return reference_run(target.definition)


class SolutionImpl(FlashInferImpl):
    def unavailable(self) -> str | None:
        assert self.solution is not None
        if self.solution.spec.language.value == "triton" and importlib.util.find_spec("triton") is None:
            return f"{self.name} is a triton solution and triton is not installed"
        return None

    def entry(self, target: Target) -> Callable[..., Any]:
        assert self.solution is not None
        return solution_run(self.solution)


def impl_name(solution_name: str) -> str:
    """A registry name for a solution: lowercase letters, digits and '_'."""
    return re.sub(r"_+", "_", re.sub(r"[^a-z0-9_]", "_", solution_name.lower())).strip("_") or "solution"


def _devices(solution: Solution) -> frozenset[str]:
    targets = {t.lower() for t in solution.spec.target_hardware}
    gpu = any(t in ("cuda", "gpu") or t.startswith(("nvidia", "sm", "h100", "a100", "b200")) for t in targets)
    cpu = "cpu" in targets
    return frozenset({"cpu"} if cpu and not gpu else {"cuda"} if gpu and not cpu else {"cpu", "cuda"})


_REGISTERED: dict[str, tuple[str, str, str]] = {}  # impl name -> (solution digest, its file, its dataset)


def register_solution(loaded: LoadedSolution, root: Path) -> str:
    """Register one solution (loading its entry point now, so that a missing one is found here). Returns the
    implementation's name. Raises EntryError (a name another solution of the dataset took among them)."""
    solution = loaded.solution
    if solution.spec.language not in LOADABLE:
        raise EntryError(f"language {solution.spec.language.value}: only python and triton solutions run here "
                         "(the others need FlashInfer-Bench's build)", "spec.language")
    name, key, file = impl_name(solution.name), solution_key(solution), str(root / loaded.file)
    previous = _REGISTERED.get(name)
    if previous is not None and previous[0] != key and previous[2] == str(root):
        raise EntryError(f"solution {solution.name!r} takes the implementation name {name}, which {previous[1]} "
                         "has", "name")  # two solutions of one dataset; another dataset's newer one replaces it
    solution_run(solution)
    attrs = {"name": name, "solves": solution.definition, "solution": solution, "__module__": __name__,
             "solution_file": str(root / loaded.file), "destination_passing": solution.spec.destination_passing_style,
             "devices": _devices(solution), "__qualname__": f"Solution_{name}",
             "description": solution.description or f"FlashInfer-Bench solution {solution.name} by {solution.author}"}
    cls = register(type(f"Solution_{name}", (SolutionImpl,), attrs))
    cls.source = f"flashinfer solution {file}"
    _REGISTERED[name] = (key, file, str(root))
    return name


def register_solutions(root: Path | str, names: list[str] | None = None) -> list[str]:
    """Register the dataset's solutions (those named, by their own names; all by default). Returns the
    implementations' names. Raises BadInput naming the file and field of the first that cannot load."""
    root = Path(root)
    dataset = read_dataset(root)
    wanted = set(names) if names is not None else None
    out = []
    for loaded in dataset.solutions:
        if wanted is not None and loaded.solution.name not in wanted:
            continue
        try:
            out.append(register_solution(loaded, dataset.root))
        except EntryError as exc:
            raise BadInput(exc.message, file=str(dataset.root / loaded.file), field=exc.field) from None
    if wanted is not None:
        missing = wanted - {s.solution.name for s in dataset.solutions}
        problems = {p.file: p.text() for p in dataset.problems}
        if missing:
            raise BadInput(f"no sound solution named {sorted(missing)} here; problems: "
                           f"{'; '.join(problems.values()) or 'none'}", file=str(root))
    return out
