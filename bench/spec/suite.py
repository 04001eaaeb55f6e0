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
from bench.patterns import PATTERNS, PatternError
from bench.patterns.score_mods import case_problems as score_mod_problems
from bench.plugins import load_plugin
from bench.selection import allowed_units, get_selector, selector_names
from bench.spec.case import Case

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
    # random | structured | {kind: structured, <knob>: value} | {file: PATH, layer: L}: checked by bench.inputs
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
    # the attention statistics of each case's inputs (bench.measure.attention_stats) in its records
    attention_stats: StrictBool = False
    wait_for_quiet_s: Annotated[StrictFloat, Field(ge=0, le=3600)] = 0.0  # for a quiet CPU before each pair


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
            case = Case(**values)
            _check_case(case, origin, file)
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
            resolved[key] = input_files.resolve(spec, base_dir) if spec.kind == "file" else spec
        except InputsError as exc:
            raise BadInput(exc.message, file=file, field=f"{where}.{exc.field}" if exc.field else where) from None
    return resolved[key]


def _check_selection(case: Case, where: Any, bad: Any) -> None:
    """A selection case: a known selector, the amount it takes, a budget the base pattern can give."""
    if case.selector is None:
        name = "budget" if case.budget is not None else "threshold"
        raise bad(f"got {name} with no selector; {name} is what a selector keeps: set `selector` too "
                  f"(known: {', '.join(selector_names())})", name)
    try:
        info = get_selector(case.selector)
    except KeyError as exc:
        raise bad(f"got {case.selector!r}; {exc.args[0].split('; ')[-1]}", "selector") from None
    if info.takes == "budget" and case.budget is None:
        raise bad(f"selector {info.name} keeps a budget of {info.kv_unit}s per query {info.q_unit}: set `budget` "
                  "(a count, or a fraction in (0, 1] of the units the base pattern allows)", "budget")
    if info.takes == "threshold" and case.threshold is None:
        raise bad(f"selector {info.name} keeps the units reaching a share of the attention mass: set `threshold` "
                  "in (0, 1]", "threshold")
    if isinstance(case.budget, int) and not isinstance(case.budget, bool):
        allowed = allowed_units(case.make_pattern(), info.q_unit_size(case), info.kv_unit_size(case))
        most = int(allowed.sum(dim=-1).max()) if allowed.numel() else 0
        if case.budget > most:
            raise bad(f"got {case.budget}; the base pattern {case.pattern_label()} allows at most {most} "
                      f"{info.kv_unit}s of {info.kv_unit_size(case)} keys per query {info.q_unit} (seq_len "
                      f"{case.seq_len}): allowed budget 1..{most}, or a fraction in (0, 1]", "budget")


def _check_paging(case: Case, bad: Any) -> None:
    """A paged KV cache: pages of a power-of-two size aligned with the blocks, for inference; lengths per
    sequence that the batch and the queries allow."""
    size = case.page_size
    if size is None:
        raise bad("got kv_lens with no page_size; sequences of their own lengths share a paged pool: set "
                  "page_size (a power of two, e.g. 16 as vLLM and FlashInfer use)", "kv_lens")
    if size & (size - 1):
        allowed = [2**i for i in range(0, 13)]
        raise bad(f"got {size}; a page holds a power of two of tokens: allowed {allowed}", "page_size")
    if case.block_size % size and size % case.block_size:
        raise bad(f"got {size} with block_size {case.block_size}; pages and blocks must align (one divides the "
                  f"other): allowed page_size {[2**i for i in range(13) if case.block_size % 2**i == 0]} or a "
                  f"multiple of {case.block_size}", "page_size")
    if case.mode != "fwd":
        raise bad(f"got page_size with mode {case.mode!r}; a paged KV cache is read in inference (decode): "
                  "allowed mode fwd", "page_size")
    if isinstance(case.kv_lens, tuple):
        if len(case.kv_lens) != case.batch:
            raise bad(f"got {len(case.kv_lens)} lengths for batch {case.batch}; kv_lens lists one length per "
                      "sequence", "kv_lens")
        for length in case.kv_lens:
            if not case.n_queries <= length <= case.seq_len:
                raise bad(f"got {length}; each length must be between q_len {case.n_queries} and seq_len "
                          f"{case.seq_len} (a sequence's queries are its last q_len positions)", "kv_lens")


def _check_case(case: Case, origin: dict[str, str], file: str) -> None:
    """Constraints between fields of one case: pattern name, shapes, and what the pattern needs of its fields."""
    where = lambda name: origin.get(name, name)  # noqa: E731 - unset fields are named as themselves

    def bad(message: str, name: str) -> BadInput:
        if name not in origin and name != "pattern":
            message += f"; set defaults.{name} or sweep it"
        return BadInput(message, file=file, field=where(name))

    if case.pattern not in PATTERNS:
        raise BadInput(f"got {case.pattern!r}; known patterns: {', '.join(sorted(PATTERNS))}",
                       file=file, field=where("pattern"))
    if case.checkpoint and case.mode != "fwd_bwd":
        raise BadInput(f"got checkpoint: true with mode {case.mode!r}; checkpointing recomputes attention in "
                       "backward, so it needs mode fwd_bwd", file=file, field=where("checkpoint"))
    if case.kv_heads is not None and case.heads % case.kv_heads:
        divisors = [d for d in range(1, case.heads + 1) if case.heads % d == 0]
        raise bad(f"got {case.kv_heads} with heads {case.heads}; grouped-query attention needs heads % kv_heads "
                  f"== 0: allowed kv_heads {divisors}", "kv_heads")
    if case.cp_layout != "contiguous" and case.world_size < 2:
        raise bad(f"got cp_layout {case.cp_layout!r} with world_size {case.world_size}; a layout places sequence "
                  "chunks on ranks, so it needs world_size >= 2 (allowed with world_size 1: 'contiguous')",
                  "cp_layout")
    if case.ulysses_degree is not None and case.world_size % case.ulysses_degree:
        divisors = [d for d in range(1, case.world_size + 1) if case.world_size % d == 0]
        raise bad(f"got {case.ulysses_degree} with world_size {case.world_size}; Ulysses groups of ulysses_degree "
                  f"ranks must tile the ranks: allowed ulysses_degree {divisors} (or null)", "ulysses_degree")
    if case.selector is not None or case.budget is not None or case.threshold is not None:
        _check_selection(case, where, bad)
    if case.page_size is not None or case.kv_lens is not None:
        _check_paging(case, bad)
    for name, message in score_mod_problems(case):
        raise bad(message, name)
    if case.inputs.kind == "file":
        try:
            input_files.check_shapes(case.inputs, batch=case.batch, heads=case.heads, kv_heads=case.n_kv_heads,
                                     head_dim=case.head_dim, seq_len=case.seq_len, q_len=case.n_queries)
        except InputsError as exc:
            raise BadInput(exc.message, file=file, field=where("inputs")) from None
    try:
        pattern = case.make_pattern()
        if PATTERNS[case.pattern].source != "built-in":
            pattern.probe()  # a custom predicate that raises or returns no bool fails here, not mid-run
    except PatternError as exc:
        name = exc.field or "pattern"
        message = exc.message if exc.field else f"pattern {exc.pattern}: {exc.message}"
        if case.pattern not in message:
            message += f" (pattern {case.pattern})"
        raise bad(message, name) from None
