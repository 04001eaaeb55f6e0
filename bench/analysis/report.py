"""Terminal rendering of a `bench compare` result, the answer first: the verdict, the regressions, the pairs whose
time changed and the path changes; every pair and every figure change only with `--all`. Warnings are one line
each; a note repeated over pairs is printed once with its count."""

from __future__ import annotations

import math
from typing import Literal

from rich.console import Console, Group, RenderableType
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from bench.analysis import stats as cs
from bench.analysis.compare import Comparison, PairResult, iter_changes
from bench.console.format import format_p, format_seconds

VERDICT_STYLE = {cs.SLOWER: "bold red", cs.FASTER: "bold green", cs.SAME: "dim", cs.AMBIGUOUS: "yellow",
                 cs.NOISY: "yellow", cs.PATH: "magenta"}
KIND_STYLE = {"regression": "bold red", "improvement": "green", "change": "yellow", "worse": "red", "better": "green"}


def _ratio(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{x:.3f}"


def _verdict_cell(pair: PairResult) -> str:
    if pair.verdict is None:
        return "-"
    text = f"[{VERDICT_STYLE[pair.verdict]}]{pair.verdict}[/]"
    if not pair.time_comparable:
        return f"{text} [red](not comparable)[/]"
    return f"{text} [dim](advisory)[/]" if pair.time_advisory and pair.verdict in (cs.SLOWER, cs.FASTER) else text


def time_table(comparison: Comparison, width: int | None = None, pairs: list[PairResult] | None = None,
               title: str = "time per call, NEW vs BASE") -> Table | Group:
    """The time verdicts of `pairs` (default: every pair). Where the columns do not fit `width`, case and
    implementation share one folded first column (the case above, the implementation below) so that no figure
    column is cut or dropped."""
    c = comparison
    table = Table(title=f"{title} (threshold {c.threshold_pct:g}%, "
                        f"{cs.CONFIDENCE:.0%} bootstrap interval, Mann-Whitney U, BH-corrected at {c.alpha:g})")
    columns: tuple[tuple[str, Literal["left", "right"]], ...] = (
        ("case", "left"), ("impl", "left"), ("base", "right"), ("new", "right"),
                          ("ratio", "right"), ("interval", "right"), ("p", "right"), ("q", "right"),
                          ("verdict", "left"))
    rows: list[list[str]] = []
    for pair in c.pairs if pairs is None else pairs:
        if pair.time is None:
            status = pair.new_status if pair.base_status == pair.new_status else \
                f"{pair.base_status} -> {pair.new_status}"
            rows.append([escape(pair.case_id), escape(pair.impl), "", "", "", "", "", "",
                         f"[dim]{escape(status)}[/]" if not c.deterministic_only else "-"])
            continue
        t = pair.time
        interval = "-" if not math.isfinite(t.ci_low) else f"[{t.ci_low:.3g}, {t.ci_high:.3g}]"
        rows.append([escape(pair.case_id), escape(pair.impl), format_seconds(t.median_base),
                     format_seconds(t.median_new), _ratio(t.ratio), escape(interval), format_p(t.p_value),
                     format_p(pair.q_value), _verdict_cell(pair)])
    widest = [max([len(name), *(Text.from_markup(row[i]).cell_len for row in rows)])
              for i, (name, _) in enumerate(columns)]
    if width is not None and 1 + 15 + sum(w + 3 for w in widest[2:]) > width:
        # not even the figures fit beside a folded case: one block per pair, each figure glued to its name by a
        # no-break space, so the lines wrap between figures
        blocks: list[RenderableType] = [Text(table.title if isinstance(table.title, str) else "", style="bold")]
        for row in rows:
            figures = "  ".join(f"{name}\u00a0{cell}" for (name, _), cell in zip(columns[2:], row[2:], strict=True)
                                if cell and name != "verdict")
            blocks.append(Text.from_markup(f"{row[0]} | {row[1]}\n    {figures}  {row[-1]}"))
        return Group(*blocks)
    if width is not None and 1 + sum(w + 3 for w in widest) > width:
        columns = (("case / impl", "left"), *columns[2:])
        rows = [[f"{row[0]}\n  {row[1]}", *row[2:]] for row in rows]
        widest = [0, *widest[2:]]
        table.show_lines = True  # two-line rows: rules keep each pair's lines together
    for (name, justify), w in zip(columns, widest, strict=True):
        if name.startswith("case"):  # the one column that gives way: folded, never cut or dropped
            table.add_column(name, justify=justify, overflow="fold", min_width=12)
        else:
            table.add_column(name, justify=justify, no_wrap=True, min_width=w)
    for row in rows:
        table.add_row(*row)
    return table


def _value(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def changes_table(comparison: Comparison, kinds: tuple[str, ...] | None = None) -> Table | None:
    """The deterministic figures that changed past their tolerance (only those of `kinds` when given)."""
    rows = [(p, ch) for p, ch in iter_changes(comparison) if kinds is None or ch.kind in kinds]
    if not rows:
        return None
    table = Table(title="deterministic figures that changed (floats past their tolerance, the rest exactly)")
    for name in ("case", "impl", "figure", "base", "new", "kind"):  # a long figure name folds, never cut
        table.add_column(name, no_wrap=name == "case", overflow="fold")
    for pair, change in rows:
        table.add_row(escape(pair.case_id), escape(pair.impl), change.figure, escape(_value(change.base)),
                      escape(_value(change.new)), f"[{KIND_STYLE[change.kind]}]{change.kind}[/]")
    return table


def aggregated(lines: list[str]) -> list[str]:
    """Each distinct line once, with `(xN)` where it was repeated; first-seen order."""
    counts: dict[str, int] = {}
    for line in lines:
        counts[line] = counts.get(line, 0) + 1
    return [line if n == 1 else f"{line} (x{n})" for line, n in counts.items()]


def pair_notes(c: Comparison) -> list[str]:
    """Per-pair notes, one line per distinct note: the pair named where one pair has it, the count otherwise."""
    by_note: dict[str, list[PairResult]] = {}
    for pair in c.pairs:
        for note in pair.notes:
            by_note.setdefault(note, []).append(pair)
    return [f"{pairs[0].case_id} | {pairs[0].impl}: {note}" if len(pairs) == 1 else f"{len(pairs)} pairs: {note}"
            for note, pairs in by_note.items()]


MISSING_SHOWN = 5  # pairs on one side only listed without --all
CHANGES_SHOWN = 20  # past this many figure changes, only regressions are listed without --all; the rest counted


def print_comparison(comparison: Comparison, console: Console, err_console: Console, show_all: bool = False) -> None:
    c = comparison
    for warning in aggregated(c.warnings):
        err_console.print(f"[bold red]WARNING:[/] {escape(warning)}")
    console.print(summary_line(c))
    console.print(f"base: {escape(c.base.label)} ({', '.join(r.info.run_id for r in c.base.runs)})")
    console.print(f"new:  {escape(c.new.label)} ({', '.join(r.info.run_id for r in c.new.runs)})")
    regressions = c.regressions()
    if regressions:
        console.print(time_table(c, console.width, regressions, "REGRESSIONS"))
    if not c.deterministic_only:
        if show_all:
            console.print(time_table(c, console.width))
        else:
            moved = [p for p in c.pairs if p.verdict in (cs.SLOWER, cs.FASTER) and p not in regressions]
            if moved and c.time_comparable and not c.time_advisory:  # verdicts that gate: the gains too
                console.print(time_table(c, console.width, moved, "time changes"))
            elif moved:  # advisory or across machines: counted, the largest named
                worst = max(moved, key=lambda p: abs(math.log(p.time.ratio)) if p.time and p.time.ratio > 0 else 0)
                ratio = worst.time.ratio if worst.time else math.nan
                console.print(f"{len(moved)} time verdicts SLOWER or FASTER that cannot fail this comparison "
                              f"({'environments differ' if not c.time_comparable else 'advisory'}; the largest: "
                              f"{escape(worst.case_id)} | {escape(worst.impl)} x{ratio:.2f}); --all lists them",
                              highlight=False)
    n_changes = sum(len(p.changes) for p in c.pairs)
    table = changes_table(c, None if show_all or n_changes <= CHANGES_SHOWN else ("regression", "worse"))
    if table is not None:
        console.print(table)
    if not show_all and n_changes > CHANGES_SHOWN:
        console.print(f"{n_changes} deterministic changes past their tolerance, by figure: "
                      f"{', '.join(aggregated([ch.figure for _, ch in iter_changes(c)]))} (--all lists them)",
                      highlight=False)
    for label, missing in (("only in BASE", c.only_base), ("only in NEW", c.only_new)):
        if missing:
            console.print(f"[yellow]{label}[/] ({len(missing)} pairs, not compared)"
                          f"{':' if show_all or len(missing) <= MISSING_SHOWN else f'; the first {MISSING_SHOWN}:'}")
            for case_id, impl, status in missing if show_all else missing[:MISSING_SHOWN]:
                console.print(f"  {escape(case_id)} | {escape(impl)} ({status})", highlight=False)
    modelled = len(c.base.modelled) + len(c.new.modelled)
    if modelled:
        console.print(f"[magenta]{modelled} modelled records set aside[/] (models, not measurements; not compared)")
    for note in [*c.notes, *pair_notes(c)]:
        console.print(f"[cyan]note:[/] {escape(note)}", highlight=False)
    if not show_all:
        console.print(f"[dim]{len(c.pairs)} pairs compared; --all lists every pair and every figure change[/]")
    console.print(summary_line(c))


def summary_line(c: Comparison) -> str:
    counts = c.verdict_counts()
    n_changes = sum(len(p.changes) for p in c.pairs)
    time_part = "time not compared (--deterministic-only)" if c.deterministic_only else \
        ", ".join(f"{n} {v}" for v, n in counts.items() if n)
    if not c.time_comparable and not c.deterministic_only:
        time_part += " (time verdicts not comparable: environments differ)"
    elif c.time_advisory:
        time_part += " (advisory: see the note; `bench ab` gives time verdicts that gate)"
    regressions = c.regressions()
    outcome = (f"[bold red]REGRESSION[/] in {len(regressions)} pairs (exit 1)" if regressions
               else "[green]no regression[/] (exit 0)")
    return (f"{outcome}: {len(c.pairs)} pairs compared: {time_part}; {n_changes} deterministic changes; "
            f"{len(c.only_base)} only in BASE, {len(c.only_new)} only in NEW")
