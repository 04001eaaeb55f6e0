"""Figures quoted in notes and docs from committed runs of the workload suites (llm, decode, documents, vision).

    python scripts/workload_figures.py results/<run_id> [results/<run_id> ...]

For each run: every ok record's median time by case and implementation, with its speed as a multiple of sdpa's in the
same run (sdpa's time / its time),
and, where a block_random density sweep is present, each sparse implementation's break-even density against sdpa
(the density below which it is faster, interpolated on log time between the two swept densities around the
crossing). Only records that passed the oracle check count.
"""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict
from pathlib import Path

PEER = "sdpa"
WINDOW_FIELDS = ("window", "image_width")
WINDOWED = ("local", "causal_local", "sink", "neighborhood", "longformer", "bigbird")


def ok_records(run_dir: Path) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "records.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in records if r["status"] == "ok" and r.get("error")
            and r["error"]["rel_l2"] <= r["error"]["tolerance"]]


def label(params: dict) -> str:
    dtype = params["dtype"].replace("bfloat", "bf").replace("float", "fp")
    parts = [params["pattern"], f"N={params['seq_len']}", dtype]
    for key, short in (("q_len", "q"), ("kv_heads", "Hkv"), ("documents", "docs"), ("window", "w"),
                       ("image_width", "iw"), ("density", "p")):
        value = params.get(key)
        if value is None or (key in WINDOW_FIELDS and params["pattern"] not in WINDOWED) or (
                key == "density" and params["pattern"] not in ("block_random", "random")):
            continue
        parts.append(f"{short}={value if not isinstance(value, list) else len(value)}")
    return " ".join(parts)


def break_even(points: list[tuple[float, float, float]]) -> str:
    """points: (density, impl time, peer time) sorted by density -> where impl stops being faster."""
    faster = [t < p for _, t, p in points]
    if all(faster):
        return f"faster at every swept density (up to {points[-1][0]:.0%})"
    if not faster[0]:
        return f"slower at every swept density (from {points[0][0]:.0%})"
    i = faster.index(False)
    (d0, t0, p0), (d1, t1, p1) = points[i - 1], points[i]
    g0, g1 = math.log(t0 / p0), math.log(t1 / p1)  # log ratio, negative while faster
    return f"{d0 + (d1 - d0) * g0 / (g0 - g1):.0%} (faster at {d0:.0%}, slower at {d1:.0%})"


def report(run_dir: Path) -> None:
    records = ok_records(run_dir)
    run = json.loads((run_dir / "run.json").read_text())
    cpu = run["env"].get("cpu") or {}
    cpu = cpu.get("model", cpu) if isinstance(cpu, dict) else cpu
    print(f"## {run_dir.name} ({len(records)} ok records; cpu: {cpu})")
    by_case: dict[str, dict[str, dict]] = defaultdict(dict)
    for r in records:
        by_case[r["case_id"]][r["impl"]] = r
    sweeps: dict[tuple[str, str], list[tuple[float, float, float]]] = defaultdict(list)
    def order(impls: dict[str, dict]) -> tuple:
        params = next(iter(impls.values()))["params"]
        return (params["pattern"], params["dtype"], params["seq_len"], params.get("density") or 0,
                params.get("q_len") or 0)

    for impls in sorted(by_case.values(), key=order):
        peer = impls.get(PEER)
        any_record = next(iter(impls.values()))
        params = any_record["params"]
        times = {name: r["time_s"]["median"] for name, r in impls.items()}
        row = "  ".join(f"{name} {t * 1e3:.3g} ms" + (f" ({peer['time_s']['median'] / t:.2f}x sdpa's speed)"
                                                      if peer and name != PEER else "")
                        for name, t in sorted(times.items()))
        print(f"- {label(params)}: {row}")
        if params["pattern"] == "block_random" and peer:
            for name, t in times.items():
                if name != PEER:
                    sweeps[(name, params["dtype"])].append((params["density"], t, peer["time_s"]["median"]))
    for (name, dtype), points in sorted(sweeps.items()):
        print(f"- break-even density of {name} against {PEER}, {dtype}: {break_even(sorted(points))}")


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    for arg in argv:
        report(Path(arg))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
