"""The record format (docs/DESIGN.md "Records"), defined once for writing and for validating what is read (its
communication, device and quality parts in comm_records, device_records, quality_records; all importable from here).

`run.json` holds a `RunInfo`; `records.jsonl` one `Record` per (case, impl) per line. Models are frozen and
forbid unknown keys, so a foreign or corrupted file is named on load instead of half-read. Non-finite
floats are written as null (JSON has no NaN); the `nonfinite` counts keep that information.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, model_validator

from bench.inputs import InputsInfo
from bench.results.comm_records import CommInfo, CommLevel, CommOp, LinkBytes, RankComm, Topology
from bench.results.device_records import ContentionInfo, DeviceState, GpuIdentity, GpuState
from bench.results.environment import Environment
from bench.results.quality_records import QualityInfo, TrainingInfo

SCHEMA_VERSION = 1
Status = Literal["ok", "skipped", "failed", "incorrect"]
STATUSES: tuple[str, ...] = get_args(Status)
# Why a `failed` record has no measurement: the implementation raised (error), ran out of memory, ran past the
# suite's timeout_s, its process died, or its worker or ranks could not start.
FailureKind = Literal["error", "out_of_memory", "timeout", "died", "startup"]
StoppedBy = Literal["precision", "max_time", "max_samples", "blocks", "model"]
MemoryMethod = Literal["cuda_max_memory_allocated", "rss_hwm", "model"]
# Where a CPU figure was read: a process forked for this measurement alone, or one that ran other calls first
# (the worker after earlier cases, a rank after its timing)
MemoryProcess = Literal["fresh", "shared"]
PeakSource = Literal["calibrated", "datasheet"]
Source = Literal["measured", "modelled"]

_STRICT = ConfigDict(extra="forbid", frozen=True)
__all__ = [
    "AttentionStats",
    "CommInfo",
    "CommLevel",
    "CommOp",
    "ContentionInfo",
    "DeviceState",
    "Distribution",
    "ErrorInfo",
    "FailureKind",
    "Fallback",
    "FidelityInfo",
    "GpuIdentity",
    "GpuState",
    "GradError",
    "GradFidelity",
    "InputsInfo",
    "LinkBytes",
    "MemoryInfo",
    "PeakInfo",
    "QualityInfo",
    "RankComm",
    "Record",
    "RecordGit",
    "RunInfo",
    "SelectionInfo",
    "SetupTimes",
    "Spread",
    "Status",
    "StoppedBy",
    "SuiteInfo",
    "TimeStats",
    "TimingInfo",
    "Topology",
    "TrainingInfo",
]


class TimeStats(BaseModel):
    """Seconds per call. `samples` are every timed sample, in the order taken."""

    model_config = _STRICT
    median: float
    min: float
    max: float
    mean: float
    std: float
    q1: float
    q3: float
    n: int
    samples: list[float]
    ci95: list[float] | None = None  # distribution-free 95% CI of the median
    rel_ci95: float | None = None  # its half-width over the median: the achieved precision
    stopped_by: StoppedBy | None = None  # blocks: interleaved A/B blocks (bench ab); model: bench model


class TimingInfo(BaseModel):
    """How the timed calls were made (bench.measure.cold): the cache state they started from, the input sets they
    cycled through, how many of their outputs were checked against the oracle."""

    model_config = _STRICT
    cache: Literal["cold", "warm"]  # cold: the caches evicted before every timed call
    rotated_sets: int  # input sets the calls cycled through, written in place between calls (1: rotation off)
    checked_calls: int  # timed calls whose output was compared with the oracle for its own inputs
    llc_bytes: int | None = None  # the cache evicted: the CPU's last-level cache, a GPU's L2
    llc_source: str | None = None  # where its size was read
    evict_bytes: int | None = None  # written and read before each timed call (null: warm)
    prep_s: float | None = None  # the harness's untimed seconds per call: inputs written, caches evicted
    checked_rel_l2: float | None = None  # the worst rel_l2 of the checked calls' outputs


class MemoryInfo(BaseModel):
    model_config = _STRICT
    peak_bytes: int | None
    method: MemoryMethod | None = None
    note: str | None = None
    process: MemoryProcess | None = None  # rss_hwm only


class GradError(BaseModel):
    model_config = _STRICT
    max_abs: float | None
    rel_l2: float | None
    tolerance: float
    nonfinite: int = 0
    reference_rel_l2: float | None = None  # the same-dtype PyTorch reference's, against the same oracle
    ratio: float | None = None  # rel_l2 / max(reference_rel_l2, the dtype's rounding floor)


class ErrorInfo(BaseModel):
    model_config = _STRICT
    max_abs: float | None
    rel_l2: float | None
    tolerance: float
    rows_checked: int
    nonfinite: int = 0
    grads: dict[str, GradError] | None = None  # dq, dk, dv in mode fwd_bwd
    lse_max_abs: float | None = None  # selections: the log-sum-exp against the oracle's, where the impl returns it
    # against a same-dtype PyTorch reference (bench.measure.oracle.numerics): its rel_l2 to the same oracle, our ratio
    reference_rel_l2: float | None = None
    ratio: float | None = None
    lse_rel_l2: float | None = None
    lse_reference_rel_l2: float | None = None
    lse_ratio: float | None = None
    numerics: Literal["ok", "worse_than_reference"] | None = None  # a ratio above 2 on any tensor
    max_rel: float | None = None  # elementwise max of |error| / (|oracle| + 1e-8) (FlashInfer-Bench's figure)


class PeakInfo(BaseModel):
    """The roofs a record is compared with: the achieved FLOP rate as a fraction of the device's compute peak (and
    where that peak came from), the achieved bytes/s as a fraction of its memory bandwidth (and where that came
    from), and which roof binds (`bound`: the larger of bytes / bandwidth and flops / peak)."""

    model_config = _STRICT
    fraction: float | None = None
    peak_flops: float | None = None
    source: PeakSource | None = None
    hardware: str | None = None
    bandwidth: float | None = None  # bytes/s
    bandwidth_source: str | None = None  # "calibrated all-thread read" or a GPU's datasheet memory bandwidth
    bandwidth_fraction: float | None = None
    bound: Literal["memory", "compute"] | None = None
    # past a roof by more than 5%: a figure no call can reach from memory (a working set within the last-level
    # cache, a warm timing) or a roof measured wrong; no target, speed-up or gain is claimed from such a record
    above_roof: bool | None = None
    above_roof_reason: str | None = None


class SetupTimes(BaseModel):
    """Where setup time went: the phases an implementation marks (bench.registry.setup_phase), and the first
    call without them. None: the implementation marked no such phase."""

    model_config = _STRICT
    mask_s: float | None = None  # masks, layouts, lookup tables (FlexAttention's BlockMask, our tile tables)
    compile_s: float | None = None  # compilation and autotuning
    first_call_s: float | None = None


class Distribution(BaseModel):
    """A statistic over rows: mean and percentiles."""

    model_config = _STRICT
    mean: float | None
    p5: float | None
    p50: float | None
    p95: float | None


class AttentionStats(BaseModel):
    """How concentrated dense attention under the case's pattern is on its inputs
    (bench.measure.oracle.attention_stats), each over (batch, head, query row) of the oracle's rows."""

    model_config = _STRICT
    top1_mass: Distribution
    top5_mass: Distribution
    top10_mass: Distribution
    block_top5_mass: Distribution
    entropy: Distribution
    sink_mass: Distribution
    rows: int


class Spread(BaseModel):
    """A figure over (batch, head, query row): mean, 5th percentile, min and max."""

    model_config = _STRICT
    mean: float | None
    p5: float | None
    min: float | None
    max: float | None


class SelectionInfo(BaseModel):
    """A selection case's selector and its cost (bench.measure.case.selected): units, sharing, what it kept, the
    selector alone and the attention over a fixed selection (the record's time_s is end to end)."""

    model_config = _STRICT
    selector: str
    q_unit: int  # query rows per query unit
    kv_unit: int  # keys per selected index
    shared: Literal["head", "kv_group", "all"]
    budget: int | float | None = None
    threshold: float | None = None
    units_mean: float  # key units kept per query unit, on average
    density: float | None = None  # effective pairs over base pairs (fidelity's rows)
    reference: bool = False  # an oracle selector: timed by one call, the cost of dense attention
    time_s: TimeStats  # the selector alone
    attention_time_s: TimeStats  # attend over the fixed selection
    share: float | None = None  # selector median over end-to-end median (null for a reference selector)
    share_note: str | None = None  # why share is null


class GradFidelity(BaseModel):
    """One gradient of a selected attention against dense attention's (bench.measure.oracle.grad_fidelity)."""

    model_config = _STRICT
    rel_l2: float
    cosine: float | None = None


class FidelityInfo(BaseModel):
    """How close a selection's attention is to dense attention under the base pattern
    (bench.measure.oracle.fidelity)."""

    model_config = _STRICT
    recall: Spread
    lse_gap: Spread
    oracle_recall: Spread
    cosine: Spread
    output_rel_l2: float | None
    needles_found: float | None = None
    density: float | None = None
    rows: int
    grads: dict[str, GradFidelity] | None = None  # fwd_bwd: dq, dk, dv against dense attention's ([R4 3/6])


class Fallback(BaseModel):
    """`config.fallback`: the slower path an implementation measured under its name, and why its own could not run."""

    model_config = ConfigDict(extra="allow", frozen=True)
    path: str | None = None
    reason: str | None = None


class RecordGit(BaseModel):
    """The code that measured a record: its commit and whether tracked files differed from it."""

    model_config = _STRICT
    commit: str | None = None
    dirty: bool | None = None


class Record(BaseModel):
    model_config = _STRICT
    schema_version: int = SCHEMA_VERSION
    case_id: str
    impl: str
    params: dict[str, Any]
    status: Status
    reason: str | None = None
    time_s: TimeStats | None = None
    setup_s: float | None = None  # prepare + the first call
    setup: SetupTimes | None = None
    memory: MemoryInfo | None = None
    comm: CommInfo | None = None
    error: ErrorInfo | None = None
    flops: float | None = None  # useful FLOPs per call
    bytes: int | None = None  # the least bytes the call must move (bench.measure.case.flops.min_bytes)
    density: float | None = None
    block_density: float | None = None
    # Beyond the contract's minimum: provenance and derived figures.
    source: Source = "measured"
    failure: FailureKind | None = None  # why a failed record has no measurement
    device: str | None = None  # e.g. "cpu: AMD EPYC 7B13" or "cuda:0 NVIDIA H200"
    interpreter: bool = False  # Triton kernels run through the CPU interpreter: not kernel speed
    flops_dense: float | None = None
    flops_per_s: float | None = None
    peak: PeakInfo | None = None
    config: dict[str, Any] | None = None  # implementation-specific (autotuned config, ...)
    env: DeviceState | None = None  # device state sampled around the measurement (clocks, throttling)
    details: str | None = None  # traceback tail of a failure
    started_at: str | None = None
    wall_s: float | None = None  # wall time spent on this (case, impl), all phases
    check_s: float | None = None  # of which the oracle check (computing the oracle where this pair was first)
    memory_s: float | None = None  # of which the memory measurement (on CPU: the case again, in a fresh process)
    # wall_s split by the harness's phases ("pattern", "inputs", "selection", "prepare", "first call", "check",
    # "fidelity", "timing", "memory", ...): what the harness itself costs beside the timed calls
    phases_s: dict[str, float] | None = None
    inputs: InputsInfo | None = None  # where q, k, v came from (null in records written before inputs existed)
    attention_stats: AttentionStats | None = None  # with measure.attention_stats
    selection: SelectionInfo | None = None  # a case with a selector
    fidelity: FidelityInfo | None = None  # a case with a selector
    contention: ContentionInfo | None = None  # measured pairs: was the machine busy while they were timed
    git: RecordGit | None = None  # the code that measured it (null in records written before R4)
    code: dict[str, str] | None = None  # sha256 per file of measured code git does not describe (plugins, ...)
    time_fwd_s: float | None = None  # fwd_bwd: the forward's median alone (the step's phase split)
    time_bwd_s: float | None = None  # fwd_bwd: the backward's median alone, after an untimed forward
    flops_bwd: float | None = None  # fwd_bwd: the backward's useful FLOPs, 2.5x the forward (FlashAttention's)
    quality: QualityInfo | None = None  # a case with a model: the model scored with this attention ([R4 2/6])
    training: TrainingInfo | None = None  # a case with a model and train: the training run ([R4 3/6])
    timing: TimingInfo | None = None  # how the timed calls were made: cache state, input sets, checked outputs

    @property
    def busy(self) -> bool:
        return self.contention is not None and self.contention.verdict == "busy"

    @property
    def fallback(self) -> Fallback | None:
        """{path, reason} where the implementation measured a slower path than its own under its name."""
        value = (self.config or {}).get("fallback")
        return Fallback.model_validate(value) if isinstance(value, dict) else None

    @property
    def code_path(self) -> tuple[str, ...]:
        """What code measured the record, as far as the record says: the implementation's path, its fallback, the
        Triton interpreter, compiled or not. Two records of a pair with different code paths are not compared."""
        config = self.config or {}
        compiled = str(config.get("compiled", ""))
        return (str(config.get("path", "")), "fallback" if self.fallback is not None else "",
                "interpreter" if self.interpreter else "",
                "uncompiled" if compiled.startswith("uncompiled") else "compiled" if compiled else "",
                *(str(config.get(key, "")) for key in ("products", "engine", "gemm")))

    @model_validator(mode="before")
    @classmethod
    def _failure_of_old_records(cls, data: Any) -> Any:
        """Records written before `failure` existed said "out of memory" in their reason only."""
        if isinstance(data, dict) and data.get("status") == "failed" and "failure" not in data:
            reason = str(data.get("reason") or "").lower()
            return {**data, "failure": "out_of_memory" if reason.startswith("out of memory") else "error"}
        return data

    def to_json(self) -> str:
        return self.model_dump_json()


class SuiteInfo(BaseModel):
    model_config = _STRICT
    name: str
    file: str | None = None
    content: dict[str, Any]


class RunInfo(BaseModel):
    model_config = _STRICT
    schema_version: int = SCHEMA_VERSION
    run_id: str
    suite: SuiteInfo
    started_at: str
    finished_at: str | None = None
    env: Environment
    source: Source = "measured"
    command: list[str] | None = None
