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
from bench.dashboard.views_history import HistorySeries, history_figure
from bench.dashboard.views_inputs import inputs_figure
from bench.dashboard.views_links import links_figure
from bench.dashboard.views_memory import memory_figure, peak_figure
from bench.dashboard.views_roofline import decode_figure, roofline_figure
from bench.dashboard.views_selection import selection_share_figure, time_recall_figure
from bench.dashboard.views_time import speedup_figure, time_figure
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

    def filter_values(self) -> dict[str, list[str]]:
        """The values each page control can take, in the order the sections show them."""
        return {key: list(dict.fromkeys(s.facet_values()[key] for s in self.sections)) for key in FACET_KEYS}

    @property
    def figures(self) -> list[Figure]:
        return [f for s in self.sections for f in s.figures]


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
        ("selection", lambda: _one(time_recall_figure(rows, colours))),
        ("selection_share", lambda: _one(selection_share_figure(rows, colours))),
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


def build_suite_page(name: str, runs: Sequence[Run], rows: Sequence[Row], history: Sequence[HistorySeries],
                     commits: Sequence[str], colours: Colours) -> SuitePage:
    """`rows`: every row of this suite (all runs, oldest first); the sections show the current ones."""
    latest_run = max(runs, key=lambda r: (r.info.started_at, r.info.run_id))
    description = latest_run.info.suite.content.get("description")
    sections = []
    for key, members in facets(current_rows(rows)).items():
        section = Section(*key, members)
        in_facet = [h for h in history if h.facet == key]
        section_figures(section, in_facet, commits, colours)
        sections.append(section)
    return SuitePage(name, suite_file_name(name), None if description is None else str(description), list(runs),
                     sections)
