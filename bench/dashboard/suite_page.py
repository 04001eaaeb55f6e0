"""One suite's page: its facets (pattern, dtype, mode, device, workload), each with the figures its records support
and a line saying which views have no data there and why."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from bench.dashboard.data import FACET_KEYS, Facet, Row, current_rows, facets
from bench.dashboard.figures import Colours, Figure
from bench.dashboard.views_breakeven import breakeven_figures
from bench.dashboard.views_comm import comm_figure
from bench.dashboard.views_comm_balance import balance_figures
from bench.dashboard.views_correctness import correctness_figure
from bench.dashboard.views_harness import harness_figure
from bench.dashboard.views_history import HistorySeries, history_figure
from bench.dashboard.views_inputs import inputs_figure
from bench.dashboard.views_links import links_figure
from bench.dashboard.views_memory import memory_figure, peak_figure
from bench.dashboard.views_quality import front_figure, significance_table
from bench.dashboard.views_roofline import decode_figure, roofline_figure
from bench.dashboard.views_selection import selection_share_figure, time_recall_figures
from bench.dashboard.views_time import speedup_figure, time_figure
from bench.dashboard.views_training import training_figure
from bench.results.records import STATUSES
from bench.results.store import Run

SUITE_NAME_RE = re.compile(r"[a-z0-9_-]{1,64}")


def suite_file_name(name: str) -> str:
    """The page of a suite: `suite-<name>.html` for a valid name, else a hash (a run.json may say anything).

    The two forms cannot collide: '.' is not allowed in suite names.
    """
    if SUITE_NAME_RE.fullmatch(name):
        return f"suite-{name}.html"
    return f"suite.{hashlib.sha256(name.encode('utf-8', 'surrogatepass')).hexdigest()[:16]}.html"


@dataclass
class Section:
    """One facet of a suite page."""

    pattern: str
    dtype: str
    mode: str
    device: str
    workload: str  # data.workload: "MHA H8", "GQA H32/8 · q_len 1"
    rows: list[Row]
    figures: list[Figure] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # views not drawn here, with the reason

    @property
    def key(self) -> Facet:
        return (self.pattern, self.dtype, self.mode, self.device, self.workload)

    def facet_values(self) -> dict[str, str]:
        """Each facet key with this section's value: the page's filters match on them."""
        return dict(zip(FACET_KEYS, self.key, strict=True))

    @property
    def title(self) -> str:
        return " · ".join(self.key)

    @property
    def modelled_only(self) -> bool:
        return all(r.modelled for r in self.rows)

    @property
    def counts(self) -> dict[str, int]:
        return {s: n for s in STATUSES if (n := sum(r.status == s for r in self.rows))}


@dataclass
class SuitePage:
    name: str
    file_name: str
    description: str | None
    runs: list[Run]
    sections: list[Section]
    lead: list[Figure] = field(default_factory=list)  # figures above the facets: the speed-quality front

    def filter_values(self) -> dict[str, list[str]]:
        """The values each page control can take, in the order the sections show them."""
        return {key: list(dict.fromkeys(s.facet_values()[key] for s in self.sections)) for key in FACET_KEYS}

    @property
    def figures(self) -> list[Figure]:
        return [*self.lead, *(f for s in self.sections for f in s.figures)]


MISSING = {
    "time": "time: no ok record with a time",
    "speedup": "speedup: needs dense (or sdpa) and another implementation on the same cases",
    "memory": "memory: no record with a memory figure or an unmeasured case",
    "comm": "communication: no record counted bytes (distributed implementations, world_size > 1)",
    "links": "bytes between nodes: no record's ranks ran on more than one node",
    "breakeven": "break-even: needs a density sweep (2 densities or more) with dense or sdpa",
    "peak": "fraction of peak: no record carries a hardware peak",
    "history": "history: measured at one commit only",
}


def section_figures(section: Section, history: Sequence[HistorySeries], commits: Sequence[str],
                    colours: Colours) -> None:
    rows = section.rows
    builders: list[tuple[str, Callable[[], list[Figure]]]] = [
        ("time", lambda: _one(time_figure(rows, colours))),
        ("speedup", lambda: _one(speedup_figure(rows))),
        ("memory", lambda: _one(memory_figure(rows, colours))),
        ("comm", lambda: _one(comm_figure(rows, colours))),
        ("links", lambda: _one(links_figure(rows, colours))),
        ("balance", lambda: balance_figures(rows, colours)),
        ("breakeven", lambda: breakeven_figures(rows, colours)),
        ("peak", lambda: _one(peak_figure(rows, colours))),
        ("roofline", lambda: _one(roofline_figure(rows, colours))),
        ("decode", lambda: _one(decode_figure(rows, colours))),
        ("correctness", lambda: _one(correctness_figure(rows))),
        ("inputs", lambda: _one(inputs_figure(rows))),
        ("selection", lambda: time_recall_figures(rows, colours)),
        ("selection_share", lambda: _one(selection_share_figure(rows, colours))),
        ("harness", lambda: _one(harness_figure(rows))),
        ("history", lambda: _one(history_figure(history, commits, colours))),
    ]
    for view, build in builders:
        figures = build()
        section.figures += figures
        if not figures and view in MISSING:
            section.missing.append(_missing(view, rows))


def _missing(view: str, rows: Sequence[Row]) -> str:
    if view == "memory" and any(r.status == "ok" and r.peak_bytes is not None for r in rows):
        return ("memory: every measured peak was <= 0 bytes above the inputs (the allocator reused memory); "
                "nothing to draw on a log axis")
    return MISSING[view]


def _one(figure: Figure | None) -> list[Figure]:
    return [figure] if figure is not None else []


def lead_figures(rows: Sequence[Row], store_rows: Sequence[Row], colours: Colours) -> list[Figure]:
    """The speed-quality fronts (one per model, task, length and dtype), x also from the store's largest shape of
    the same selectors where it has one; the budgets table; the training curves."""
    scored = [r for r in rows if r.quality is not None]
    groups: dict[tuple[str, str, int, str], list[Row]] = {}
    for r in rows:
        if r.params.get("model") is not None:
            key = (str(r.params["model"]), str(r.params.get("task")), int(r.params["seq_len"]), str(r.params["dtype"]))
            groups.setdefault(key, []).append(r)
    figures: list[Figure] = []
    for key in sorted(groups, key=lambda k: (k[0], k[1], -k[2], k[3])):  # the longest first
        figures += _one(front_figure(groups[key], colours))
        larger = larger_shape_rows(groups[key], store_rows)
        if larger:
            figures += _one(front_figure(groups[key], colours, larger[0], larger[1]))
    figures += _one(significance_table(scored))
    figures += _one(training_figure(rows))
    return figures


def larger_shape_rows(rows: Sequence[Row], store_rows: Sequence[Row]) -> tuple[list[Row], str] | None:
    """The store's rows without a model at the largest seq_len above this group's, of one run holding the same
    selectors (its name and shape for the caption); None where there are none."""
    selectors = {r.selection.selector for r in rows if r.selection is not None}
    n = max(int(r.params["seq_len"]) for r in rows)
    candidates = [r for r in store_rows if r.params.get("model") is None and r.selection is not None
                  and r.selection.selector in selectors and int(r.params.get("seq_len", 0)) > n]
    if not candidates:
        return None
    best = max(candidates, key=lambda r: (int(r.params["seq_len"]), r.started_at))
    run_rows = [r for r in store_rows if r.run_id == best.run_id and int(r.params["seq_len"]) == best.params["seq_len"]
                and r.params.get("model") is None]
    return run_rows, f"run {best.run_id}, N={best.params['seq_len']} {best.workload}"


def build_suite_page(name: str, runs: Sequence[Run], rows: Sequence[Row], history: Sequence[HistorySeries],
                     commits: Sequence[str], colours: Colours, store_rows: Sequence[Row] = ()) -> SuitePage:
    """`rows`: every row of this suite (all runs, oldest first); the sections show the current ones; `store_rows`:
    every row of the dashboard (a front may take its times from another suite's larger shape)."""
    latest_run = max(runs, key=lambda r: (r.info.started_at, r.info.run_id))
    description = latest_run.info.suite.content.get("description")
    sections = []
    for key, members in facets(current_rows(rows)).items():
        section = Section(*key, members)
        in_facet = [h for h in history if h.facet == key]
        section_figures(section, in_facet, commits, colours)
        sections.append(section)
    sections.sort(key=lambda section: section.modelled_only)  # measurements first, models after (stable)
    lead = lead_figures(current_rows(rows), current_rows(store_rows), colours)
    return SuitePage(name, suite_file_name(name), None if description is None else str(description), list(runs),
                     sections, lead)
