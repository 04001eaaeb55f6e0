"""The record format (docs/DESIGN.md "Records"), defined once for writing and for validating what is read.

`run.json` holds a `RunInfo`; `records.jsonl` one `Record` per (case, impl) per line. Models are frozen and
forbid unknown keys, so a foreign or corrupted file is named on load instead of half-read. Non-finite
floats are written as null (JSON has no NaN); the `nonfinite` counts keep that information.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, model_validator

from bench.results.environment import Environment

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


class MemoryInfo(BaseModel):
    model_config = _STRICT
    peak_bytes: int | None
    method: MemoryMethod | None = None
    note: str | None = None
    process: MemoryProcess | None = None  # rss_hwm only


class CommOp(BaseModel):
    """Bytes one collective kind moved, summed over its calls (ring accounting, as nccl-tests)."""

    model_config = _STRICT
    calls: int
    bytes_total: int  # sent by all ranks
    bytes_max_rank: int  # sent by the busiest rank
    time_s: float | None = None  # summed op time on the slowest rank
    hidden_s: float | None = None  # of which overlapped the rank's compute (the largest over ranks)
    algbw_gbps: float | None = None
    busbw_gbps: float | None = None


class RankComm(BaseModel):
    """One rank's share of a distributed step (times per step, averaged over the timed steps).

    comm_s: its ops' time (an op started without waiting: its time in flight); hidden_s: the part of comm_s
    that overlapped its compute; exposed_s = comm_s - hidden_s; compute_s = step_s - exposed_s (bench.comm,
    "Overlap"). flops: the useful FLOPs of the pairs it computes. peak_bytes: its memory (memory.method)."""

    model_config = _STRICT
    rank: int
    bytes: int
    flops: float | None = None
    step_s: float | None = None
    compute_s: float | None = None
    comm_s: float | None = None
    hidden_s: float | None = None
    exposed_s: float | None = None
    peak_bytes: int | None = None


class CommLevel(BaseModel):
    """Bytes of the ops counted under one level label (cp_usp: ulysses inside groups, ring across them)."""

    model_config = _STRICT
    calls: int
    bytes_total: int
    bytes_max_rank: int
    expected_bytes: int | None = None  # the implementation's closed form for the level


class Topology(BaseModel):
    """Where a distributed pair's ranks ran: nodes in order of first appearance over the ranks."""

    model_config = _STRICT
    nodes: int
    ranks_per_node: list[int]  # per node
    node_of_rank: list[int]  # per rank: its node's index
    node_names: list[str] | None = None  # host names (with torchrun's node rank), or BENCH_NODE


class LinkBytes(BaseModel):
    """Bytes sent between ranks on one node and between ranks on different nodes."""

    model_config = _STRICT
    intra_node: int
    inter_node: int


class CommInfo(BaseModel):
    model_config = _STRICT
    backend: Literal["gloo", "nccl", "model"]
    bytes_total: int
    bytes_max_rank: int
    by_op: dict[str, CommOp]
    expected_bytes: int | None = None  # the implementation's closed form
    world_size: int | None = None
    bytes_per_rank: list[int] | None = None
    per_rank: list[RankComm] | None = None
    imbalance: float | None = None  # max / mean of the ranks' useful FLOPs
    overlap_fraction: float | None = None  # sum of hidden_s / sum of comm_s over ranks, measured
    overlap_method: Literal["host", "cuda_events"] | None = None  # how hidden_s was measured (bench.comm)
    by_level: dict[str, CommLevel] | None = None
    topology: Topology | None = None
    by_link: LinkBytes | None = None  # counted: each rank's bytes per peer, split by the peers' nodes
    expected_bytes_by_link: LinkBytes | None = None  # the implementation's closed form, same split


class GradError(BaseModel):
    model_config = _STRICT
    max_abs: float | None
    rel_l2: float | None
    tolerance: float
    nonfinite: int = 0


class ErrorInfo(BaseModel):
    model_config = _STRICT
    max_abs: float | None
    rel_l2: float | None
    tolerance: float
    rows_checked: int
    nonfinite: int = 0
    grads: dict[str, GradError] | None = None  # dq, dk, dv in mode fwd_bwd
    lse_max_abs: float | None = None  # selections: the log-sum-exp against the oracle's, where the impl returns it


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


class SetupTimes(BaseModel):
    """Where setup time went: the phases an implementation marks (bench.registry.setup_phase), and the first
    call without them. None: the implementation marked no such phase."""

    model_config = _STRICT
    mask_s: float | None = None  # masks, layouts, lookup tables (FlexAttention's BlockMask, our tile tables)
    compile_s: float | None = None  # compilation and autotuning
    first_call_s: float | None = None


class InputsInfo(BaseModel):
    """Where a case's q, k, v came from (bench.inputs): the kind, the seed, a captured file's path, content hash
    and layer, and the structured generator's planted needles (how many)."""

    model_config = _STRICT
    kind: Literal["random", "structured", "file"]
    seed: int
    file: str | None = None
    file_sha256: str | None = None
    layer: int | None = None
    needles: int | None = None


class Distribution(BaseModel):
    """A statistic over rows: mean and percentiles."""

    model_config = _STRICT
    mean: float | None
    p5: float | None
    p50: float | None
    p95: float | None


class AttentionStats(BaseModel):
    """How concentrated dense attention under the case's pattern is on its inputs (bench.measure.attention_stats),
    each over (batch, head, query row) of the oracle's rows."""

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
    """A selection case's selector and its cost (bench.measure.selected): units, sharing, what it kept, the
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
    share: float | None = None  # selector median over end-to-end median


class FidelityInfo(BaseModel):
    """How close a selection's attention is to dense attention under the base pattern (bench.measure.fidelity)."""

    model_config = _STRICT
    recall: Spread
    lse_gap: Spread
    oracle_recall: Spread
    cosine: Spread
    output_rel_l2: float | None
    needles_found: float | None = None
    density: float | None = None
    rows: int


class ContentionInfo(BaseModel):
    """Was the machine busy while the pair was timed (bench.measure.contention): the readings and the verdict."""

    model_config = _STRICT
    cpu_pressure: float | None = None  # share of the timed wall time some task waited for a CPU (PSI); null: no PSI
    load: float | None = None  # 1-minute load average over usable cores
    cpu_over_wall: float | None = None  # the process's CPU seconds per wall second over the timed calls
    gpu_throttle: list[str] | None = None  # NVML slowing reasons seen (CUDA only)
    verdict: Literal["quiet", "busy"]
    reason: str | None = None  # the reading that made it busy
    waited_s: float | None = None  # measure.wait_for_quiet_s: seconds waited for quiet before the timing


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
    bytes: int | None = None  # the least bytes the call must move (bench.measure.flops.min_bytes)
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
    env: dict[str, Any] | None = None  # device state sampled around the measurement (clocks, throttling)
    details: str | None = None  # traceback tail of a failure
    started_at: str | None = None
    wall_s: float | None = None  # wall time spent on this (case, impl), all phases
    check_s: float | None = None  # of which the oracle check (computing the oracle where this pair was first)
    memory_s: float | None = None  # of which the memory measurement (on CPU: the case again, in a fresh process)
    inputs: InputsInfo | None = None  # where q, k, v came from (null in records written before inputs existed)
    attention_stats: AttentionStats | None = None  # with measure.attention_stats
    selection: SelectionInfo | None = None  # a case with a selector
    fidelity: FidelityInfo | None = None  # a case with a selector
    contention: ContentionInfo | None = None  # measured pairs: was the machine busy while they were timed

    @property
    def busy(self) -> bool:
        return self.contention is not None and self.contention.verdict == "busy"

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
