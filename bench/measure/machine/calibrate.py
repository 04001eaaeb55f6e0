"""`bench calibrate`: this machine's matmul rate per dtype and its copy bandwidth, the peaks records compare with.

A record's `peak` is its achieved FLOP rate over a peak: the calibrated matmul rate of its dtype when this
machine (same environment fingerprint) was calibrated, else the datasheet figure of a known GPU, and it says
which. A matmul is the best case for the hardware, so `fraction` reads as "share of what this machine does
at its best", which is the comparison the project's CPU claims call for.

Stored at `<results>/calibration/<fingerprint>.json`; a run records the calibration it used in run.json's
`env.calibration`. With `measure: {calibrate: true}` in a suite, `bench run` measures a quick calibration at
the start of the run, in a child process (so a GPU context is not kept in the runner: bench.run.calibration),
and uses that one.
"""

from __future__ import annotations

import json
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.errors import BadInput
from bench.measure.timing import Timer, TimingPolicy, measure, timer_for
from bench.results.environment import Bandwidth, Calibration, CalibrationTime, MatmulRate
from bench.results.records import PeakInfo, TimeStats
from bench.results.store import CALIBRATION_DIR

MATMUL_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Settings:
    """How long calibration may take. `quick` is what a run measures at its start."""

    policy: TimingPolicy = field(default_factory=lambda: TimingPolicy(warmup=2, repeat=10, max_time_s=1.0))
    target_call_s: float = 0.2  # grow the matmul from min_n until one call takes this long (or max_n)
    # Square matmul sizes: large enough to reach the BLAS's steady rate (small ones are overhead-bound,
    # and on a loaded CPU a small multithreaded call mostly waits for its threads).
    min_n: dict[str, int] = field(default_factory=lambda: {"cpu": 1024, "cuda": 4096})
    max_n: dict[str, int] = field(default_factory=lambda: {"cpu": 4096, "cuda": 16384})
    copy_bytes: dict[str, int] = field(default_factory=lambda: {"cpu": 256 * 2**20, "cuda": 2**30})
    # the CPU's copy and read buffers are at least this many times its last-level cache (0: copy_bytes as given)
    past_llc: int = 4


QUICK = Settings(TimingPolicy(warmup=1, repeat=5, max_time_s=0.5), 0.05, {"cpu": 512, "cuda": 4096},
                 {"cpu": 2048, "cuda": 8192}, {"cpu": 64 * 2**20, "cuda": 512 * 2**20})


def _brief(stats: TimeStats) -> CalibrationTime:
    return CalibrationTime(median=stats.median, rel_ci95=stats.rel_ci95, n=stats.n, stopped_by=stats.stopped_by)


def matmul_rate(device: str, dtype: str, settings: Settings, timer: Timer | None = None,
                tf32: bool = False) -> MatmulRate:
    """FLOP/s of a square (n, n) @ (n, n) matmul (2 n^3 FLOPs), n doubled from min_n until a call is long enough."""
    import torch

    timer = timer or timer_for(device)
    torch_dtype = getattr(torch, dtype)
    previous_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        kind = device.split(":")[0]
        n = settings.min_n[kind]
        while True:
            a = torch.randn(n, n, device=device).to(torch_dtype)
            b = torch.randn(n, n, device=device).to(torch_dtype)
            call = lambda a=a, b=b: a @ b  # noqa: E731
            call()  # first call: library initialisation and kernel choice, never timed
            if n >= settings.max_n[kind] or timer.time_call(call) >= settings.target_call_s:
                break
            n *= 2
        stats = measure(call, settings.policy, timer)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous_tf32
    return MatmulRate(flops_per_s=2.0 * n**3 / stats.median, n=n, time_s=_brief(stats))


def copy_bandwidth(device: str, settings: Settings, timer: Timer | None = None) -> Bandwidth:
    """Bytes/s of dst.copy_(src) over a buffer far larger than the caches, counting the read and the write."""
    import torch

    timer = timer or timer_for(device)
    nbytes = _past_the_caches(settings.copy_bytes[device.split(":")[0]], device, settings.past_llc)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    stats = measure(lambda: dst.copy_(src), settings.policy, timer)
    return Bandwidth(bytes_per_s=2.0 * nbytes / stats.median, bytes=nbytes, time_s=_brief(stats))


def read_bandwidth(device: str, settings: Settings, timer: Timer | None = None, threads: int | None = None
                   ) -> Bandwidth:
    """Bytes/s of a sum over a buffer far larger than the caches: the streaming read decode makes of a KV cache
    (each byte read once, nothing written). `threads`: torch's intra-op threads for it (None: as configured)."""
    import torch

    timer = timer or timer_for(device)
    nbytes = _past_the_caches(settings.copy_bytes[device.split(":")[0]] * 2, device, settings.past_llc)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        stats = measure(lambda: src.sum(), settings.policy, timer)
    finally:
        torch.set_num_threads(previous)
    return Bandwidth(bytes_per_s=nbytes / stats.median, bytes=nbytes, threads=threads or previous,
                     time_s=_brief(stats))


def _past_the_caches(nbytes: int, device: str, multiple: int) -> int:
    """At least `multiple` times the CPU's last-level cache (read from the machine), so that the buffer streams from
    memory: a 512 MB read on a CPU with a 480 MB last-level cache would mostly measure the cache."""
    if device.startswith("cuda"):
        return nbytes
    from bench.measure.cold import last_level_cache

    llc = last_level_cache().bytes or 0
    return max(nbytes, multiple * llc)


def calibrate(device: str, dtypes: list[str] | None = None, settings: Settings | None = None,
              timer: Timer | None = None) -> Calibration:
    """Matmul rate per dtype (and TF32 on CUDA when float32 is asked), copy bandwidth, and read bandwidth with all
    threads and with one (CPU) on `device`."""
    import torch

    from bench.measure.machine.env import device_description
    from bench.results.store import utc_now

    settings = settings or Settings()
    dtypes = list(dtypes or MATMUL_DTYPES)
    matmul = {dtype: matmul_rate(device, dtype, settings, timer) for dtype in dtypes}
    if device.startswith("cuda") and "float32" in dtypes:
        matmul["tf32"] = matmul_rate(device, "float32", settings, timer, tf32=True)
    read = {"all_threads": read_bandwidth(device, settings, timer)}
    if not device.startswith("cuda"):
        read["one_thread"] = read_bandwidth(device, settings, timer, threads=1)
    return Calibration(device=device_description(device), backend=device.split(":")[0], measured_at=utc_now(),
                       torch_threads=torch.get_num_threads(), matmul=matmul,
                       copy=copy_bandwidth(device, settings, timer), read=read)


# --- storage -----------------------------------------------------------------------------------------------


def calibration_path(results: Path, fingerprint: str) -> Path:
    return Path(results) / CALIBRATION_DIR / f"{fingerprint}.json"


def store(results: Path, fingerprint: str, calibration: Calibration) -> Path:
    from bench.results.store import write_json_atomic

    path = calibration_path(results, fingerprint)
    path.parent.mkdir(parents=True, exist_ok=True)
    stored = calibration.model_copy(update={"fingerprint": fingerprint})
    write_json_atomic(path, stored.model_dump(mode="json", by_alias=True, exclude_none=True))
    return path


def load(results: Path, fingerprint: str) -> Calibration | None:
    """The stored calibration of this environment, or None. A damaged file is BadInput naming it."""
    path = calibration_path(results, fingerprint)
    if not path.is_file():
        return None
    try:
        data = Calibration.model_validate(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
        first = str(exc).strip().splitlines()[:2]
        raise BadInput(f"not a calibration file ({type(exc).__name__}: {' '.join(first)}); run `bench calibrate` "
                       "again", file=str(path)) from None
    if data.fingerprint != fingerprint or not data.matmul or not all(m.flops_per_s > 0 for m in data.matmul.values()):
        raise BadInput("fingerprint or rates do not match its name; run `bench calibrate` again", file=str(path))
    return data.model_copy(update={"source": str(path)})


# --- the peak a record is compared with ----------------------------------------------------------------------


# A figure past a roof by more than this share is marked above it (timing noise and a calibration read a little
# low stay under it).
ABOVE_ROOF_MARGIN = 0.05
# x86 features with which a CPU multiplies the dtype natively; without them torch's GEMM and our kernel widen the
# inputs to float32, so the float32 rate is the roof (a "bfloat16 matmul rate" measured there times emulation)
NATIVE_DOT = {"bfloat16": ("avx512_bf16", "amx_bf16"), "float16": ("avx512_fp16", "amx_fp16")}


def peak_for(flops_per_s: float | None, dtype: str, device: str, tf32: bool,
             calibration: Calibration | None, gpu: tuple[str, int] | None = None,
             bytes_per_s: float | None = None, flops: float | None = None, bytes_moved: int | None = None,
             cache: str = "cold", cpu_features: list[str] | None = None) -> PeakInfo | None:
    """The record's `peak`: the compute roof (the calibrated matmul rate of the dtype, else a known GPU's
    datasheet) and the memory roof (the calibrated all-thread read bandwidth, else the GPU's datasheet memory
    bandwidth), the achieved fraction of each, which roof binds (the larger of bytes / bandwidth and flops /
    peak: the floor the call cannot go under), and `above_roof` where a fraction passes 1 + ABOVE_ROOF_MARGIN.
    None when neither roof is known.

    `gpu`: (name, memory bytes) of the CUDA device, looked up in bench.measure.machine.hardware for the datasheet
    figures.
    `cpu_features`: the CPU's instruction-set features (bench.measure.machine.env.cpu_info): a CPU without a native dot
    product of the dtype is held to its float32 rate.
    """
    out: dict[str, Any] = {}
    rates = calibration.matmul if calibration is not None else {}
    key = "tf32" if device.startswith("cuda") and dtype == "float32" and tf32 and "tf32" in rates else dtype
    widened = (not device.startswith("cuda") and cpu_features is not None and dtype in NATIVE_DOT
               and platform.machine() in ("x86_64", "AMD64")
               and not any(f in cpu_features for f in NATIVE_DOT[dtype]))
    spec = None
    if device.startswith("cuda") and gpu is not None:
        from bench.measure.machine.hardware import match_gpu

        spec = match_gpu(*gpu)
    if widened and "float32" in rates:
        out.update(peak_flops=max(rates["float32"].flops_per_s, rates[dtype].flops_per_s if dtype in rates else 0),
                   source="calibrated", hardware=f"{calibration.device if calibration else None} float32 matmul "
                                                 f"({dtype} widened: no {' or '.join(NATIVE_DOT[dtype])})")
    elif widened:  # its own rate times emulation: no compute roof rather than a wrong one
        out.update(hardware=f"no compute roof: {dtype} is widened here (no {' or '.join(NATIVE_DOT[dtype])}) and "
                            "float32's matmul rate was not calibrated")
    elif key in rates:
        peak = rates[key].flops_per_s
        out.update(peak_flops=peak, source="calibrated", hardware=f"{calibration.device if calibration else None} "
                                                                   f"{key} matmul")
    elif spec is not None:
        peak, unit = spec.peak_flops(dtype, tf32)
        out.update(peak_flops=peak, source="datasheet", hardware=f"{spec.key} {unit}")
    if flops_per_s and out.get("peak_flops"):
        out["fraction"] = flops_per_s / out["peak_flops"]
    read = calibration.read_bandwidth() if calibration is not None else None
    if read:
        out.update(bandwidth=read, bandwidth_source="calibrated all-thread read")
    elif spec is not None:
        out.update(bandwidth=spec.memory_bandwidth, bandwidth_source=f"{spec.key} datasheet memory bandwidth")
    if out.get("bandwidth") and bytes_per_s:
        out["bandwidth_fraction"] = bytes_per_s / out["bandwidth"]
    if out.get("bandwidth") and out.get("peak_flops") and flops is not None and bytes_moved is not None:
        out["bound"] = "memory" if bytes_moved / out["bandwidth"] >= flops / out["peak_flops"] else "compute"
    reason = above_roof_reason(out.get("fraction"), out.get("hardware"), out.get("bandwidth_fraction"), bytes_moved,
                               cache)
    if reason is not None:
        out.update(above_roof=True, above_roof_reason=reason)
    elif out.get("fraction") is not None or out.get("bandwidth_fraction") is not None:
        out["above_roof"] = False
    return PeakInfo(**out) if out else None


def above_roof_reason(fraction: float | None, compute_roof: str | None, bandwidth_fraction: float | None,
                      bytes_moved: int | None, cache: str) -> str | None:
    """Why a record's figure passes a roof by more than ABOVE_ROOF_MARGIN, or None when none does."""
    limit = 1 + ABOVE_ROOF_MARGIN
    reasons = []
    if bandwidth_fraction is not None and bandwidth_fraction > limit:
        size = f"{bytes_moved / 2**20:.3g} MiB" if bytes_moved is not None else "its working set"
        why = ("the timing was warm: the call's working set (" + size + ") was read from the caches the last call "
               "left it in") if cache == "warm" else (
               "the timing was cold, so either a part of the working set (" + size + ") stayed in a cache the "
               "eviction did not reach, the bytes counted exceed what the call must read, or the calibration read "
               "low")
        reasons.append(f"{bandwidth_fraction:.2f}x the calibrated read bandwidth: {why}")
    if fraction is not None and fraction > limit:
        reasons.append(f"{fraction:.2f}x the compute roof ({compute_roof}), which no attention call can pass: the "
                       "roof was measured on a slower path than the call's (an emulated matmul) or the FLOPs are "
                       "over-counted")
    return "; ".join(reasons) if reasons else None


def gpu_identity(device: str) -> tuple[str, int] | None:
    """(name, memory bytes) of the current CUDA device, for datasheet lookup; None on CPU."""
    if not device.startswith("cuda"):
        return None
    import torch

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return props.name, int(props.total_memory)


def command(device: str, results: Path, quick: bool, dtypes: list[str], console: Any) -> int:
    """`bench calibrate`: measure, store under the environment's fingerprint, print what was measured."""
    from rich.table import Table

    from bench.measure.machine.env import capture

    env = capture(backend=device)
    result = calibrate(device, dtypes, QUICK if quick else Settings())
    path = store(results, env.fingerprint or "", result)
    table = Table(title=f"calibration of {result.device} ({result.torch_threads} torch threads)")
    for column in ("what", "size", "rate", "median time", "95% CI half-width"):
        table.add_column(column, justify="left" if column == "what" else "right")

    def median(time_s: CalibrationTime | None) -> str:
        return f"{time_s.median * 1e3:.4g} ms" if time_s is not None else "-"

    def ci(time_s: CalibrationTime | None) -> str:
        return f"{time_s.rel_ci95:.2%}" if time_s is not None and time_s.rel_ci95 is not None else "-"

    for name, m in result.matmul.items():
        table.add_row(f"{name} matmul", f"n = {m.n}", f"{m.flops_per_s / 1e9:.4g} GFLOP/s", median(m.time_s),
                      ci(m.time_s))
    reads = [("copy (read + write counted)", result.copy_)] + [
        (f"read, {r.threads} thread(s) ({name.replace('_', ' ')})", r) for name, r in (result.read or {}).items()]
    for what, bw in reads:
        assert bw is not None
        table.add_row(what, f"{(bw.bytes or 0) / 2**20:g} MiB", f"{bw.bytes_per_s / 1e9:.4g} GB/s",
                      median(bw.time_s), ci(bw.time_s))
    console.print(table)
    console.print(f"stored: {path} (environment fingerprint {env.fingerprint}); runs into {results} with this "
                  "fingerprint compare their FLOP rates and their bytes moved (the all-thread read) with it")
    return 0
