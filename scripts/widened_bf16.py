"""bfloat16 through blocked's CPU kernel against blocked's torch-op steps on the perf_prefill cases, in one process.

    scripts/at_level.sh AVX2 .venv/bin/python scripts/widened_bf16.py [ROUNDS]

On a CPU without bfloat16 products (AVX2, or AVX512 without BF16 and AMX) the kernel runs bfloat16 on float32
operands, widened as its blocks are packed (impls/blocked/kernel.py, `widened`); the alternative is blocked's
torch-op steps (gathered blocks or bands, torch's bfloat16 GEMMs, which emulate the products there). Each case is
timed through the harness (bench.measure.pair: cold caches, fresh inputs, checked outputs) both ways, the two
alternating for ROUNDS rounds (default 3); the table gives each way's median of the rounds' medians, their ratio,
and which path and products each record says it ran.
"""

from __future__ import annotations

import statistics
import sys

from bench.measure.case.case_cache import CaseCache
from bench.measure.pair import measure_task
from bench.measure.task import Task
from bench.spec.case import Case

CASES = [dict(pattern="local", window=256), dict(pattern="causal_local", window=1024),
         dict(pattern="block_random", density=0.1, seed=0)]
SHAPE = dict(batch=1, heads=8, head_dim=64, seq_len=4096, block_size=64, dtype="bfloat16", device="cpu")
MEASURE = {"warmup": 2, "repeat": 10, "max_time_s": 1.0, "memory": "worker"}


def _measure(case: Case, kernel: bool) -> tuple[float, str]:
    import impls.blocked as blocked

    wanted = blocked.kernel_wanted
    if not kernel:  # blocked's torch-op steps: as where the kernel is not wanted
        blocked.kernel_wanted = lambda dtype, device: False
    try:
        record = measure_task(Task.of(case, "blocked", MEASURE), CaseCache())
    finally:
        blocked.kernel_wanted = wanted
    assert record.status == "ok" and record.time_s is not None, record.reason
    config = record.config or {}
    return record.time_s.median, f"{config.get('path')} {config.get('products', config.get('gemm', ''))}"


def main(rounds: int) -> None:
    import torch

    print(f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads")
    print("| case | kernel ms | torch ops ms | torch ops / kernel | kernel path | torch-op path |")
    print("|---|---|---|---|---|---|")
    for fields in CASES:
        case = Case(**SHAPE, **fields)
        times: dict[bool, list[float]] = {True: [], False: []}
        paths: dict[bool, str] = {}
        for _ in range(rounds):
            for kernel in (True, False):
                seconds, paths[kernel] = _measure(case, kernel)
                times[kernel].append(seconds)
        k, t = statistics.median(times[True]), statistics.median(times[False])
        print(f"| {case.label} | {k * 1e3:.2f} | {t * 1e3:.2f} | {t / k:.2f}x | {paths[True]} | {paths[False]} |")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
