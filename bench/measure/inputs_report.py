"""`bench inputs SUITE.yaml [--case N]`: what each case's inputs make of dense attention, before measuring.

For each case (or the one asked for) the inputs are made as a run makes them and the attention statistics of
`bench.measure.oracle.attention_stats` are computed on the oracle's rows: how much of a row's mass its top 1/5/10% of
keys and top 5% of key blocks hold, its entropy, the sinks' share, and how the heads differ. Random inputs
show flat rows (top 5% of keys ~ 27% of the mass); structured and captured inputs show what selectors work on.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from bench.errors import BadInput
from bench.measure.case.steps import make_inputs
from bench.measure.oracle.attention_stats import STAT_NAMES, attention_statistics
from bench.measure.oracle.check import checked_rows
from bench.spec.case import Case, resolve_device
from bench.spec.suite import load_suite

HEADERS = {"top1_mass": "top 1% keys", "top5_mass": "top 5% keys", "top10_mass": "top 10% keys",
           "block_top5_mass": "top 5% blocks", "entropy": "entropy (nats)", "sink_mass": "first 4 keys"}


def case_statistics(case: Case) -> dict[str, Any]:
    """The case's inputs made as a run makes them, and their attention statistics (with `by_head`)."""
    made = make_inputs(case)
    stats = attention_statistics(made.q, made.k, case.make_pattern(), checked_rows(case), case.block_size)
    return {"case_id": case.case_id, "label": case.label, "inputs": made.info().model_dump(), **stats}


def _cell(summary: dict[str, float]) -> str:
    if math.isnan(summary["mean"]):
        return "-"
    return f"{summary['mean']:.3g} [{summary['p5']:.3g}..{summary['p95']:.3g}]"


def inputs_command(suite_path: Path, index: int | None, device: str | None, as_json: bool, console: Console) -> int:
    """Print (or write as JSON) the statistics of the suite's cases' inputs; returns the exit code."""
    suite = load_suite(suite_path)
    if index is not None and not 0 <= index < len(suite.cases):
        raise BadInput(f"got {index}; the suite has {len(suite.cases)} cases: 0 to {len(suite.cases) - 1} "
                       "(`bench run SUITE --dry-run` lists them)", file=str(suite_path), field="--case")
    indices = [index] if index is not None else list(range(len(suite.cases)))
    results = []
    for i in indices:
        case = suite.cases[i]
        results.append({"case": i, **case_statistics(case.with_device(resolve_device(device or case.device)))})
    if as_json:
        print(json.dumps(results, indent=2))
        return 0
    table = Table(title=escape(f"attention of dense {suite.name} cases on their inputs: mean [p5..p95] over rows"))
    table.add_column("case", justify="right")
    table.add_column("case label")
    for name in STAT_NAMES:
        table.add_column(HEADERS[name], justify="right")
    table.add_column("heads: top 5% keys", justify="right")
    for result in results:
        by_head = [x for x in result["by_head"]["top5_mass"] if not math.isnan(x)]
        spread = f"{min(by_head):.2f}..{max(by_head):.2f}" if by_head else "-"
        cells = [escape(_cell(result[name])) for name in STAT_NAMES]
        table.add_row(str(result["case"]), escape(result["label"]), *cells,
                      spread)
    console.print(table)
    console.print("rows: the oracle's (all of them up to 2^24 score elements, else a seeded sample); a row's top p% "
                  "is of the keys its pattern allows it. Random inputs give flat rows.")
    return 0
