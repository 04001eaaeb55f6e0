"""Print one short table from several run directories (the GPU check's suites): median time per case per
implementation, and triton_block_sparse's time over each peer's on the same case (< 1: ours is faster).

Usage: python scripts/gpu_summary.py RUN_DIR [RUN_DIR ...]
Records of the same case from different runs (same case_id) share a row. A run cut short shows `-`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from rich.table import Table

from bench.console.terminal import make_console
from bench.results.records import Record
from bench.results.store import RECORDS, read_records, read_run_info
from bench.run.console import summary_table
from bench.spec.case import Case

OURS = "triton_block_sparse"


def load(run_dirs: list[Path]) -> tuple[list[Record], dict[str, str], list[str], list[str]]:
    """(records, case labels by case_id in suite order, impls in suite order, notes)."""
    records: list[Record] = []
    labels: dict[str, str] = {}
    impls: list[str] = []
    notes: list[str] = []
    for run_dir in run_dirs:
        info = read_run_info(run_dir)
        run_records = read_records(run_dir / RECORDS).records
        records += run_records
        for name in info.suite.content.get("impls", []):
            if name not in impls:
                impls.append(name)
        for r in run_records:
            labels.setdefault(r.case_id, Case(**r.params).label)
        if info.finished_at is None:
            notes.append(f"{run_dir}: not finished ({len(run_records)} records); "
                         f"finish it with: bench run {info.suite.file} --resume {run_dir}")
    measured = {r.impl for r in records}
    return records, labels, [name for name in impls if name in measured], notes


def ratio_table(records: list[Record], labels: dict[str, str], impls: list[str]) -> Table | None:
    peers = [name for name in impls if name != OURS]
    ok = {(r.case_id, r.impl): r for r in records if r.status == "ok" and r.time_s}
    if not peers or not any(key[1] == OURS for key in ok):
        return None
    table = Table(title=f"{OURS} time / peer time on the same case (< 1: {OURS} is faster)")
    table.add_column("case", no_wrap=True)
    for name in peers:
        table.add_column(name, justify="right")
    interpreted = False
    for case_id, label in labels.items():
        ours = ok.get((case_id, OURS))
        cells = []
        for peer in peers:
            theirs = ok.get((case_id, peer))
            if ours is None or theirs is None:
                cells.append("-")
                continue
            mark = "*" if ours.interpreter or theirs.interpreter else ""
            interpreted |= bool(mark)
            cells.append(f"{ours.time_s.median / theirs.time_s.median:.2f}{mark}")
        table.add_row(label, *cells)
    if interpreted:
        table.caption = "* a Triton interpreter time: not a kernel speed, the ratio means nothing"
    return table


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    records, labels, impls, notes = load([Path(a) for a in argv])
    console = make_console()
    console.print(summary_table(records, labels, impls))
    ratios = ratio_table(records, labels, impls)
    if ratios is not None:
        console.print(ratios)
    counts = {s: sum(r.status == s for r in records) for s in ("ok", "skipped", "failed", "incorrect")}
    console.print(", ".join(f"{n} {s}" for s, n in counts.items()))
    for r in records:
        if r.status in ("failed", "incorrect"):
            console.print(f"{r.status}: {r.case_id} {r.impl}: {r.reason}", markup=False)
    for note in notes:
        console.print(note, markup=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
