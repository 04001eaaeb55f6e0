"""The figures [R2 4/6] sets targets for, from a run of suites/cpu.yaml (matmul calibrated in the same run).

    python scripts/cpu_targets.py results/<run_id>

For local W=256, causal_local W=1024 and block_random p=0.1 in float32 and bfloat16 at every swept N and shape:
the best of our sparse CPU implementations (csr, blocked) as a multiple of compiled flex's speed (flex's time /
ours) and of sdpa's, and its useful FLOP rate as a share of the calibrated matmul rate of that dtype. Then, per
case at N >= 4096, the oracle check's share of the case's time (sum of check_s over the sum of wall_s of the
case's pairs) and what the fresh-process memory measurement cost. Only records that passed the oracle count.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

OURS = ("csr", "blocked")
TARGETS = {("local", 256), ("causal_local", 1024), ("block_random", None)}


def main(run_dir: Path) -> None:
    run = json.loads((run_dir / "run.json").read_text())
    rates = {dtype: m["flops_per_s"] for dtype, m in run["env"]["calibration"]["matmul"].items()}
    print(f"{run['run_id']}: {run['env']['cpu']['model']}, {run['env']['cpu']['torch_threads']} torch threads; "
          + ", ".join(f"{d} matmul {r / 1e9:.0f} GFLOP/s" for d, r in rates.items()))
    records = [json.loads(line) for line in (run_dir / "records.jsonl").read_text().splitlines() if line.strip()]
    by_case: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        by_case[r["case_id"]].append(r)

    print("\n| pattern | dtype | shape | N | best ours | ms | x flex | x sdpa | share of matmul |")
    print("|---|---|---|---|---|---|---|---|---|")
    for pairs in by_case.values():
        p = pairs[0]["params"]
        window = p["window"] if p["pattern"] != "block_random" else None
        if (p["pattern"], window) not in TARGETS or (p["pattern"] == "block_random" and p["density"] != 0.1):
            continue
        ok = {r["impl"]: r for r in pairs if r["status"] == "ok"}
        ours = [ok[i] for i in OURS if i in ok]
        if not ours:
            continue
        best = min(ours, key=lambda r: r["time_s"]["median"])
        t = best["time_s"]["median"]
        ratio = {peer: ok[peer]["time_s"]["median"] / t if peer in ok else None for peer in ("flex", "sdpa")}
        share = best["flops"] / t / rates[p["dtype"]]
        shape = f"H{p['heads']}/{p.get('kv_heads') or p['heads']} D{p['head_dim']}"
        cells = [f"{ratio[k]:.2f}x" if ratio[k] else "-" for k in ("flex", "sdpa")]
        print(f"| {p['pattern']} | {p['dtype']} | {shape} | {p['seq_len']} | {best['impl']} | {t * 1e3:.1f} | "
              f"{cells[0]} | {cells[1]} | {share:.1%} |")

    print("\n| case (N >= 4096) | wall s | check s | check share | memory s |")
    print("|---|---|---|---|---|")
    for pairs in by_case.values():
        p = pairs[0]["params"]
        if p["seq_len"] < 4096:
            continue
        wall = sum(r.get("wall_s") or 0 for r in pairs)
        check = sum(r.get("check_s") or 0 for r in pairs)
        memory = sum(r.get("memory_s") or 0 for r in pairs)
        shape = f"p={p['density']}" if p["pattern"] == "block_random" else f"W={p['window']}"
        name = f"{p['pattern']} {shape} N={p['seq_len']} {p['dtype']} H{p['heads']}/{p.get('kv_heads') or p['heads']}"
        print(f"| {name} | {wall:.1f} | {check:.2f} | {check / wall:.1%} | {memory:.1f} |")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(Path(sys.argv[1]))
