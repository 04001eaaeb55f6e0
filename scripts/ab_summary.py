"""Summarise the runs of scripts/ab_validation.sh: `python ab_summary.py OUT_DIR [--impl NAME]`.

Reads every `bench ab --json` output (NAME.json) and its NAME.meta (exit code, wall time) in OUT_DIR, and
writes summary.json and summary.md: per run the verdict counts, the exit code, the wall time (and its ratio to
the plain `bench run` of the suite, smoke-run.meta), the share of the planted implementation's pairs read
SLOWER and its implementation verdict, everything else flagged, how many pairs got more looks, how many were
left open by the budget and how many were timed on a busy machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.analysis import ab_stats as st


def summarise(name: str, doc: dict[str, Any], meta: dict[str, Any], impl: str, smoke_s: float | None
              ) -> dict[str, Any]:
    pairs = doc["pairs"]
    planted = [p for p in pairs if p["impl"] == impl and p["verdict"] is not None]
    flagged_other = [f"{p['verdict']} {p['impl']} {p['label']} {p['time']['ratio']:.3f}" for p in pairs
                     if p["verdict"] in (st.SLOWER, st.FASTER) and (p["impl"] != impl or name.startswith("aa"))]
    changes = [f"{p['impl']} {p['label']}: {c['figure']} {c['base']} -> {c['new']}" for p in pairs
               for c in p["changes"]]
    ratios = [p["time"]["ratio"] for p in planted if p["time"] and p["time"]["ratio"]]
    impl_verdicts = {v["impl"]: v for v in doc.get("impls", [])}
    mine = impl_verdicts.get(impl, {})
    return {
        "run": name, "exit_code": meta["exit_code"], "wall_s": round(meta["wall_s"], 1),
        "wall_over_smoke_run": round(meta["wall_s"] / smoke_s, 2) if smoke_s else None,
        "pairs": len(pairs), "time_verdicts": sum(p["verdict"] is not None for p in pairs),
        "verdicts": {v: doc["summary"][v] for v in st.VERDICTS},
        "mde_median_pct": doc["summary"]["mde_median_pct"], "threshold_pct": doc["settings"]["threshold_pct"],
        "rounds": doc["settings"]["rounds"], "looks": doc["settings"].get("looks"),
        "budget_s": doc["settings"].get("budget_s"), "left_open": doc["settings"].get("left_open", 0),
        "pairs_looked_again": sum(bool(p["time"]) and p["time"].get("looks", 1) > 1 for p in pairs),
        "busy_pairs": sum(bool(p.get("busy")) for p in pairs),
        "flagged_other": flagged_other, "deterministic_changes": changes,
        f"{impl}_pairs_timed": len(planted),
        f"{impl}_slower": sum(p["verdict"] == st.SLOWER for p in planted),
        f"{impl}_ratio_median": round(statistics.median(ratios), 4) if ratios else None,
        f"{impl}_verdict": mine.get("verdict"), f"{impl}_verdict_ratio": mine.get("ratio"),
        "impl_verdicts": {k: v["verdict"] for k, v in impl_verdicts.items()},
    }


def markdown(rows: list[dict[str, Any]], impl: str, smoke: dict[str, Any] | None) -> str:
    lines = ["# bench ab validation", ""]
    if smoke:
        lines += [f"One plain `bench run` of the suite: {smoke['wall_s']:.0f} s (exit {smoke['exit_code']}).", ""]
    lines += [f"| run | exit | wall s | x bench run | SLOWER | FASTER | SAME | NOISY | AMBIGUOUS | {impl} SLOWER "
              f"| {impl} ratio | {impl} verdict | other flagged | looked again | left open | busy | MDE median |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|"]
    for r in rows:
        v = r["verdicts"]
        lines.append(
            f"| {r['run']} | {r['exit_code']} | {r['wall_s']:.0f} | {r['wall_over_smoke_run'] or '-'} | "
            f"{v['SLOWER']} | {v['FASTER']} | {v['SAME']} | {v['NOISY']} | {v['AMBIGUOUS']} | "
            f"{r[f'{impl}_slower']}/{r[f'{impl}_pairs_timed']} | {r[f'{impl}_ratio_median'] or '-'} | "
            f"{r[f'{impl}_verdict'] or '-'} | {'; '.join(r['flagged_other']) or '-'} | {r['pairs_looked_again']} | "
            f"{r['left_open']} | {r['busy_pairs']} | {r['mde_median_pct'] or 0:.1f}% |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--impl", default="blocked")
    args = parser.parse_args()
    smoke_meta = args.out / "smoke-run.meta"
    smoke = json.loads(smoke_meta.read_text()) if smoke_meta.exists() else None
    rows = []
    for path in sorted(args.out.glob("*.json")):
        if path.name == "summary.json" or not path.with_suffix(".meta").exists():
            continue
        try:
            doc = json.loads(path.read_text())
        except json.JSONDecodeError:
            continue
        if doc.get("schema") != "bench-ab/1":
            continue
        meta = json.loads(path.with_suffix(".meta").read_text())
        rows.append(summarise(path.stem, doc, meta, args.impl, smoke["wall_s"] if smoke else None))
    (args.out / "summary.json").write_text(json.dumps({"smoke_run": smoke, "runs": rows}, indent=1) + "\n")
    (args.out / "summary.md").write_text(markdown(rows, args.impl, smoke))
    print((args.out / "summary.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
