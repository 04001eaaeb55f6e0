"""Measure what contention looks like here: `python scripts/contention_probe.py [OUT_DIR] [--repeats R]`.

Times a fixed attention call (dense, 2 torch threads, seq_len 1024) in a child process for a few seconds,
alone and beside 1, 2 and 4 busy processes (each a Python loop spinning), and reads what bench's
ContentionMeter reads: CPU pressure (PSI), load per core, CPU time over wall time, and the call's median
time. Writes `probe.json` and `probe.md` to OUT_DIR (default docs/contention/); docs/DESIGN.md chooses the
thresholds of bench.measure.machine.contention from them. The machine's other users are not ours to stop: the
pressure before each step is recorded beside the readings, so a "quiet" step that was not can be seen.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import json, statistics, sys, time, torch
sys.path.insert(0, {root!r})
from bench.measure.machine.contention import ContentionMeter, psi_some_us
torch.set_num_threads(2)
q = torch.randn(1, 4, 1024, 64); k = torch.randn(1, 4, 1024, 64); v = torch.randn(1, 4, 1024, 64)
def call():
    return torch.softmax(q @ k.transpose(-1, -2) / 8, -1) @ v
for _ in range(5):
    call()
meter = ContentionMeter(); samples = []
meter.start(); end = time.perf_counter() + {seconds}
while time.perf_counter() < end:
    t = time.perf_counter(); call(); samples.append(time.perf_counter() - t)
meter.stop()
print(json.dumps({{**meter.result("cpu"), "median_s": statistics.median(samples), "n": len(samples)}}))
"""


def spin() -> None:
    while True:
        pass


def step(busy: int, seconds: float) -> dict:
    spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(busy)]
    for p in spinners:
        p.start()
    try:
        time.sleep(0.5)  # the spinners are running before the timing starts
        out = subprocess.run([sys.executable, "-c", CHILD.format(root=str(ROOT), seconds=seconds)],
                             capture_output=True, text=True, timeout=120, check=True)
        return json.loads(out.stdout)
    finally:
        for p in spinners:
            p.terminate()
            p.join()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", nargs="?", default=str(ROOT / "docs" / "contention"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    from bench.measure.machine.contention import machine_load

    rows = []
    for r in range(args.repeats):
        for busy in (0, 1, 2, 4):
            before = machine_load()
            time.sleep(1.0)  # let the previous step's spinners leave the run queue
            rows.append({"repeat": r, "busy": busy, "psi_avg10_before": before["psi_some_avg10"],
                         **step(busy, args.seconds)})
            print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe.json").write_text(json.dumps({"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                                "machine": machine_load(), "rows": rows}, indent=1) + "\n")
    lines = ["| busy processes | CPU pressure (min-max) | load/core (min-max) | CPU s per s (min-max) | "
             "median call | busy verdicts |", "|---|---|---|---|---|---|"]
    for busy in (0, 1, 2, 4):
        sel = [x for x in rows if x["busy"] == busy]

        def span(key: str, fmt: str, sel: list = sel) -> str:
            vals = [x[key] for x in sel if x[key] is not None]
            return f"{min(vals):{fmt}}-{max(vals):{fmt}}" if vals else "n/a"

        median = statistics.median(x["median_s"] for x in sel) * 1e3
        lines.append(f"| {busy} | {span('cpu_pressure', '.0%')} | {span('load', '.2f')} | "
                     f"{span('cpu_over_wall', '.2f')} | {median:.2f} ms | "
                     f"{sum(x['verdict'] == 'busy' for x in sel)}/{len(sel)} |")
    (out / "probe.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
