"""Runs into tidy rows: one `Row` per record, with its run's provenance, ready to be grouped into figures.

Every figure of a suite page is built from rows, never from the raw models, so the unit tests can check the
data of each figure from synthetic runs. Raw timing samples stay out of rows (the pages keep medians and
intervals, not samples); `bench.analysis.history` reads samples from the runs itself.

Grouping:
- a *facet* is one (pattern, dtype, mode, device, workload): the unit the page's filters select. `device` is the
  record's device string ("cpu: AMD EPYC 7B13", "cuda:0 NVIDIA H200", or the modelled card), so a model of
  an H100 never shares a facet with a measurement on this CPU. `workload` is the attention shape and the query
  rows (`workload()`: "MHA H8", "GQA H32/8 · q_len 1"), so decode never shares a figure with prefill.
- within a facet, `varying_keys` are the parameters that take more than one value; a series label names
  exactly those, e.g. `w=16, B=2`, as STYLE.md's series labels do.
- the time and memory views put `x_key()` on x: seq_len, or where only another count varies (documents, q_len,
  window, ...), that one.
- records written before a case field existed lack its key: it means the field's default (`LATER_DEFAULTS`).
- `current_rows` keeps, for each (suite, environment fingerprint, source, device, case, impl), the record of
  the latest run: the state the suite pages show. Older runs appear in the history view.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.inputs import InputsSpec
from bench.results.index import record_device, run_commit, run_fingerprint
from bench.results.records import (
    AttentionStats,
    ErrorInfo,
    FidelityInfo,
    QualityInfo,
    RankComm,
    Record,
    SelectionInfo,
    TrainingInfo,
)
from bench.results.store import Run
from bench.spec.case import LATER_FIELDS

FACET_KEYS = ("pattern", "dtype", "mode", "device", "workload")
Facet = tuple[str, str, str, str, str]  # the values of FACET_KEYS
# Parameters that never make two series differ on their own (device is a facet key; the record's own
# device string is used instead of the requested auto|cpu|cuda).
_NOT_SERIES_KEYS = frozenset(FACET_KEYS)
# Short names for series labels (as the pattern labels `local_w64`, `block_random_p0.1_b64`).
SHORT_NAMES = {"seq_len": "N", "window": "w", "density": "p", "block_size": "bs", "dilation": "d",
               "global_tokens": "g", "seed": "seed", "batch": "B", "heads": "H", "head_dim": "D",
               "world_size": "P", "checkpoint": "ckpt", "env": "env", "kv_heads": "Hkv", "q_len": "q",
               "documents": "docs", "prefix": "pre", "image_width": "iw", "cp_layout": "layout",
               "ulysses_degree": "U", "inputs": "in"}
# Case fields added after the first records were written (bench.spec.case.LATER_FIELDS): a record without the
# key has the default. kv_heads and q_len written out as heads and seq_len mean the default too.
LATER_DEFAULTS: dict[str, Any] = LATER_FIELDS
_DEFAULT_FROM = {"kv_heads": "heads", "q_len": "seq_len"}  # None means the value of this other field
# What the time and memory views may put on x, in order of preference: seq_len whenever it varies, else the
# first of the others that does (a documents sweep at one length draws time against the number of documents).
X_KEYS = ("seq_len", "documents", "q_len", "prefix", "window", "image_width", "kv_heads")
BASELINES = ("dense", "sdpa")  # what sparse implementations are compared against, in order of preference


@dataclass(frozen=True)
class Row:
    """One record with its run's provenance. Times in seconds, memory and communication in bytes."""

    suite: str
    run_id: str
    started_at: str
    commit: str | None
    dirty: bool
    fingerprint: str
    backend: str  # the run's device kind (env.backend): cpu | cuda | ...; "model" for a modelled record
    case_id: str
    impl: str
    params: dict[str, Any]
    status: str
    reason: str | None
    source: str  # measured | modelled
    device: str
    interpreter: bool  # a Triton kernel run through the CPU interpreter: not kernel speed
    busy: str | None = None  # timed on a busy machine: the record's contention reason
    above_roof: str | None = None  # a figure past a roof: the record's peak.above_roof_reason
    fallback: str | None = None  # a slower path measured under the implementation's name: config.fallback's reason
    median_s: float | None = None
    ci95_s: tuple[float, float] | None = None
    samples: int = 0
    peak_bytes: int | None = None
    memory_method: str | None = None
    comm_backend: str | None = None
    comm_bytes_total: int | None = None
    comm_bytes_max_rank: int | None = None
    comm_expected_bytes: int | None = None
    comm_by_op: dict[str, int] = field(default_factory=dict)  # op -> bytes_total
    comm_by_level: dict[str, tuple[int, int | None]] = field(default_factory=dict)  # level -> (bytes, closed form)
    comm_imbalance: float | None = None  # max / mean of the ranks' useful FLOPs
    comm_overlap: float | None = None  # measured overlap fraction (hidden / communication time)
    comm_per_rank: tuple[RankComm, ...] = ()  # {rank, bytes, flops, comm_s, hidden_s, compute_s}
    comm_by_link: tuple[int, int] | None = None  # (intra_node, inter_node) bytes, counted
    comm_expected_by_link: tuple[int, int] | None = None  # the same split of the closed form
    comm_ranks_per_node: tuple[int, ...] = ()  # per node
    rel_l2: float | None = None
    max_abs: float | None = None
    tolerance: float | None = None
    rows_checked: int | None = None
    flops: float | None = None
    flops_per_s: float | None = None
    peak_fraction: float | None = None
    peak_flops: float | None = None
    peak_source: str | None = None
    peak_hardware: str | None = None
    bytes_moved: int | None = None  # the least bytes the call must move
    peak_bandwidth: float | None = None  # bytes/s: the memory roof
    peak_bandwidth_source: str | None = None
    peak_bound: str | None = None  # memory | compute: which roof binds
    attention_stats: AttentionStats | None = None  # bench.measure.oracle.attention_stats of the case's inputs
    selection: SelectionInfo | None = None  # a selection case's selector, units and three times
    fidelity: FidelityInfo | None = None  # a selection case's closeness to dense attention
    error: ErrorInfo | None = None  # the whole check: ratios to the same-dtype reference, gradients
    quality: QualityInfo | None = None  # a model case: the model's quality with this attention
    training: TrainingInfo | None = None  # a model case with train: both loss curves
    wall_s: float | None = None  # the whole (case, impl), every phase
    phases_s: dict[str, float] = field(default_factory=dict)  # wall_s by harness phase (records since R4)

    @property
    def modelled(self) -> bool:
        return self.source == "modelled"

    @property
    def measured_ok(self) -> bool:
        return self.status == "ok" and self.median_s is not None

    @property
    def out_of_memory(self) -> bool:
        return self.status != "ok" and "out of memory" in (self.reason or "").lower()

    @property
    def short_commit(self) -> str:
        return (self.commit or "no-git")[:7]

    def param(self, key: str) -> Any:
        """A parameter by name, missing later fields as their default and kv_heads = heads, q_len = seq_len as
        None (one value for the default, however it was written); `env` is the environment fingerprint (short),
        so it can label series."""
        if key == "env":
            return self.fingerprint[:8]
        value = self.params.get(key, LATER_DEFAULTS.get(key))
        same_as = _DEFAULT_FROM.get(key)
        if same_as is not None and value is not None and value == self.params.get(same_as):
            return None
        return value

    @property
    def workload(self) -> str:
        return workload(self.params)

    def facet(self) -> Facet:
        return (str(self.params.get("pattern")), str(self.params.get("dtype")), str(self.params.get("mode")),
                self.device, self.workload)


def _count(value: Any) -> int | None:
    """An integer parameter (not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def workload(params: dict[str, Any]) -> str:
    """The attention shape and the query rows of a case: `MHA H8`, `GQA H32/8`, `MQA H8/1`, and ` · q_len 16`
    when fewer query rows than keys (decode, chunked prefill). Missing kv_heads and q_len are the defaults."""
    heads, kv_heads = params.get("heads"), params.get("kv_heads")
    h, kv = _count(heads), _count(kv_heads)
    if h is None:
        shape = f"H{'?' if heads is None else format_value(heads)}"
    elif kv_heads is None or kv == h:
        shape = f"MHA H{h}"
    elif kv is not None and 0 < kv < h:
        shape = f"{'MQA' if kv == 1 else 'GQA'} H{h}/{kv}"
    else:  # not a valid grouping (the suite loader refuses it): shown as given
        shape = f"H{h}/{format_value(kv_heads)}"
    q, n = _count(params.get("q_len")), _count(params.get("seq_len"))
    if q is not None and (n is None or q < n):
        shape += f" · q_len {q}"
    return shape


def row_from_record(run: Run, record: Record) -> Row:
    info = run.info

    modelled = record.source == "modelled" or info.source == "modelled"
    time_s, comm, error, peak = record.time_s, record.comm, record.error, record.peak
    ci = None
    if time_s is not None and time_s.ci95 is not None and len(time_s.ci95) == 2:
        ci = (float(time_s.ci95[0]), float(time_s.ci95[1]))
    return Row(
        suite=info.suite.name, run_id=info.run_id, started_at=info.started_at, commit=run_commit(run),
        dirty=bool(info.env.git.dirty), fingerprint=run_fingerprint(run),
        backend="model" if modelled else str(info.env.backend or "?"),
        case_id=record.case_id, impl=record.impl, params=dict(record.params), status=record.status,
        reason=record.reason, source="modelled" if modelled else "measured", device=record_device(record, run),
        interpreter=record.interpreter,
        busy=record.contention.reason if record.busy and record.contention else None,
        above_roof=record.peak.above_roof_reason if record.peak is not None and record.peak.above_roof else None,
        fallback=f"{record.fallback.path}: {record.fallback.reason}" if record.fallback else None,
        median_s=time_s.median if time_s is not None else None, ci95_s=ci, samples=time_s.n if time_s else 0,
        peak_bytes=record.memory.peak_bytes if record.memory else None,
        memory_method=record.memory.method if record.memory else None,
        comm_backend=comm.backend if comm else None, comm_bytes_total=comm.bytes_total if comm else None,
        comm_bytes_max_rank=comm.bytes_max_rank if comm else None,
        comm_expected_bytes=comm.expected_bytes if comm else None,
        comm_by_op={op: c.bytes_total for op, c in comm.by_op.items()} if comm else {},
        comm_by_level={name: (lv.bytes_total, lv.expected_bytes) for name, lv in (comm.by_level or {}).items()}
        if comm else {},
        comm_imbalance=comm.imbalance if comm else None, comm_overlap=comm.overlap_fraction if comm else None,
        comm_per_rank=tuple(comm.per_rank or ()) if comm else (),
        comm_by_link=(comm.by_link.intra_node, comm.by_link.inter_node) if comm and comm.by_link else None,
        comm_expected_by_link=(comm.expected_bytes_by_link.intra_node, comm.expected_bytes_by_link.inter_node)
        if comm and comm.expected_bytes_by_link else None,
        comm_ranks_per_node=tuple(comm.topology.ranks_per_node) if comm and comm.topology else (),
        rel_l2=error.rel_l2 if error else None, max_abs=error.max_abs if error else None,
        tolerance=error.tolerance if error else None, rows_checked=error.rows_checked if error else None,
        flops=record.flops, flops_per_s=record.flops_per_s,
        peak_fraction=peak.fraction if peak else None, peak_flops=peak.peak_flops if peak else None,
        peak_source=peak.source if peak else None, peak_hardware=peak.hardware if peak else None,
        bytes_moved=record.bytes, peak_bandwidth=peak.bandwidth if peak else None,
        peak_bandwidth_source=peak.bandwidth_source if peak else None, peak_bound=peak.bound if peak else None,
        attention_stats=record.attention_stats, selection=record.selection, fidelity=record.fidelity,
        error=record.error, quality=record.quality, training=record.training,
        wall_s=record.wall_s, phases_s=dict(record.phases_s or {}),
    )


def rows_from_runs(runs: Iterable[Run]) -> list[Row]:
    """Every record of every run, as rows, runs oldest first."""
    ordered = sorted(runs, key=lambda r: (r.info.started_at, r.info.run_id))
    return [row_from_record(run, record) for run in ordered for record in run.records]


def current_rows(rows: Iterable[Row]) -> list[Row]:
    """The latest run's record of each (suite, fingerprint, source, device, case, impl), in first-seen order."""
    latest: dict[tuple[str, ...], Row] = {}
    for row in rows:
        key = (row.suite, row.fingerprint, row.source, row.device, row.case_id, row.impl)
        kept = latest.get(key)
        if kept is None or (row.started_at, row.run_id) >= (kept.started_at, kept.run_id):
            latest[key] = row
    return list(latest.values())


def facets(rows: Iterable[Row]) -> dict[Facet, list[Row]]:
    """Rows grouped by (pattern, dtype, mode, device, workload), in first-seen order."""
    out: dict[Facet, list[Row]] = {}
    for row in rows:
        out.setdefault(row.facet(), []).append(row)
    return out


def _hashable(value: Any) -> Any:
    if isinstance(value, (list, dict)):
        return repr(value)
    return value


def varying_keys(rows: Sequence[Row], exclude: Iterable[str] = ()) -> list[str]:
    """Parameters (and `env`) taking more than one value over `rows`, minus the facet keys and `exclude`."""
    skip = _NOT_SERIES_KEYS | set(exclude)
    keys = list(dict.fromkeys(k for row in rows for k in row.params if k not in skip))
    if "env" not in skip:
        keys.append("env")
    return [k for k in keys if len({_hashable(row.param(k)) for row in rows}) > 1]


def format_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def format_documents(value: Any) -> str:
    """Packed documents, compactly: a count as given; lengths as `4x2048` when equal, `512+1536` when few, else
    the count, the range and a digest of the lengths (two different lists never print the same)."""
    if not isinstance(value, list) or not value or not all(_count(n) is not None for n in value):
        return format_value(value)
    if len(set(value)) == 1:
        return f"{len(value)}x{value[0]}"
    if len(value) <= 4:
        return "+".join(str(n) for n in value)
    digest = hashlib.sha1(repr(value).encode()).hexdigest()[:4]
    return f"{len(value)} of {min(value)}..{max(value)} #{digest}"


def format_param(key: str, value: Any) -> str:
    if key == "inputs" and isinstance(value, dict):
        return InputsSpec.parse(value).label()  # `structured*`, `capL12`: a short name, not the mapping
    if key == "task" and isinstance(value, dict):
        return next((k for k in value if k != "sha256"), "task")  # text or tokens: the file is in the hover
    if key == "train" and isinstance(value, dict):
        return f"{value.get('steps')} steps"
    return format_documents(value) if key == "documents" else format_value(value)


def params_label(row: Row, keys: Sequence[str]) -> str:
    """`w=16, N=256` for the given keys ('' for none); fields the row leaves unset (None: a dense peer's budget,
    a static pattern's selector) are left out rather than written `budget=None`. Not escaped: callers escape."""
    return ", ".join(f"{SHORT_NAMES.get(k, k)}={format_param(k, row.param(k))}" for k in keys
                     if row.param(k) is not None)


def x_value(row: Row, key: str) -> int | None:
    """The number the time and memory views put on x for `key`: documents as a count (lengths by how many, none
    as one document), q_len and kv_heads with their defaults (seq_len, heads); None where the record has none."""
    if key == "documents":
        docs = row.params.get("documents")
        if docs is None:
            return 1
        if isinstance(docs, list):
            return len(docs) or None
        return _count(docs)
    value = row.params.get(key, LATER_DEFAULTS.get(key))
    if value is None and key in _DEFAULT_FROM:
        value = row.params.get(_DEFAULT_FROM[key])
    return _count(value)


def x_key(rows: Sequence[Row]) -> str:
    """What the time and memory views of these rows put on x: seq_len when it varies, else the first of X_KEYS
    that takes several values, else seq_len (one point per series)."""
    for key in X_KEYS:
        if len({v for r in rows if (v := x_value(r, key)) is not None}) > 1:
            return key
    return X_KEYS[0]


def x_series(rows: Sequence[Row], key: str) -> dict[SeriesKey, list[Row]]:
    """Rows that have a value for x = `key`, in series sorted along x. The x parameter names no series unless
    x does not tell its values apart (two lists of as many documents): then it labels them too."""
    on_x = [r for r in rows if x_value(r, key) is not None]
    distinct = len({x_value(r, key) for r in on_x}) == len({_hashable(r.param(key)) for r in on_x})
    return {k: sorted(members, key=lambda r: x_value(r, key) or 0)
            for k, members in series_of(on_x, [key] if distinct else []).items()}


def sort_key(value: Any) -> tuple[int, float, str]:
    """Numbers in numeric order, then everything else as text (None last)."""
    if isinstance(value, bool) or value is None:
        return (2, 0.0, str(value))
    if isinstance(value, (int, float)):
        return (0, float(value), "")
    return (1, 0.0, str(value))


def param_order(row: Row, key: str) -> tuple[int, float, str]:
    """`sort_key` of a parameter, documents by their count (a list of lengths among counts)."""
    if key == "documents" and (count := x_value(row, key)) is not None:
        return (0, float(count), format_documents(row.params.get(key)))
    return sort_key(row.param(key))


@dataclass(frozen=True)
class SeriesKey:
    """What makes two points belong to different lines: implementation, provenance and the other parameters."""

    impl: str
    source: str
    interpreter: bool
    label: str  # params_label of the varying parameters besides the x axis

    def name(self) -> str:
        """The legend name (not escaped)."""
        parts = [self.impl]
        if self.label:
            parts.append(f"({self.label})")
        if self.interpreter:
            parts.append("[Triton interpreter]")
        if self.source == "modelled":
            parts.append("[model]")
        return " ".join(parts)


def series_of(rows: Sequence[Row], x_keys: Iterable[str]) -> dict[SeriesKey, list[Row]]:
    """Rows grouped into series: same impl, source, interpreter flag and values of the varying parameters."""
    keys = varying_keys(rows, exclude=x_keys)
    out: dict[SeriesKey, list[Row]] = {}
    for row in rows:
        key = SeriesKey(row.impl, row.source, row.interpreter, params_label(row, keys))
        out.setdefault(key, []).append(row)
    return out


def baseline_impl(rows: Iterable[Row]) -> str | None:
    """The implementation sparse ones are compared against: dense if present, else sdpa."""
    impls = {row.impl for row in rows if row.measured_ok}
    return next((name for name in BASELINES if name in impls), None)


def pair_key(row: Row) -> tuple[str, str, str, str]:
    """Records comparable with each other: same environment, provenance, device and case."""
    return (row.fingerprint, row.source, row.device, row.case_id)
