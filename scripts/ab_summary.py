"""Summarise the runs of scripts/ab_validation.sh: `python ab_summary.py OUT_DIR [--impl NAME]`.

Reads every `bench ab --json` output (NAME.json) and its NAME.meta (exit code, wall time) in OUT_DIR, and
writes summary.json and summary.md: per run the verdict counts, the exit code, the wall time (and its ratio to
the plain `bench run` of the suite, smoke-run.meta), the share of the planted implementation's pairs read
SLOWER, everything else flagged; and the same verdicts recomputed from the saved per-round medians at other
thresholds (the statistics of bench.analysis.ab_stats, Benjamini-Hochberg over the same pairs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.analysis import ab_stats as st
from bench.analysis.stats import benjamini_hochberg, seed_for

THRESHOLDS = (5.0, 10.0)


def recompute(doc: dict[str, Any], threshold_pct: float) -> dict[tuple[str, str], str]:
    """(case_id, impl) -> verdict at `threshold_pct`, from the per-round medians in the JSON."""
    alpha = doc["settings"]["alpha"]
    tests = {}
    for p in doc["pairs"]:
        t = p.get("time")
        values = t and (t.get("round_values_s") or t.get("round_medians_s"))  # (older JSON: block medians)
        if values:
            rounds = [([b], [n]) for b, n in values if b and n]
            tests[(p["case_id"], p["impl"])] = st.paired_test(rounds, seed_for(f"{p['case_id']}|{p['impl']}", 0))
    keys = [k for k, t in tests.items() if t.note is None]
    qs = dict(zip(keys, benjamini_hochberg([tests[k].p_value for k in keys]), strict=True))
    return {k: st.verdict(t, qs.get(k, 1.0), threshold_pct / 100, alpha) for k, t in tests.items()}


def summarise(name: str, doc: dict[str, Any], meta: dict[str, Any], impl: str, smoke_s: float | None
              ) -> dict[str, Any]:
    pairs = doc["pairs"]
    planted = [p for p in pairs if p["impl"] == impl and p["verdict"] is not None]
    flagged_other = [f"{p['verdict']} {p['impl']} {p['label']} {p['time']['ratio']:.3f}" for p in pairs
                     if p["verdict"] in (st.SLOWER, st.FASTER) and (p["impl"] != impl or name.startswith("aa"))]
    changes = [f"{p['impl']} {p['label']}: {c['figure']} {c['base']} -> {c['new']}" for p in pairs
               for c in p["changes"]]
    ratios = [p["time"]["ratio"] for p in planted if p["time"] and p["time"]["ratio"]]
    out: dict[str, Any] = {
        "run": name, "exit_code": meta["exit_code"], "wall_s": round(meta["wall_s"], 1),
        "wall_over_smoke_run": round(meta["wall_s"] / smoke_s, 2) if smoke_s else None,
        "pairs": len(pairs), "time_verdicts": sum(p["verdict"] is not None for p in pairs),
        "verdicts": {v: doc["summary"][v] for v in st.VERDICTS},
        "mde_median_pct": doc["summary"]["mde_median_pct"], "threshold_pct": doc["settings"]["threshold_pct"],
        "rounds": doc["settings"]["rounds"], "flagged_other": flagged_other, "deterministic_changes": changes,
        f"{impl}_pairs_timed": len(planted),
        f"{impl}_slower": sum(p["verdict"] == st.SLOWER for p in planted),
        f"{impl}_ratio_median": round(statistics.median(ratios), 4) if ratios else None,
        "recomputed": {},
    }
    for threshold in THRESHOLDS:
        verdicts = recompute(doc, threshold)
        mine = [v for (c, i), v in verdicts.items() if i == impl]
        others = [f"{v} {i}" for (c, i), v in verdicts.items() if v in (st.SLOWER, st.FASTER)
                  and (i != impl or name.startswith("aa"))]
        out["recomputed"][f"{threshold:g}"] = {
            "verdicts": {v: sum(x == v for x in verdicts.values()) for v in st.VERDICTS},
            f"{impl}_slower": sum(v == st.SLOWER for v in mine), f"{impl}_pairs_timed": len(mine),
            "flagged_other": others}
    return out


def markdown(rows: list[dict[str, Any]], impl: str, smoke: dict[str, Any] | None) -> str:
    lines = ["# bench ab validation", ""]
    if smoke:
        lines += [f"One plain `bench run` of the suite: {smoke['wall_s']:.0f} s (exit {smoke['exit_code']}).", ""]
    lines += [f"| run | exit | wall s | x bench run | SLOWER | FASTER | SAME | NOISY | AMBIGUOUS | {impl} SLOWER "
              f"| {impl} ratio | other flagged | MDE median | at 10%: {impl} SLOWER, others |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|"]
    for r in rows:
        v, ten = r["verdicts"], r["recomputed"]["10"]
        lines.append(
            f"| {r['run']} | {r['exit_code']} | {r['wall_s']:.0f} | {r['wall_over_smoke_run'] or '-'} | "
            f"{v['SLOWER']} | {v['FASTER']} | {v['SAME']} | {v['NOISY']} | {v['AMBIGUOUS']} | "
            f"{r[f'{impl}_slower']}/{r[f'{impl}_pairs_timed']} | {r[f'{impl}_ratio_median'] or '-'} | "
            f"{'; '.join(r['flagged_other']) or '-'} | {r['mde_median_pct'] or 0:.1f}% | "
            f"{ten[f'{impl}_slower']}/{ten[f'{impl}_pairs_timed']}, {'; '.join(ten['flagged_other']) or '-'} |")
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
