"""Terminal output: a progress bar over the sweep, and the summary table at the end.

On a terminal a rich progress bar shows the (case, impl) being measured, elapsed and remaining time; when
output is not a terminal each finished (case, impl) is one plain line, which CI logs keep readable.
"""

from __future__ import annotations

from collections.abc import Iterable

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from bench.console.format import format_seconds
from bench.console.terminal import STATUS_STYLE
from bench.results.records import Fallback, Record

BUSY_MARK = "!"  # a time measured while the machine was busy
ABOVE_ROOF_MARK = "ABOVE THE ROOF:"  # a figure past what the memory or the matmul unit delivers: claims nothing
ROOF_MARK = "^"  # the summary's mark of such a figure


def _above(record: Record) -> bool:
    return record.peak is not None and bool(record.peak.above_roof)


def describe(record: Record) -> str:
    """One line for a finished (case, impl)."""
    if record.status == "ok" and record.time_s:
        extra = " (interpreter)" if record.interpreter else ""
        if record.busy and record.contention is not None:
            extra += f" (busy: {record.contention.reason})"
        if record.peak is not None and record.peak.above_roof:
            extra += f" ({ABOVE_ROOF_MARK} {record.peak.above_roof_reason})"
        return f"ok {format_seconds(record.time_s.median)}{roof(record)}{extra}"
    return f"{record.status}: {record.reason}"


def roof(record: Record) -> str:
    """`, 41% of the memory roof`: the achieved share of the binding roof (`peak.bound`), where it is known."""
    peak = record.peak
    if peak is None or peak.bound is None:
        return ""
    share = peak.bandwidth_fraction if peak.bound == "memory" else peak.fraction
    return f", {share:.0%} of the {peak.bound} roof" if share is not None else ""


class Reporter:
    """Progress over the (case, impl) pairs of a run."""

    def __init__(self, total: int, console: Console) -> None:
        self.console = console
        self.total = total
        self.done = 0
        self.live = console.is_terminal
        self._progress: Progress | None = None
        if self.live:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("elapsed"), TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(),
                console=console, transient=False,
            )
            self._task = self._progress.add_task("starting", total=total)
            self._progress.start()

    def start(self, case_label: str, impl: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, description=f"{case_label} | {impl}")

    def finish(self, case_label: str, record: Record) -> None:
        self.done += 1
        line = f"[{self.done}/{self.total}] {case_label} | {record.impl}: {describe(record)}"
        if self._progress is not None:
            self._progress.console.print(line, markup=False, highlight=False)
            self._progress.advance(self._task)
        else:
            print(line, flush=True)

    def finish_line(self, line: str) -> None:
        """A finished item described by the caller (`bench ab`: a pair of both sides), one line."""
        self.done += 1
        line = f"[{self.done}/{self.total}] {line}"
        if self._progress is not None:
            self._progress.console.print(line, markup=False, highlight=False)
            self._progress.advance(self._task)
        else:  # to the console's own stream (stderr when stdout carries `--json`)
            print(line, file=self.console.file, flush=True)

    def extend(self, more: int) -> None:
        """`more` items beyond those announced (`bench ab`'s later trials; negative: announced, not run)."""
        self.total += more
        if self._progress is not None:
            self._progress.update(self._task, total=self.total)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()


def _cell(r: Record | None) -> tuple[str, str | None]:
    """(text, style) of one pair in the summary: its median time (marked), or its status."""
    if r is None:
        return "-", None
    if r.status == "ok" and r.time_s:
        mark = ("*" if r.interpreter else "") + (BUSY_MARK if r.busy else "") + (ROOF_MARK if _above(r) else "")
        return f"{format_seconds(r.time_s.median)}{mark}", "green"
    return r.status, STATUS_STYLE[r.status]


def summary_table(records: Iterable[Record], case_labels: dict[str, str], impls: list[str],
                  fold_case: bool = False) -> Table:
    """Median time per implementation per case, with the status where a case did not run ok. Cells never wrap;
    `fold_case` folds long case labels (a terminal narrower than a label and one column)."""
    records = list(records)
    by_pair = {(r.case_id, r.impl): r for r in records}
    table = Table(title="median time per call (status where not ok)", show_lines=False)
    table.add_column("case", no_wrap=not fold_case, overflow="fold")
    for name in impls:
        table.add_column(escape(name), justify="right", no_wrap=True)
    for case_id, label in case_labels.items():
        cells = []
        for name in impls:
            text, style = _cell(by_pair.get((case_id, name)))
            cells.append(f"[{style}]{escape(text)}[/]" if style else escape(text))
        table.add_row(escape(label), *cells)
    shown = [r for r in records if r.impl in impls and r.status == "ok"]
    captions = ["* Triton interpreter on CPU: correctness only, not kernel speed"] \
        if any(r.interpreter for r in shown) else []
    if any(r.busy for r in shown):
        captions.append(f"{BUSY_MARK} timed while the machine was busy (record's contention): not to be trusted")
    if any(_above(r) for r in shown):
        captions.append(f"{ROOF_MARK} above the roof (record's peak.above_roof_reason): a figure no call reaches from "
                        "memory, claiming nothing")
    table.caption = "; ".join(captions) or None
    return table


def summary_tables(records: list[Record], case_labels: dict[str, str], impls: list[str], width: int
                   ) -> list[Table]:
    """The summary split into tables that fit `width` columns: the case column, then as many implementation
    columns as fit beside it (each column needs its widest cell plus 3 for padding and its rule), so that no
    cell is wrapped or cut and no column is dropped."""
    by_pair = {(r.case_id, r.impl): r for r in records}
    case_w = max([len("case"), *(len(label) for label in case_labels.values())]) + 3
    fold = case_w + 1 + 12 > width  # not even one short column beside the labels: fold them
    case_w = min(case_w, max(12, width // 2)) if fold else case_w
    groups: list[list[str]] = [[]]
    used = 1 + case_w
    for name in impls:
        w = max([len(name), *(len(_cell(by_pair.get((c, name)))[0]) for c in case_labels)]) + 3
        if groups[-1] and used + w > width:
            groups.append([])
            used = 1 + case_w
        groups[-1].append(name)
        used += w
    return [summary_table(records, case_labels, group, fold_case=fold) for group in groups if group]


def busy_line(records: list[Record]) -> str | None:
    """`3 of 12 measured pairs were timed on a busy machine`, or None when none was."""
    measured = [r for r in records if r.contention is not None]
    busy = sum(r.busy for r in measured)
    if not busy:
        return None
    return f"{busy} of {len(measured)} measured pairs were timed on a busy machine (marked {BUSY_MARK}); their times " \
           "are not to be trusted"


def fallback_lines(records: list[Record]) -> list[str]:
    """One line per implementation that measured a slower path under its own name (`config.fallback`): how many of
    its pairs, which path, and the first reason."""
    by_impl: dict[str, list[Fallback]] = {}
    for r in records:
        fallback = r.fallback
        if fallback is not None:
            by_impl.setdefault(r.impl, []).append(fallback)
    lines = []
    for impl, seen in by_impl.items():
        paths = sorted({str(f.path) for f in seen})
        measured = sum(r.impl == impl and r.status in ("ok", "incorrect") for r in records)
        lines.append(f"{impl} FELL BACK in {len(seen)} of {measured} measured pairs (path {', '.join(paths)}): "
                     f"{seen[0].reason}")
    return lines


def print_summary(console: Console, records: list[Record], case_labels: dict[str, str], impls: list[str]) -> None:
    for table in summary_tables(records, case_labels, impls, console.width):
        console.print(table)
    counts = {s: sum(r.status == s for r in records) for s in STATUS_STYLE}
    console.print(", ".join(f"{n} {s}" for s, n in counts.items()))
    line = busy_line(records)
    if line is not None:
        console.print(f"[yellow]{line}[/]", highlight=False)
    for fallback in fallback_lines(records):
        console.print(f"[yellow]{escape(fallback)}[/]", highlight=False)
    above = [r for r in records if _above(r)]
    if above:
        console.print(f"[yellow]{len(above)} record(s) above the roof (marked {ROOF_MARK}): no target, speed-up or "
                      "gain is claimed from them[/]", highlight=False)
    for r in records:
        if r.status in ("failed", "incorrect"):
            console.print(f"[{STATUS_STYLE[r.status]}]{r.status}[/] {escape(r.case_id)} {escape(r.impl)}: "
                          f"{escape(r.reason or '')}", highlight=False)
