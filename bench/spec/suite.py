"""Suite files: YAML (safe load only) -> validated `Suite` -> the list of cases to measure.

Everything is checked before any work starts: types, ranges, unknown keys, implementation and pattern names,
plugins, and the per-case constraints of each pattern (axial needs seq_len = R*C, ...). Every problem is a
`BadInput` naming the file, the field path (`sweep.seq_len[2]`), the value given and what is allowed.
"""

from __future__ import annotations

import difflib
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    create_model,
)

from bench.errors import BadInput
from bench.inputs import InputsError, InputsSpec
from bench.inputs import files as input_files
from bench.inputs import flashinfer as workload_inputs
from bench.spec.case import Case
from bench.spec.case_checks import check_case
from bench.spec.model_fields import model_fields
from bench.spec.plugins import load_plugin

NAME_RE = r"^[a-z0-9_-]+$"

# One spec per case field: its annotation for validation. Ranges here; pattern constraints come from the
# pattern classes themselves (bench.patterns), so they are written once.
_Pos = Annotated[StrictInt, Field(ge=1)]
CASE_FIELD_TYPES: dict[str, Any] = {
    "batch": _Pos,
    "heads": _Pos,
    "head_dim": Annotated[StrictInt, Field(ge=1, le=1024)],
    "seq_len": Annotated[StrictInt, Field(ge=1, le=4_194_304)],
    "dtype": Literal["float32", "float16", "bfloat16"],
    "pattern": StrictStr,
    "window": _Pos,
    "density": Annotated[StrictFloat, Field(ge=0.0, le=1.0)] | None,
    "block_size": Annotated[StrictInt, Field(ge=1, le=4096)],
    "dilation": _Pos,
    "global_tokens": Annotated[StrictInt, Field(ge=0)],
    "seed": Annotated[StrictInt, Field(ge=0, le=2**31 - 1)],
    "mode": Literal["fwd", "fwd_bwd"],
    "checkpoint": StrictBool,
    "world_size": Annotated[StrictInt, Field(ge=1, le=1024)],
    "device": Literal["auto", "cpu", "cuda"],
    "kv_heads": _Pos | None,
    "q_len": Annotated[StrictInt, Field(ge=1, le=4_194_304)] | None,
    "documents": _Pos | Annotated[list[_Pos], Field(min_length=1)] | None,
    "prefix": Annotated[StrictInt, Field(ge=0)],
    "image_width": _Pos | None,
    "cp_layout": Literal["contiguous", "zigzag"],
    "ulysses_degree": _Pos | None,
    # random | structured | {kind: structured, <knob>: value} | {file: PATH, layer: L} | {kind: flashinfer, root:
    # DIR, definition: NAME, workload: UUID}: checked by bench.inputs
    "inputs": StrictStr | dict[str, Any],
    "selector": StrictStr | None,
    # a count of key units per query unit, or a fraction of the units the base pattern allows
    "budget": _Pos | Annotated[StrictFloat, Field(gt=0.0, le=1.0)] | None,
    "threshold": Annotated[StrictFloat, Field(gt=0.0, le=1.0)] | None,
    "page_size": _Pos | None,
    # keys per sequence of a paged cache: B lengths, or `random` (drawn from the seed in [q_len, seq_len])
    "kv_lens": Literal["random"] | Annotated[list[_Pos], Field(min_length=1)] | None,
    # none | softcap | alibi | relative_bias | a registered name, and the cap (> 0) of softcap: checked below
    "score_mod": StrictStr,
    "softcap": StrictFloat | StrictInt | None,
    # a built-in model or a model directory, its task, samples, layers and a training run: bench.models.spec
    "model": StrictStr | None,
    "task": StrictStr | dict[str, Any] | None,
    "samples": _Pos,
    "layers": Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)] | None,
    "train": dict[str, Any] | None,
    # learned sinks: `learned`, or one finite logit per query head (length checked against heads)
    "sinks": Literal["learned"] | Annotated[list[StrictFloat | StrictInt], Field(min_length=1)] | None,
}
assert set(CASE_FIELD_TYPES) == set(Case.field_names()), "suite schema out of step with Case"

_FORBID = ConfigDict(extra="forbid")

_optional: dict[str, Any] = {k: (t | None, None) for k, t in CASE_FIELD_TYPES.items()}
_axes: dict[str, Any] = {k: (Annotated[list[t], Field(min_length=1)] | None, None)  # type: ignore[valid-type]
                         for k, t in CASE_FIELD_TYPES.items()}
# every case field, each optional; and every case field as a sweep axis: a non-empty list of its values
CaseDefaults: Any = create_model("CaseDefaults", __config__=_FORBID, **_optional)
SweepAxes: Any = create_model("SweepAxes", __config__=_FORBID, **_axes)


class Measure(BaseModel):
    model_config = _FORBID
    warmup: Annotated[StrictInt, Field(ge=0, le=10_000)] = 2
    repeat: Annotated[StrictInt, Field(ge=1, le=100_000)] = 10
    max_time_s: Annotated[StrictFloat, Field(gt=0, le=86_400)] = 2.0
    timeout_s: Annotated[StrictFloat, Field(gt=0, le=604_800)] = 300.0
    check: StrictBool = True
    calibrate: StrictBool = False  # measure this machine's matmul rates at the start of the run (bench.run.calibration)
    # CPU memory: in a fresh process per pair (no earlier case moves it; costs the pair's setup again), or in the
    # worker after its timing (cheap; the figure may move with what earlier cases left on the heap)
    memory: Literal["fresh", "worker"] = "fresh"
    # the attention statistics of each case's inputs (bench.measure.oracle.attention_stats) in its records
    attention_stats: StrictBool = False
    wait_for_quiet_s: Annotated[StrictFloat, Field(ge=0, le=3600)] = 0.0  # for a quiet CPU before each pair
    # report each tensor's error against a same-dtype reference (bench.measure.oracle.numerics); strict: a ratio above 2
    # makes the record incorrect
    numerics: Literal["report", "strict"] = "report"
    # cold: the caches evicted before every timed call (bench.measure.cold); warm is a choice the records state
    cache: Literal["cold", "warm"] = "cold"
    # the timed calls' inputs refreshed in place from seeded sets between calls; false: the same values every call
    rotate: StrictBool = True


class SweepBlock(BaseModel):
    model_config = _FORBID
    defaults: CaseDefaults = Field(default_factory=CaseDefaults)
    sweep: SweepAxes = Field(default_factory=SweepAxes)


class SuiteModel(BaseModel):
    model_config = _FORBID
    name: Annotated[StrictStr, Field(pattern=NAME_RE, max_length=100)]
    description: StrictStr = ""
    impls: Annotated[list[StrictStr], Field(min_length=1)]
    defaults: CaseDefaults = Field(default_factory=CaseDefaults)
    sweep: SweepAxes | None = None
    sweeps: Annotated[list[SweepBlock], Field(min_length=1)] | None = None
    measure: Measure = Field(default_factory=Measure)
    plugins: list[StrictStr] = Field(default_factory=list)


_KEYS_AT = {  # allowed keys by the name of the enclosing field, for "unknown key" messages
    "": list(SuiteModel.model_fields),
    "measure": list(Measure.model_fields),
    "defaults": list(Case.field_names()),
    "sweep": list(Case.field_names()),
    "sweeps": list(SweepBlock.model_fields),
}


@dataclass(frozen=True)
class Suite:
    name: str
    description: str
    impls: list[str]
    measure: Measure
    plugins: list[str]  # as written in the file
    cases: list[Case]
    content: dict[str, Any]  # the full parsed content, stored in run.json
    path: Path | None = None
    origins: list[dict[str, str]] = field(default_factory=list)  # per case: field -> where its value came from


def field_path(loc: tuple[Any, ...]) -> str:
    """('sweep', 'seq_len', 2) -> 'sweep.seq_len[2]'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _explain(err: Any) -> tuple[str, str]:
    """A pydantic error -> (field path, 'got X; what is allowed')."""
    # Union members ("constrained-int", "list[constrained-int]") and validator names are not field names.
    loc = tuple(p for p in err["loc"]
                if not (isinstance(p, str) and ("[" in p or "-" in p or p.startswith("function"))))
    path = field_path(loc)
    kind = err["type"]
    if kind == "extra_forbidden":
        # the unknown key itself is the last element as given, even where it looks like a union member's name
        loc = (*loc[:-1], err["loc"][-1]) if loc and loc[-1] == err["loc"][-1] else (*loc, err["loc"][-1])
        path = field_path(loc)
        parent = next((p for p in reversed(loc[:-1]) if isinstance(p, str)), "")
        allowed = _KEYS_AT.get(parent, [])
        close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        return path, f"unknown key; {hint}allowed keys here: {', '.join(allowed)}"
    if kind == "missing":
        return path, "required field is missing"
    msg = err["msg"]
    msg = msg.replace("Input should be", "allowed:").replace("String should match pattern", "must match")
    if kind == "too_short":
        msg = "must not be empty"
    return path, f"got {_show(err.get('input'))}; {msg}"


def load_suite(path: str | Path, known_impls: list[str] | None = None) -> Suite:
    """Read, validate and expand a suite file. Imports its plugins. Raises BadInput."""
    path = Path(path)
    if not path.is_file():
        raise BadInput("no such suite file", file=str(path))
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInput(f"cannot read: {exc}", file=str(path)) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "(somewhere)"
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise BadInput(f"malformed YAML at {where}: {problem}", file=str(path)) from None
    return parse_suite(data, file=str(path), base_dir=path.parent, known_impls=known_impls)


def parse_suite(data: Any, *, file: str = "<suite>", base_dir: Path | None = None,
                known_impls: list[str] | None = None) -> Suite:
    """Validate parsed YAML content and expand it into cases."""
    if not isinstance(data, dict):
        raise BadInput(f"got {type(data).__name__}; a suite is a mapping with at least `name` and `impls`",
                       file=file, field="(top level)")
    try:
        model = SuiteModel.model_validate(data)
    except ValidationError as exc:
        errors = [_explain(e) for e in exc.errors()]
        # Of a union's alternatives, keep the one that got furthest: `documents[1]: got 0` over
        # `documents: not an integer` for a list of lengths with a zero in it.
        errors = [(path, msg) for path, msg in errors
                  if not any(other.startswith((path + "[", path + ".")) for other, _ in errors)] or errors
        first_path, first_msg = errors[0]
        more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
        raise BadInput(first_msg + more, file=file, field=first_path) from None
    if model.sweep is not None and model.sweeps is not None:
        raise BadInput("use either `sweep` or `sweeps`, not both", file=file, field="sweeps")

    plugins = list(model.plugins)
    for index, spec in enumerate(plugins):
        load_plugin(spec, base_dir=base_dir, file=file, field=f"plugins[{index}]")

    if known_impls is None:
        from bench import registry

        known_impls = registry.names()
    for index, name in enumerate(model.impls):
        if name not in known_impls:
            raise BadInput(f"got {name!r}; known implementations: {', '.join(sorted(known_impls))}",
                           file=file, field=f"impls[{index}]")
    if len(set(model.impls)) != len(model.impls):
        raise BadInput(f"got {model.impls}; each implementation may appear once", file=file, field="impls")

    cases, origins = _expand(model, file, base_dir if base_dir is not None else Path.cwd())
    content = model.model_dump(mode="json", exclude_none=True)
    return Suite(model.name, model.description, list(model.impls), model.measure, plugins, cases,
                 content, Path(file) if base_dir is not None else None, origins)


def _expand(model: SuiteModel, file: str, base_dir: Path) -> tuple[list[Case], list[dict[str, str]]]:
    """Cartesian product of each sweep block over its defaults; duplicates (same params) dropped."""
    resolved: dict[str, InputsSpec] = {}  # each distinct `inputs` value parsed (and its file hashed) once
    top = {k: v for k, v in model.defaults.model_dump().items() if v is not None}
    blocks: list[tuple[str, dict[str, Any], dict[str, list[Any]]]] = []
    if model.sweeps is not None:
        for b, block in enumerate(model.sweeps):
            block_defaults = {k: v for k, v in block.defaults.model_dump().items() if v is not None}
            axes = {k: v for k, v in block.sweep.model_dump().items() if v is not None}
            blocks.append((f"sweeps[{b}].", block_defaults, axes))
    else:
        axes = {} if model.sweep is None else {k: v for k, v in model.sweep.model_dump().items() if v is not None}
        blocks.append(("", {}, axes))
    # keep the axis order as written in the file
    cases: list[Case] = []
    origins: list[dict[str, str]] = []
    seen: set[str] = set()
    for prefix, block_defaults, axes in blocks:
        names = list(axes)
        for combo in itertools.product(*(list(enumerate(axes[n])) for n in names)):
            values = {**top, **block_defaults}
            origin = {k: f"defaults.{k}" for k in top}
            origin.update({k: f"{prefix}defaults.{k}" for k in block_defaults})
            for name, (index, value) in zip(names, combo, strict=True):
                values[name] = value
                origin[name] = f"{prefix}sweep.{name}[{index}]"
            if "inputs" in values:
                values["inputs"] = _inputs_spec(values["inputs"], origin["inputs"], file, base_dir, resolved)
            if any(k in values for k in ("model", "task", "train")):
                values = model_fields(values, origin, file, base_dir)
            case = Case(**values)
            check_case(case, origin, file)
            if case.case_id in seen:
                continue
            seen.add(case.case_id)
            cases.append(case)
            origins.append(origin)
    return cases, origins


def _inputs_spec(value: Any, where: str, file: str, base_dir: Path, resolved: dict[str, InputsSpec]
                 ) -> InputsSpec:
    """A case's `inputs` as written, parsed and (a file) resolved against the suite's directory and hashed."""
    key = repr(value)
    if key not in resolved:
        try:
            spec = InputsSpec.parse(value)
            if spec.kind == "file":
                spec = input_files.resolve(spec, base_dir)
            elif spec.kind == "flashinfer":
                spec = workload_inputs.resolve(spec, base_dir)
            resolved[key] = spec
        except InputsError as exc:
            raise BadInput(exc.message, file=file, field=f"{where}.{exc.field}" if exc.field else where) from None
    return resolved[key]
