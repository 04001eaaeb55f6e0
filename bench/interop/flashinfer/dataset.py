"""Reading a FlashInfer Trace dataset: `definitions/**/*.json`, `workloads/**/*.jsonl`, `solutions/**/*.json`.

Every problem is collected, never raised, so that one bad file does not hide the rest: a definition that fails
the schema, a workload line naming an unknown definition or a missing safetensors file (or a key the file
lacks), a solution for an unknown definition. Each problem names the file (relative to the root), the field
(`axes.head_dim.value`, `line 3: workload.inputs.kv_indptr.path`) and what is wrong; `bench import` prints them
and exits 2 after importing what is sound.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from bench.errors import BadInput
from bench.interop.flashinfer.schema import Definition, SafetensorsInput, Solution, Trace


class Problem(BaseModel):
    """One thing wrong with a dataset: the file (relative to the root), the field path, the message."""

    file: str
    field: str | None = None
    message: str

    def text(self) -> str:
        return "".join(f"{part}: " for part in (self.file, self.field) if part) + self.message


class LoadedDefinition(BaseModel):
    file: str  # relative to the root
    definition: Definition


class LoadedWorkload(BaseModel):
    file: str
    line: int  # 1-based
    trace: Trace  # a workload trace: solution and evaluation null


class LoadedSolution(BaseModel):
    file: str
    solution: Solution


class Dataset(BaseModel):
    root: Path
    definitions: dict[str, LoadedDefinition]
    workloads: dict[str, list[LoadedWorkload]]  # by definition name
    solutions: list[LoadedSolution]
    problems: list[Problem]


_UNION_MEMBERS = {"AxisConst", "AxisVar", "RandomInput", "ScalarInput", "SafetensorsInput"}


def _field(loc: tuple[Any, ...], prefix: str = "") -> str | None:
    """A pydantic error location as a field path; union members' names are not fields."""
    out = prefix
    for part in loc:
        if isinstance(part, str) and (part in _UNION_MEMBERS or "[" in part or part.startswith("function")):
            continue
        out += f"[{part}]" if isinstance(part, int) else ("." if out and not out.endswith(" ") else "") + str(part)
    return out or None


def _schema_problems(file: str, exc: ValidationError, prefix: str = "") -> list[Problem]:
    """The first error of each field (a union's alternatives would repeat one mistake)."""
    seen: dict[str | None, Problem] = {}
    for err in exc.errors():
        where = _field(tuple(err["loc"]), prefix)
        if where not in seen:
            got = f"got {err['input']!r}; " if err["type"] not in ("missing", "value_error") else ""
            message = "required field is missing" if err["type"] == "missing" else got + err["msg"]
            seen[where] = Problem(file=file, field=where, message=message)
    return list(seen.values())


Model = TypeVar("Model", bound=BaseModel)


def _json_models(root: Path, folder: str, model: type[Model], problems: list[Problem]
                 ) -> Iterator[tuple[str, Model]]:
    """(file relative to root, validated model) of each JSON file under root/folder, in order; a file that is not
    readable JSON or fails the schema becomes problems instead."""
    for path in sorted((root / folder).rglob("*.json")):
        rel = str(path.relative_to(root))
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            problems.append(Problem(file=rel, message=f"not readable JSON: {exc}"))
            continue
        try:
            validated = model.model_validate(data)
        except ValidationError as exc:
            problems.extend(_schema_problems(rel, exc))
            continue
        yield rel, validated


def _definitions(root: Path, problems: list[Problem]) -> dict[str, LoadedDefinition]:
    found: dict[str, LoadedDefinition] = {}
    for rel, definition in _json_models(root, "definitions", Definition, problems):
        if definition.name in found:
            problems.append(Problem(file=rel, field="name", message=f"got {definition.name!r}; "
                                    f"{found[definition.name].file} defines it already"))
            continue
        found[definition.name] = LoadedDefinition(file=rel, definition=definition)
    return found


def _tensor_problems(root: Path, rel: str, where: str, trace: Trace) -> list[Problem]:
    """Safetensors inputs whose file is missing, or lacks the key."""
    from safetensors import safe_open

    out: list[Problem] = []
    for name, spec in trace.workload.inputs.items():
        if not isinstance(spec, SafetensorsInput):
            continue
        path = root / spec.path
        field = f"{where}workload.inputs.{name}.path"
        if not path.is_file():
            out.append(Problem(file=rel, field=field, message=f"got {spec.path!r}; no such file under {root}"))
            continue
        try:
            with safe_open(str(path), framework="pt") as handle:
                keys = set(handle.keys())
        except Exception as exc:  # safetensors raises its own types for a file that is not one
            out.append(Problem(file=rel, field=field, message=f"{spec.path} is not a safetensors file: {exc}"))
            continue
        if spec.tensor_key not in keys:
            out.append(Problem(file=rel, field=f"{where}workload.inputs.{name}.tensor_key",
                               message=f"got {spec.tensor_key!r}; {spec.path} holds {sorted(keys)}"))
    return out


def _workloads(root: Path, definitions: dict[str, LoadedDefinition], problems: list[Problem]
               ) -> dict[str, list[LoadedWorkload]]:
    found: dict[str, list[LoadedWorkload]] = {}
    known = ", ".join(sorted(definitions)) or "none"
    for path in sorted((root / "workloads").rglob("*.jsonl")):
        rel = str(path.relative_to(root))
        for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if not text.strip():
                continue
            where = f"line {number}: "
            try:
                trace = Trace.model_validate_json(text)
            except ValidationError as exc:
                problems.extend(_schema_problems(rel, exc, where))
                continue
            if trace.definition not in definitions:
                problems.append(Problem(file=rel, field=f"{where}definition", message=f"got {trace.definition!r}; "
                                        f"no such definition under definitions/ (known: {known})"))
                continue
            tensor_problems = _tensor_problems(root, rel, where, trace)
            problems.extend(tensor_problems)
            if not tensor_problems:
                found.setdefault(trace.definition, []).append(LoadedWorkload(file=rel, line=number, trace=trace))
    return found


def _solutions(root: Path, definitions: dict[str, LoadedDefinition], problems: list[Problem]
               ) -> list[LoadedSolution]:
    found: list[LoadedSolution] = []
    names: dict[str, str] = {}
    for rel, solution in _json_models(root, "solutions", Solution, problems):
        if solution.definition not in definitions:
            problems.append(Problem(file=rel, field="definition", message=f"got {solution.definition!r}; no such "
                                    "definition under definitions/"))
        elif solution.name in names:
            problems.append(Problem(file=rel, field="name", message=f"got {solution.name!r}; {names[solution.name]} "
                                    "has that name already"))
        else:
            names[solution.name] = rel
            found.append(LoadedSolution(file=rel, solution=solution))
    return found


def read_dataset(root: Path) -> Dataset:
    """Everything sound in the dataset at `root`, and every problem. Raises BadInput only for a root that is no
    dataset at all."""
    if not root.is_dir():
        raise BadInput("no such directory (a FlashInfer Trace dataset's root)", file=str(root))
    if not (root / "definitions").is_dir():
        raise BadInput("no definitions/ directory here; a FlashInfer Trace dataset holds definitions/, "
                       "workloads/ and solutions/", file=str(root))
    problems: list[Problem] = []
    definitions = _definitions(root, problems)
    workloads = _workloads(root, definitions, problems)
    solutions = _solutions(root, definitions, problems)
    return Dataset(root=root.resolve(), definitions=definitions, workloads=workloads, solutions=solutions,
                   problems=problems)


_DEFINITIONS: dict[str, dict[str, LoadedDefinition]] = {}


def definitions_of(root: Path) -> dict[str, LoadedDefinition]:
    """The sound definitions under `root` (read once per process): what implementations look up by name."""
    key = str(root.resolve())
    if key not in _DEFINITIONS:
        _DEFINITIONS[key] = _definitions(root, [])
    return _DEFINITIONS[key]
