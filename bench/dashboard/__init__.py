"""`bench dashboard [RUN_DIR ...] [-o DIR]`: Plotly HTML pages of the results, offline and self-contained.

Modules: `data` (runs -> tidy rows, facets, series), `figures` (provenance, styles, the Figure container),
one `views_*` module per group of views, `suite_page` (a suite's sections), `render` (pages, index, assets),
`escaping` (results are data: HTML, plotly text and script-JSON escaping).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from bench.dashboard.render import DashboardResult, build_dashboard
from bench.results.index import load_index, load_runs
from bench.results.store import check_output_dir

__all__ = ["DashboardResult", "build_dashboard", "dashboard_command"]


def dashboard_command(run_dirs: Sequence[str], out: Path, results: Path, console: Console) -> int:
    """Render the given run directories (default: every run in `results`) into `out` (made if missing, in an
    existing directory, as `bench export -o` and `bench run --out` ask)."""
    check_output_dir(out, "-o", "the directory the pages go in")
    runs = load_runs(Path(p) for p in run_dirs) if run_dirs else load_index(results).runs
    result = build_dashboard(runs, out)
    for warning in (w for run in runs for w in run.warnings):
        console.print(f"[yellow]warning:[/] {escape(warning)}")
    console.print(f"dashboard: {len(result.pages)} suite page(s), {result.figures} figures from {result.runs} run(s); "
                  f"open {escape(str(result.index))}")
    return 0
