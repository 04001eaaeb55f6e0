"""What `bench import flashinfer-trace` prints: per definition what mapped (with the reference's agreement with
the oracle), what did not and why, the solutions registered, then every problem with the dataset's files."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape

from bench.interop.flashinfer.importer import DefinitionReport, ImportReport


def _definition_lines(d: DefinitionReport) -> list[str]:
    lines = [f"{d.name} ({d.op_type}, {d.file})"]
    if d.reason is not None:
        return [lines[0] + f": not mapped: {d.reason}"]
    for m in d.mapped:
        check = m.agreement.summary() if m.agreement is not None else f"cross-check {m.not_checked}" \
            if m.not_checked else "cross-check not run (--no-check)"
        lines.append(f"  workload {m.uuid}: case {m.case_id} ({m.label}); {check}")
    for u in d.unmapped:
        lines.append(f"  workload {u.uuid} ({u.file}:{u.line}): not mapped: {u.reason}")
    if not d.mapped and not d.unmapped:
        lines.append("  no workloads")
    for s in d.solutions:
        lines.append(f"  solution {s.name} ({s.file}): " + (f"implementation {s.impl}" if s.impl is not None
                                                            else f"not registered: {s.reason}"))
    return lines


def print_import(report: ImportReport, console: Console) -> None:
    for d in report.definitions:
        for line in _definition_lines(d):
            console.print(escape(line), soft_wrap=True, highlight=False)
    for p in report.problems:
        console.print(escape(f"bench import: error: {report.root}/{p.text()}"), soft_wrap=True, highlight=False)
    cases = sum(len(d.mapped) for d in report.definitions)
    if report.suite:
        console.print(escape(f"wrote {report.suite}: {cases} case(s) from {report.root}"), soft_wrap=True,
                      highlight=False)
    else:
        console.print(escape(f"no workload of {report.root} maps: no suite written"), soft_wrap=True, highlight=False)
