"""Repeat a memory-law run and report how far each peak moves: `python scripts/memory_stability.py [RUNS]`.

Each run is two `bench run`s (one torch thread) of local W=64: dense at N = 1024..4096, csr and blocked at
N = 4096..16384, the sweep order reversed on every other run so that each case follows different ones.
Prints each (impl, N)'s peaks over the runs (min, max, spread) and each doubling's ratio range.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import yaml

# (impls, heads, head_dim, sequence lengths): the suites of tests/test_memory.py's laws
LAWS = [(["dense"], 2, 32, [1024, 2048, 4096]), (["csr", "blocked"], 4, 64, [4096, 8192, 16384])]


def one_run(tmp: Path, i: int) -> dict[tuple[str, int], int]:
    peaks = {}
    for j, (impls, heads, dim, ns) in enumerate(LAWS):
        suite = {"name": f"memory-stability-{i}-{j}", "impls": impls,
                 "defaults": {"pattern": "local", "window": 64, "device": "cpu", "heads": heads, "head_dim": dim},
                 "sweep": {"seq_len": ns[:: -1 if i % 2 else 1]},
                 "measure": {"warmup": 0, "repeat": 1, "max_time_s": 0.01, "timeout_s": 300, "check": False}}
        path = tmp / f"suite{i}-{j}.yaml"
        path.write_text(yaml.safe_dump(suite))
        out = tmp / f"results{i}-{j}"
        subprocess.run([sys.executable, "-m", "bench", "run", str(path), "--out", str(out)], check=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL)
        (records,) = out.glob("*/records.jsonl")
        for line in records.read_text().splitlines():
            r = json.loads(line)
            peaks[(r["impl"], r["params"]["seq_len"])] = r["memory"]["peak_bytes"]
    return peaks


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    seen: dict[tuple[str, int], list[int]] = defaultdict(list)
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(runs):
            for key, peak in one_run(Path(tmp), i).items():
                seen[key].append(peak)
    print(f"{runs} runs, MB (min..max, spread = max/min - 1)")
    for impl, ns in ((impl, ns) for impls, _, _, ns in LAWS for impl in impls):
        for n in ns:
            p = seen[(impl, n)]
            print(f"{impl:8} N={n:6}: {min(p) / 1e6:8.2f} .. {max(p) / 1e6:8.2f}  spread {max(p) / min(p) - 1:6.2%}")
        for small, big in itertools.pairwise(ns):
            ratios = [b / s for s, b in zip(seen[(impl, small)], seen[(impl, big)], strict=True)]
            print(f"{impl:8} {small}->{big}: ratio {min(ratios):.3f} .. {max(ratios):.3f}")


if __name__ == "__main__":
    main()
