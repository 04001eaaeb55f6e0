"""Writing the dashboard: the index page, one page per suite, and the assets they share.

Output layout (every page works from disk, offline):

    DIR/index.html              runs, suites, environments, commits
    DIR/suite-<name>.html       one per suite (a hash instead of the name when a run.json names it oddly)
    DIR/assets/plotly.min.js    the plotly.js that the installed plotly package ships, written once
    DIR/assets/dashboard.js     lazy drawing and the page filters
    DIR/assets/dashboard.css

Pages are jinja2 templates with autoescaping on; figure data is one JSON element per page, escaped for the
script context, with floats rounded to 5 significant digits and no raw samples.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import jinja2
from plotly.offline import get_plotlyjs

from bench.dashboard.data import FACET_KEYS, Row, current_rows, rows_from_runs
from bench.dashboard.escaping import round_floats, script_json
from bench.dashboard.figures import Colours
from bench.dashboard.suite_page import SuitePage, build_suite_page, suite_file_name
from bench.dashboard.views_history import history_series
from bench.errors import BadInput
from bench.results.index import run_commit, run_fingerprint
from bench.results.records import STATUSES
from bench.results.store import Run

PACKAGE_DIR = Path(__file__).resolve().parent
ASSETS = "assets"


@dataclass
class DashboardResult:
    index: Path
    pages: list[Path]
    figures: int
    runs: int


def _environment() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(PACKAGE_DIR / "templates"), autoescape=True,
                              undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)


def _counts(rows: Sequence[Row]) -> dict[str, int]:
    return {s: n for s in STATUSES if (n := sum(r.status == s for r in rows))}


def _anchor(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:12]


def _when(stamp: str | None) -> str | None:
    """`2026-01-04T03:00:00.000000Z` as `2026-01-04 03:00:00` (UTC); anything else as given."""
    if stamp and len(stamp) >= 19 and stamp[10] == "T":
        return f"{stamp[:10]} {stamp[11:19]}"
    return stamp


def _text(value: Any) -> str:
    return "" if value is None else str(value)


def index_context(runs: Sequence[Run], rows: Sequence[Row], pages: Sequence[SuitePage]) -> dict[str, Any]:
    """Plain values for the index template (the template escapes them)."""
    by_suite = {p.name: p for p in pages}
    suites = []
    for page in pages:
        page_rows = [r for r in rows if r.suite == page.name]
        suites.append({"name": page.name, "file_name": page.file_name, "description": page.description,
                       "n_runs": len(page.runs), "n_commits": len({run_commit(r) for r in page.runs}),
                       "latest": max(r.info.run_id for r in page.runs), "counts": _counts(current_rows(page_rows)),
                       "n_figures": len(page.figures)})
    rows_by_run: dict[tuple[str, str], list[Row]] = {}
    for row in rows:
        rows_by_run.setdefault((row.run_id, row.started_at), []).append(row)
    run_rows = []
    for run in runs:
        info = run.info
        mine = rows_by_run.get((info.run_id, info.started_at), [])
        run_rows.append({"run_id": info.run_id, "suite": info.suite.name,
                         "suite_file": by_suite[info.suite.name].file_name,
                         "started_at": _when(info.started_at), "finished_at": _when(info.finished_at),
                         "commit": (run_commit(run) or "no git")[:12], "dirty": bool(info.env.git.dirty),
                         "fingerprint": run_fingerprint(run), "fingerprint_anchor": _anchor(run_fingerprint(run)),
                         "source": info.source, "devices": list(dict.fromkeys(r.device for r in mine)),
                         "counts": _counts(mine), "path": str(run.path)})
    environments: dict[str, dict[str, Any]] = {}
    for run in runs:
        env = run.info.env
        fp = run_fingerprint(run)
        entry = environments.setdefault(fp, {
            "fingerprint": fp, "anchor": _anchor(fp), "backend": _text(env.backend),
            "cpu": _text(env.cpu.model),
            "gpus": ", ".join(_text(g.name) for g in env.gpus) or "none",
            "versions": ", ".join(f"{k} {v}" for k, v in env.versions.model_dump(by_alias=True).items() if v),
            "hosts": set(), "n_runs": 0})
        entry["hosts"].add(_text(env.host.hostname))
        entry["n_runs"] += 1
    for entry in environments.values():
        entry["hosts"] = ", ".join(sorted(entry["hosts"]))
    commits: dict[str, dict[str, Any]] = {}
    for run in runs:
        commit = run_commit(run) or "(no git)"
        git = run.info.env.git
        entry = commits.setdefault(commit, {"commit": commit, "branches": set(), "first": run.info.started_at,
                                            "n_runs": 0, "suites": {}, "dirty": False})
        if git.branch:
            entry["branches"].add(_text(git.branch))
        entry["first"] = min(entry["first"], run.info.started_at)
        entry["n_runs"] += 1
        entry["dirty"] = entry["dirty"] or bool(git.dirty)
        entry["suites"][run.info.suite.name] = {"name": run.info.suite.name,
                                                "file_name": suite_file_name(run.info.suite.name)}
    commit_list = sorted(commits.values(), key=lambda c: c["first"], reverse=True)
    for entry in commit_list:
        entry["branches"] = ", ".join(sorted(entry["branches"]))
        entry["first"] = _when(entry["first"])
        entry["suites"] = list(entry["suites"].values())
    return {"suites": suites, "runs": run_rows[::-1], "environments": list(environments.values()),
            "commits": commit_list, "warnings": [w for run in runs for w in run.warnings],
            "filters": list(FACET_KEYS)}


def write_assets(out: Path) -> None:
    """plotly.js (only when it changed: it is 4.6 MB), the page script and the style sheet."""
    assets = out / ASSETS
    assets.mkdir(parents=True, exist_ok=True)
    plotly_js = get_plotlyjs().encode("utf-8")
    target = assets / "plotly.min.js"
    if not target.is_file() or target.stat().st_size != len(plotly_js) or target.read_bytes() != plotly_js:
        target.write_bytes(plotly_js)
    for name in ("dashboard.js", "dashboard.css"):
        content = (PACKAGE_DIR / "static" / name).read_bytes()
        if not (assets / name).is_file() or (assets / name).read_bytes() != content:
            (assets / name).write_bytes(content)


def page_data(page: SuitePage) -> str:
    """The page's figure data as script-safe JSON; assigns each figure its id."""
    figures: dict[str, Any] = {}
    for number, figure in enumerate(page.figures):
        figure.id = f"fig{number}"
        figures[figure.id] = round_floats(figure.plotly)
    return script_json({"suite": page.name, "figures": figures})


def build_dashboard(runs: Sequence[Run], out: Path) -> DashboardResult:
    """Render every suite of `runs` and the index into `out`; returns what was written."""
    if not runs:
        raise BadInput("no runs to show; run a suite first (`bench run suites/smoke.yaml`) or pass run directories")
    runs = sorted(runs, key=lambda r: (r.info.started_at, r.info.run_id))
    rows = rows_from_runs(runs)
    colours = Colours(r.impl for r in rows)
    pages = []
    for suite in dict.fromkeys(r.info.suite.name for r in runs):
        suite_runs = [r for r in runs if r.info.suite.name == suite]
        suite_rows = [r for r in rows if r.suite == suite]
        history, commits = history_series(suite_runs, suite_rows, suite)
        pages.append(build_suite_page(suite, suite_runs, suite_rows, history, commits, colours, rows))
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BadInput(f"cannot create the output directory: {exc.strerror}", file=str(out)) from None
    write_assets(out)
    env = _environment()
    common = {"generated_at": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "n_runs": len(runs)}
    written = []
    for page in pages:
        html = env.get_template("suite.html").render(page=page, data_json=page_data(page), **common)
        path = out / page.file_name
        path.write_text(html, encoding="utf-8")
        written.append(path)
    index = out / "index.html"
    index.write_text(env.get_template("index.html").render(**index_context(runs, rows, pages), **common),
                     encoding="utf-8")
    _remove_stale_pages(out, {p.name for p in written})
    return DashboardResult(index, written, sum(len(p.figures) for p in pages), len(runs))


def _remove_stale_pages(out: Path, keep: set[str]) -> None:
    """Suite pages of an earlier render whose suite is gone (only files named as this module names them)."""
    for path in out.glob("suite[-.]*.html"):
        if path.name not in keep:
            path.unlink()
