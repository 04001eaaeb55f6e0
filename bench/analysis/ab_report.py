"""What a person reads of a `bench ab` result: the terminal (or CI log) report, and the Markdown summary.

Regressions and improvements come first, then one note per kind (never one per pair), then one summary line.
Lines are built to fit the width (100 columns in a 100-column terminal; case labels are shortened by the words
every label shares, which are printed once), and what does not fit goes on an indented continuation line:
nothing is cut, no ratio truncated. `--all` lists every pair the same way. The Markdown form (`--markdown FILE`)
is for a GitHub job summary or a pull-request comment: the same sections as tables, every pair in a folded
<details> block.
"""

from __future__ import annotations

import html
import math
import statistics
import textwrap
from collections.abc import Iterable

from rich.console import Console
from rich.markup import escape

from bench.analysis import ab_stats as st
from bench.analysis.ab import ABPair, ABResult
from bench.console.format import format_duration, format_p, format_seconds

MAX_WIDTH = 100
INDENT = "    "
VERDICT_STYLE = {st.SLOWER: "bold red", st.FASTER: "bold green", st.SAME: "dim", st.NOISY: "yellow",
                 st.AMBIGUOUS: "yellow"}
KIND_STYLE = {"regression": "bold red", "improvement": "green", "change": "yellow", "worse": "red", "better": "green"}


# --- pieces --------------------------------------------------------------------------------------------------


def pct(ratio: float) -> str:
    """A ratio as a signed percent change: 1.123 -> `+12.3%`; never cut."""
    if not math.isfinite(ratio):
        return "-"
    return f"{(ratio - 1) * 100:+.1f}%"


def interval(pair: ABPair) -> str:
    t = pair.test
    if t is None or not math.isfinite(t.ci_low):
        return "-"
    return f"[{pct(t.ci_low)}, {pct(t.ci_high)}]"


def mde_text(pair: ABPair) -> str:
    if pair.mde is None:
        return "-"
    return "inf" if not math.isfinite(pair.mde) else f"{pair.mde * 100:.1f}%"


def short_labels(result: ABResult) -> tuple[dict[str, str], list[str]]:
    """case_id -> its label without the words every label shares; and those shared words, in order."""
    labels = {p.case_id: p.label for p in result.pairs}
    for side in (result.base, result.new):
        for case_id, label in side.labels.items():
            labels.setdefault(case_id, label)
    words = [label.split() for label in labels.values()]
    if len(words) < 2:
        return labels, []
    common = [w for w in words[0] if all(w in other for other in words[1:])]
    short = {case_id: " ".join(w for w in label.split() if w not in common) or label
             for case_id, label in labels.items()}
    return short, common


def status_text(pair: ABPair) -> str:
    if pair.base_status == pair.new_status:
        return pair.new_status
    return f"{pair.base_status} -> {pair.new_status}"


def _fit(head: str, tail: str, width: int) -> list[str]:
    """`head  tail` on one line, or tail on an indented continuation line (wrapped, never cut)."""
    line = f"{head}  {tail}" if head else tail
    if len(line) <= width:
        return [line]
    out = [head] if head else []
    out += textwrap.wrap(tail, width=width, initial_indent=INDENT, subsequent_indent=INDENT + "  ",
                         break_long_words=True, break_on_hyphens=False)
    return out


def pair_lines(pair: ABPair, label: str, width: int) -> list[tuple[str, str | None]]:
    """(text, style of its first word) lines for one pair."""
    who = f"{pair.impl} | {label}"
    lines: list[tuple[str, str | None]] = []
    if pair.verdict is not None:
        head = f"  {pair.verdict:<9} {pct(pair.test.ratio) if pair.test else '-':>7} {interval(pair)}" \
               f"  q {format_p(pair.q_value)}  MDE {mde_text(pair)}"
        if len(pair.trials) > 1:  # each trial alone (the later ones on fresh workers)
            head += f"  trials {' '.join(pct(t.ratio) for t in pair.trials)}"
        for i, text in enumerate(_fit(head, who, width)):
            lines.append((text, VERDICT_STYLE[pair.verdict] if i == 0 else None))
    else:
        head = f"  {status_text(pair):<9}"
        why = pair.time_note if pair.base_status == pair.new_status == "ok" else None
        for i, text in enumerate(_fit(head, who + (f": {why}" if why else ""), width)):
            lines.append((text, None if i else "bold red" if pair.regression else None))
    for change in pair.changes:
        text = f"{change.figure}: {change.base} -> {change.new} ({change.kind})"
        lines += [(t, None) for t in textwrap.wrap(text, width=width, initial_indent=INDENT,
                                                  subsequent_indent=INDENT + "  ", break_long_words=True)]
    if pair.reason:
        text = f"reason: {pair.reason}"
        lines += [(t, None) for t in textwrap.wrap(text, width=width, initial_indent=INDENT,
                                                  subsequent_indent=INDENT + "  ", break_long_words=True)]
    return lines


def settings_line(result: ABResult) -> str:
    m = result.measurement
    threads = "torch's default threads" if m.threads == 0 else f"{m.threads} thread{'s' * (m.threads > 1)}"
    looks = m.planned_looks()
    more = f" (up to {looks[-1]} while open)" if len(looks) > 1 else ""
    return (f"{m.rounds} rounds per pair{more}, blocks of >= {m.block_calls} calls and {m.block_s * 1e3:g} ms, "
            f"{threads} per worker; threshold {result.threshold_pct:g}%, alpha {result.alpha:g} (sequential, BH), "
            f"MDE at power {st.POWER:g}; {format_duration(m.wall_s)}")


def side_title(result: ABResult, role: str) -> str:
    side = result.base if role == "BASE" else result.new
    commit = f" ({side.checkout.commit[:10]})" if side.checkout.commit else ""
    return f"{role} {side.checkout.spec}{commit}"


def summary_line(result: ABResult) -> str:
    counts = result.verdict_counts()
    timed = ", ".join(f"{n} {v}" for v, n in counts.items() if n) or "no time verdict"
    untimed = sum(p.verdict is None for p in result.pairs)
    parts = [f"{len(result.pairs)} pairs: {timed}"]
    if untimed:
        parts.append(f"{untimed} not timed interleaved")
    changes = sum(len(p.changes) for p in result.pairs)
    if changes:
        parts.append(f"{changes} deterministic changes")
    one_side = len(result.only_base) + len(result.only_new)
    if one_side:
        parts.append(f"{one_side} on one side only")
    mdes = result.mdes()
    if mdes:
        parts.append(f"MDE median {statistics.median(mdes) * 100:.1f}%")
    regressions, improvements = len(result.regressions()), len(result.improvements())
    outcome = f"REGRESSION in {regressions} pairs" if regressions else "no regression"
    if improvements:
        outcome += f", {improvements} improved"
    impls = ", ".join(f"{v.impl} {v.verdict} ({pct(v.ratio)})" for v in result.impls)
    if impls:
        parts.append(f"per implementation: {impls}")
    return f"{outcome} - " + "; ".join(parts)


# --- the terminal --------------------------------------------------------------------------------------------


def print_ab(result: ABResult, console: Console, show_all: bool = False) -> None:
    width = min(console.width or MAX_WIDTH, MAX_WIDTH)
    short, common = short_labels(result)

    def out(text: str, style: str | None = None) -> None:
        console.print(f"[{style}]{escape(text)}[/]" if style else escape(text), highlight=False, soft_wrap=True)

    def wrapped(text: str, indent: str = "", style: str | None = None) -> None:
        for line in textwrap.wrap(text, width=width, initial_indent=indent,
                                  subsequent_indent=" " * len(indent) + "  ", break_long_words=True,
                                  break_on_hyphens=False):
            out(line, style)

    wrapped(f"bench ab, suite {result.new.suite_name}: {side_title(result, 'BASE')} vs {side_title(result, 'NEW')}",
            style="bold")
    wrapped(settings_line(result))
    sections: list[tuple[str, list[ABPair], str]] = [
        ("REGRESSIONS", result.regressions(), "bold red"), ("IMPROVEMENTS", result.improvements(), "bold green")]
    if show_all:
        sections.append(("ALL PAIRS", result.pairs, "bold"))
    for title, pairs, style in sections:
        if not pairs:
            continue
        out(f"{title} ({len(pairs)})", style)
        for pair in pairs:
            for text, line_style in pair_lines(pair, short.get(pair.case_id, pair.label), width):
                out(text, line_style)
    for label, missing in (("only in BASE", result.only_base), ("only in NEW", result.only_new)):
        if missing:
            wrapped(f"{label}: " + "; ".join(f"{impl} | {short.get(c, c)} ({s})" for c, impl, s in missing))
    if result.notes:
        out("notes:")
        for note in result.notes:
            wrapped(note, indent="  - ")
    if common:
        wrapped(f"every case: {' '.join(common)} (left out of the labels above)")
    wrapped(f"runs: BASE {result.base.run_dir}, NEW {result.new.run_dir}")
    wrapped(summary_line(result), style="bold red" if result.regressions() else "bold green")


# --- Markdown ------------------------------------------------------------------------------------------------


def md_cell(text: object) -> str:
    """Plain text safe inside a Markdown table cell (no HTML, no column breaks)."""
    return html.escape(str(text), quote=False).replace("|", "\\|").replace("\n", " ").replace("`", "'")


def _md_row(cells: Iterable[object]) -> str:
    return "| " + " | ".join(md_cell(c) for c in cells) + " |"


def _md_table(pairs: list[ABPair], short: dict[str, str]) -> list[str]:
    lines = ["| verdict | impl | case | NEW vs BASE | 95% interval | q | MDE | BASE | NEW |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for p in pairs:
        if p.verdict is not None and p.test is not None:
            lines.append(_md_row([p.verdict, p.impl, short.get(p.case_id, p.label), pct(p.test.ratio), interval(p),
                                  format_p(p.q_value), mde_text(p), format_seconds(p.test.median_base),
                                  format_seconds(p.test.median_new)]))
        else:
            lines.append(_md_row([status_text(p), p.impl, short.get(p.case_id, p.label), "-", "-", "-", "-", "-",
                                  "-"]))
    return lines


def markdown(result: ABResult) -> str:
    short, common = short_labels(result)
    regressions, improvements = result.regressions(), result.improvements()
    head = (f"{len(regressions)} regression{'s' * (len(regressions) != 1)}" if regressions else "no regression")
    if improvements:
        head += f", {len(improvements)} improvement{'s' * (len(improvements) != 1)}"
    lines = [f"### bench ab `{md_cell(result.new.suite_name)}`: {head}", "",
             f"{md_cell(side_title(result, 'BASE'))} vs {md_cell(side_title(result, 'NEW'))}. "
             f"{md_cell(settings_line(result))}.", ""]
    for title, pairs in (("Regressions", regressions), ("Improvements", improvements)):
        if pairs:
            lines += [f"#### {title}", "", *_md_table(pairs, short), ""]
            for p in pairs:
                details = [f"{c.figure}: {c.base} -> {c.new} ({c.kind})" for c in p.changes]
                if p.reason:
                    details.append(f"reason: {p.reason}")
                if details:
                    lines.append(f"- {md_cell(p.impl)} {md_cell(short.get(p.case_id, p.label))}: "
                                 + "; ".join(md_cell(d) for d in details))
            lines.append("")
    lines += [f"<details><summary>All {len(result.pairs)} pairs</summary>", "", *_md_table(result.pairs, short), "",
              "</details>", ""]
    missing = [("BASE", c, i, s) for c, i, s in result.only_base] + [("NEW", c, i, s) for c, i, s in result.only_new]
    if missing:
        lines += ["**Only on one side** (not compared): "
                  + "; ".join(f"{role}: {md_cell(i)} {md_cell(short.get(c, c))} ({md_cell(s)})"
                              for role, c, i, s in missing), ""]
    if result.notes or common:
        lines += ["**Notes**", ""]
        lines += [f"- {md_cell(note)}" for note in result.notes]
        if common:
            lines.append(f"- every case: {md_cell(' '.join(common))} (left out of the labels above)")
        lines.append("")
    lines += [f"**Summary:** {md_cell(summary_line(result))}", ""]
    return "\n".join(lines)
