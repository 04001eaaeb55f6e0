"""`bench export RUN_DIR --format flashinfer-trace -o ROOT`: a run as a FlashInfer Trace dataset.

For every record whose case has a definition (its dataset's own, or one made from it: bench.interop.flashinfer.
synth) and that was measured (skipped records have no evaluation), ROOT gets the definition
(`definitions/<op_type>/<name>.json`), the workload (`workloads/<op_type>/<name>.jsonl`, with its safetensors blobs:
a dataset's copied, ours written), a Solution per implementation and definition (a dataset's own Solution as it
was; ours describes the implementation) and a trace line in `traces/<op_type>/<name>.jsonl`:

- status from the record: ok -> PASSED (INCORRECT_NUMERICAL when the LSE failed their rules), incorrect ->
  INCORRECT_NUMERICAL, failed -> TIMEOUT, INCORRECT_SHAPE, INCORRECT_DTYPE, COMPILE_ERROR or RUNTIME_ERROR by the
  failure and its reason;
- correctness: max_absolute_error is the record's error.max_abs (against the float64 oracle), max_relative_error
  its max_rel, the elementwise maximum of |error| / (|oracle| + 1e-8) as the format defines it (NaN for a record
  written before records kept it; `extra.relative_error` says which), extra our error, fidelity and LSE fields;
- an existing dataset at ROOT keeps every trace line this export does not write again (another tool's, another
  run's): a trace file is appended to, its lines for the same (workload, solution) replaced;
- performance (PASSED): latency_ms the median, reference_latency_ms the median of `--reference`
  (flashinfer_reference: the definition's reference run()) on the same case in the same run, speedup_factor their
  ratio (0 where the reference was not measured, and the log says so);
- environment: the device and the versions of the run.
"""

from __future__ import annotations

import json
import re
import shutil
from collections import defaultdict
from dataclasses import dataclass, field, fields
from pathlib import Path

from pydantic import BaseModel
from safetensors.torch import save_file
from torch import Tensor

from bench.interop.flashinfer.dataset import Dataset, read_dataset
from bench.interop.flashinfer.schema import (
    BuildSpec,
    Correctness,
    Definition,
    Environment,
    Evaluation,
    Language,
    Performance,
    Solution,
    SourceFile,
    Status,
    Trace,
    Workload,
)
from bench.interop.flashinfer.solutions import REFERENCE, FlashInferInfo, impl_name
from bench.interop.flashinfer.synth import Target, synth_workload, target, workload_inputs
from bench.results.records import Record
from bench.results.store import Run, load_run
from bench.spec.case import Case


class LeftOut(BaseModel):
    case_id: str
    impl: str
    reason: str


class ExportSummary(BaseModel):
    root: str
    traces: int
    definitions: list[str]
    solutions: list[str]
    left_out: list[LeftOut]


@dataclass
class _Item:
    """A file to write under the output root: `relative` its path, from `source` (a dataset's root) or made here."""

    relative: str
    source: Path | None


@dataclass
class _Out:
    """What one export writes, gathered before anything is written."""

    definitions: dict[str, tuple[Definition, _Item]] = field(default_factory=dict)
    workloads: dict[str, dict[str, tuple[Workload, _Item]]] = field(default_factory=dict)  # definition -> uuid
    blobs: dict[str, Path | dict[str, Tensor]] = field(default_factory=dict)  # relative -> file to copy, or tensors
    solutions: dict[str, tuple[Solution, _Item]] = field(default_factory=dict)
    traces: dict[str, list[Trace]] = field(default_factory=lambda: defaultdict(list))  # definition -> traces


def case_of(record: Record) -> Case | str:
    names = {f.name for f in fields(Case)}
    try:
        return Case(**{k: v for k, v in record.params.items() if k in names})
    except (TypeError, ValueError) as exc:
        return f"params do not make a case here: {exc}"


def status_of(record: Record) -> Status | None:
    """FlashInfer-Bench's status of a measured record (None for a skipped one)."""
    info = _info(record)
    if record.status == "ok":
        return "INCORRECT_NUMERICAL" if info is not None and info.lse is not None and not info.lse.passed \
            else "PASSED"
    if record.status == "incorrect":
        return "INCORRECT_NUMERICAL"
    if record.status == "skipped":
        return None
    reason = (record.reason or "").lower()
    if record.failure == "timeout":
        return "TIMEOUT"
    for word, status in (("shape", "INCORRECT_SHAPE"), ("dtype", "INCORRECT_DTYPE"), ("compil", "COMPILE_ERROR")):
        if word in reason:
            return status  # type: ignore[return-value]
    return "RUNTIME_ERROR"


def _info(record: Record) -> FlashInferInfo | None:
    raw = (record.config or {}).get("flashinfer")
    return FlashInferInfo.model_validate(raw) if isinstance(raw, dict) else None


def _nan(value: float | None) -> float:
    return float("nan") if value is None else float(value)


def _correctness(record: Record, run: Run) -> Correctness:
    info = _info(record)
    error = record.error
    extra: dict[str, object] = {
        "relative_error": "the elementwise maximum of |error| / (|float64 oracle| + 1e-8) on the checked rows"
                          if error is not None and error.max_rel is not None else
                          "not kept by the record (written before sparse-attention-bench kept the elementwise "
                          "maximum): NaN; error.rel_l2 is the L2 norm of the error over the oracle's",
        "error": None if error is None else error.model_dump(mode="json"),
        "fidelity": None if record.fidelity is None else record.fidelity.model_dump(mode="json"),
        "lse": None if info is None or info.lse is None else info.lse.model_dump(mode="json"),
        "case_id": record.case_id, "impl": record.impl, "run_id": run.info.run_id,
        "contention": None if record.contention is None else record.contention.verdict,
    }
    return Correctness(max_absolute_error=_nan(error.max_abs if error else None),
                       max_relative_error=_nan(error.max_rel if error else None), extra=extra)


def _environment(record: Record, run: Run) -> Environment:
    env = run.info.env
    device = str(record.params.get("device", "cpu"))
    gpu = next((g.name for g in env.gpus if g.name), None)
    hardware = (gpu if device.startswith("cuda") and gpu else env.cpu.model) or record.device or "unknown"
    libs = {k: str(v) for k, v in (("torch", env.versions.torch), ("triton", env.versions.triton),
                                    ("python", env.versions.python), ("cuda", env.versions.cuda),
                                    ("sparse-attention-bench", env.git.commit)) if v}
    return Environment(hardware=hardware, libs=libs)


def _reference_ms(run: Run, reference: str) -> dict[str, float]:
    return {r.case_id: r.time_s.median * 1e3 for r in run.records
            if r.impl == reference and r.status == "ok" and r.time_s is not None and r.time_s.n > 0}


def evaluation(record: Record, run: Run, reference: str, reference_ms: dict[str, float]) -> Evaluation | None:
    status = status_of(record)
    if status is None:
        return None
    log = f"sparse-attention-bench run {run.info.run_id}: {record.impl} on {record.case_id}: {record.status}"
    log += f" ({record.reason})" if record.reason else ""
    performance = None
    if status == "PASSED" and record.time_s is not None:
        latency = record.time_s.median * 1e3
        ref = reference_ms.get(record.case_id)
        if ref is None:
            log += f"; reference {reference} not measured ok in this run: speedup unknown (0)"
        performance = Performance(latency_ms=latency, reference_latency_ms=ref or 0.0,
                                  speedup_factor=ref / latency if ref and latency > 0 else 0.0)
    correctness = _correctness(record, run) if status in ("PASSED", "INCORRECT_NUMERICAL") else None
    return Evaluation(status=status, environment=_environment(record, run), timestamp=record.started_at or
                      run.info.started_at, log=log, correctness=correctness, performance=performance)


_STUB = '''def run(*args, **kwargs):
    """{impl} as sparse-attention-bench measured it ({description}).

    Its kernel runs inside sparse-attention-bench (`bench run` with impls: [{impl}]); this entry point records the
    implementation in FlashInfer-Bench's dataset and does not run it.
    """
    raise NotImplementedError("{impl} runs in sparse-attention-bench: bench run SUITE --impl {impl}")
'''


def our_solution(impl: str, definition: Definition) -> Solution:
    from bench import registry

    try:
        found = registry.get(impl)
        description, devices = found.description or impl, sorted(found.devices)
    except KeyError:
        description, devices = impl, ["cpu", "cuda"]
    code = _STUB.format(impl=impl, description=description.replace('"', "'"))
    return Solution(name=f"{impl}__{definition.name}", definition=definition.name, author="sparse-attention-bench",
                    description=f"sparse-attention-bench implementation {impl}: {description}",
                    spec=BuildSpec(language=Language.PYTHON, target_hardware=devices, entry_point="main.py::run",
                                   dependencies=["sparse-attention-bench"], destination_passing_style=False),
                    sources=[SourceFile(path="main.py", content=code)])


def reference_solution(definition: Definition) -> Solution:
    """The definition's own reference as a Solution: what flashinfer_reference ran."""
    return Solution(name=f"{REFERENCE}__{definition.name}", definition=definition.name, author="sparse-attention-bench",
                    description="the definition's reference run(), measured as sparse-attention-bench's "
                                f"{REFERENCE}", sources=[SourceFile(path="main.py", content=definition.reference)],
                    spec=BuildSpec(language=Language.PYTHON, target_hardware=["cpu", "cuda"],
                                   entry_point="main.py::run", destination_passing_style=False))


_DATASETS: dict[str, Dataset] = {}


def _dataset(root: Path) -> Dataset:
    key = str(root.resolve())
    if key not in _DATASETS:
        _DATASETS[key] = read_dataset(root)
    return _DATASETS[key]


def _workload(case: Case, found: Target, out: _Out) -> Workload | str:
    """The case's workload (its dataset's, with the blobs it names, or made from the case), gathered in `out`."""
    name, op = found.definition.name, found.definition.op_type
    if found.root is not None:
        loaded = next((w for w in _dataset(found.root).workloads.get(name, [])
                       if w.trace.workload.uuid == found.workload), None)
        if loaded is None:
            return f"{found.root} no longer holds workload {found.workload} of {name}"
        for spec in loaded.trace.workload.inputs.values():
            if getattr(spec, "type", "") == "safetensors":
                rel = str(Path(spec.path))  # type: ignore[union-attr]
                out.blobs[rel] = found.root / rel
        workload = loaded.trace.workload
        item = _Item(relative=loaded.file, source=found.root)
    else:
        made, tensors = synth_workload(case, found.layout)
        variables = set(found.definition.axes) - set(found.definition.const_axes())
        rel = f"blob/workloads/{op}/{name}/{name}_{made.uuid}.safetensors"
        out.blobs[rel] = tensors
        workload = Workload(axes={k: v for k, v in made.axes.items() if k in variables}, uuid=made.uuid,
                            inputs=workload_inputs(found.definition, tensors, f"./{rel}"))
        item = _Item(relative=f"workloads/{op}/{name}.jsonl", source=None)
    out.workloads.setdefault(name, {})[workload.uuid] = (workload, item)
    if name not in out.definitions:
        rel_def = found.file if found.root is not None and found.file else f"definitions/{op}/{name}.json"
        out.definitions[name] = (found.definition, _Item(relative=rel_def, source=found.root))
    return workload


def _solution(record: Record, found: Target, out: _Out) -> str:
    """The name of the Solution that stands for the record's implementation (gathered in `out`)."""
    info = _info(record)
    definition = found.definition
    if record.impl == REFERENCE:
        made = reference_solution(definition)
        out.solutions.setdefault(made.name, (made, _Item(relative=f"solutions/sparse-attention-bench/"
                                                              f"{definition.op_type}/{definition.name}/"
                                                              f"{made.name}.json", source=None)))
        return made.name
    candidates: list[tuple[Path, Path | None]] = []
    if info is not None and info.solution_file:
        path = Path(info.solution_file)
        under = found.root is not None and path.resolve().is_relative_to(found.root.resolve())
        candidates = [(path, found.root if under else None)]
    elif found.root is not None:
        candidates = [(found.root / s.file, found.root) for s in _dataset(found.root).solutions
                      if impl_name(s.solution.name) == record.impl and s.solution.definition == definition.name]
    for path, root in candidates:
        if path.is_file():
            theirs = Solution.model_validate(json.loads(path.read_text(encoding="utf-8")))
            author = re.sub(r"[^A-Za-z0-9._-]+", "_", theirs.author)
            rel = str(path.relative_to(root)) if root is not None else \
                f"solutions/{author}/{definition.op_type}/{definition.name}/{path.name}"
            out.solutions.setdefault(theirs.name, (theirs, _Item(relative=rel, source=root)))
            return theirs.name
    made = our_solution(record.impl, definition)
    out.solutions.setdefault(made.name, (made, _Item(relative=f"solutions/sparse-attention-bench/{definition.op_type}/"
                                                          f"{definition.name}/{made.name}.json", source=None)))
    return made.name


def gather(run: Run, reference: str) -> tuple[_Out, list[LeftOut]]:
    out, left_out = _Out(), []
    reference_ms = _reference_ms(run, reference)
    for record in run.records:
        case = case_of(record)
        found = case if isinstance(case, str) else target(case)
        evaluated = None if isinstance(found, str) else evaluation(record, run, reference, reference_ms)
        if isinstance(found, str) or evaluated is None:
            reason = found if isinstance(found, str) else f"skipped: {record.reason}"
            left_out.append(LeftOut(case_id=record.case_id, impl=record.impl, reason=reason))
            continue
        assert not isinstance(case, str)
        workload = _workload(case, found, out)
        if isinstance(workload, str):
            left_out.append(LeftOut(case_id=record.case_id, impl=record.impl, reason=workload))
            continue
        out.traces[found.definition.name].append(Trace(definition=found.definition.name, workload=workload,
                                                       solution=_solution(record, found, out), evaluation=evaluated))
    return out, left_out


def _same(a: Path, b: Path) -> bool:
    return a.exists() and b.exists() and a.resolve() == b.resolve()


def _write(root: Path, out: _Out) -> None:
    """Everything gathered, under root; what came from root itself is left as it is."""
    def dump(path: Path, text: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")

    for definition, item in out.definitions.values():
        if item.source is None or not _same(item.source, root):
            dump(root / item.relative, definition.model_dump_json(indent=2, exclude_unset=True) + "\n")
    lines: dict[str, list[str]] = defaultdict(list)
    for name, by_uuid in out.workloads.items():
        for workload, item in by_uuid.values():
            if item.source is None or not _same(item.source, root):
                lines[item.relative].append(Trace(definition=name, workload=workload).model_dump_json())
    for rel, text in lines.items():
        dump(root / rel, "\n".join(text) + "\n")
    for rel, blob in out.blobs.items():
        target_path = root / rel
        target_path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(blob, Path):
            if not _same(blob, target_path):
                shutil.copyfile(blob, target_path)
        else:
            save_file({k: v.contiguous() for k, v in blob.items()}, str(target_path))
    for solution, item in out.solutions.values():
        if item.source is None or not _same(item.source, root):
            dump(root / item.relative, solution.model_dump_json(indent=2, exclude_unset=True) + "\n")
    for name, traces in out.traces.items():
        op = out.definitions[name][0].op_type
        path = root / "traces" / op / f"{name}.jsonl"
        ours = {(t.workload.uuid, t.solution) for t in traces}
        kept = [line for line in _lines(path) if _trace_key(line) not in ours]  # what others wrote stays
        dump(path, "\n".join([*kept, *(t.model_dump_json() for t in traces)]) + "\n")


def _lines(path: Path) -> list[str]:
    return [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()] if path.is_file() else []


def _trace_key(line: str) -> tuple[str, str] | None:
    """(workload uuid, solution) of a trace line; None for a line that is not a trace we can read (kept as it is)."""
    try:
        data = json.loads(line)
        return str(data["workload"]["uuid"]), str(data.get("solution"))
    except (ValueError, KeyError, TypeError):
        return None


def export_flashinfer(run_dir: Path, root: Path, reference: str = REFERENCE) -> ExportSummary:
    """Write the run's traces (and what they name) under `root` (module docstring)."""
    run = load_run(run_dir)
    out, left_out = gather(run, reference)
    _write(root, out)
    return ExportSummary(root=str(root), traces=sum(len(t) for t in out.traces.values()),
                         definitions=sorted(out.definitions), solutions=sorted(out.solutions), left_out=left_out)
