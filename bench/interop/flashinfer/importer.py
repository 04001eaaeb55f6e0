"""`bench import flashinfer-trace ROOT [-o SUITE.yaml]`: a FlashInfer Trace dataset as a suite.

Each workload of a definition that maps (bench.interop.flashinfer.mapping) becomes one case, a `sweeps:` block
of its own whose defaults are the case's fields, its inputs `{kind: flashinfer, root, definition, workload}`
(bench.inputs.flashinfer: q, k, v as the workload gives them). The definition's reference `run()` runs once per
workload against the float64 oracle (`--no-check` skips it); the agreement is printed, written as a comment above
the case and kept in the report (`SUITE.import.json`). The implementations: `flashinfer_reference`, each python
or triton Solution of a mapped definition (registered by a plugin file written beside the suite,
`<suite>_solutions.py`), and ours (`--impl`). What does not map is listed per definition with the reason; a
problem with a file (bench.interop.flashinfer.dataset) is printed naming file and field, the rest is imported,
and the command exits 2.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import yaml
from pydantic import BaseModel

from bench.inputs import InputsError, InputsSpec
from bench.inputs import flashinfer as workload_inputs
from bench.interop.flashinfer.crosscheck import Agreement, cross_check
from bench.interop.flashinfer.dataset import Dataset, LoadedWorkload, Problem, read_dataset
from bench.interop.flashinfer.entries import EntryError
from bench.interop.flashinfer.mapping import case_fields, layout_of
from bench.interop.flashinfer.schema import Definition
from bench.interop.flashinfer.solutions import REFERENCE, register_solution
from bench.interop.flashinfer.synth import target
from bench.spec.case import Case
from bench.spec.suite import load_suite

DEFAULT_IMPLS = ("sdpa", "blocked")
PLUGIN_MODULE = "bench.interop.flashinfer.plugin"


class MappedWorkload(BaseModel):
    uuid: str
    file: str
    line: int
    case_id: str
    label: str
    agreement: Agreement | None = None
    not_checked: str | None = None  # why the reference did not run


class UnmappedWorkload(BaseModel):
    uuid: str
    file: str
    line: int
    reason: str


class SolutionNote(BaseModel):
    name: str
    file: str
    impl: str | None  # the implementation it registered as; None: not registered
    reason: str | None = None


class DefinitionReport(BaseModel):
    name: str
    file: str
    op_type: str
    reason: str | None = None  # why none of it maps
    mapped: list[MappedWorkload] = []
    unmapped: list[UnmappedWorkload] = []
    solutions: list[SolutionNote] = []


class ImportReport(BaseModel):
    root: str
    suite: str
    definitions: list[DefinitionReport]
    problems: list[Problem]


def _case(root: Path, suite_dir: Path, definition: Definition, loaded: LoadedWorkload
          ) -> tuple[Case, dict[str, object]] | str:
    """The case a workload becomes and its defaults as the suite writes them (root relative to the suite)."""
    name = definition.name
    fields = case_fields(definition, root, loaded.trace.workload)
    if isinstance(fields, str):
        return fields
    written = {k: v for k, v in fields.model_dump().items() if v is not None}
    written["inputs"] = {"kind": "flashinfer", "root": os.path.relpath(root, suite_dir), "definition": name,
                         "workload": loaded.trace.workload.uuid}
    try:
        spec = workload_inputs.resolve(InputsSpec.parse(written["inputs"]), suite_dir)
    except InputsError as exc:
        return exc.message
    return Case(**{**written, "inputs": spec}), written


def _solutions(dataset: Dataset, name: str, problems: list[Problem]) -> list[SolutionNote]:
    notes = []
    for loaded in (s for s in dataset.solutions if s.solution.definition == name):
        try:
            impl = register_solution(loaded, dataset.root)
            notes.append(SolutionNote(name=loaded.solution.name, file=loaded.file, impl=impl))
        except EntryError as exc:
            reason = exc.message
            if exc.field != "spec.language":  # a language that needs a build is not a fault of the file
                problems.append(Problem(file=loaded.file, field=exc.field, message=exc.message))
            notes.append(SolutionNote(name=loaded.solution.name, file=loaded.file, impl=None, reason=reason))
    return notes


def _definition(dataset: Dataset, name: str, suite_dir: Path, check: bool, problems: list[Problem]
                ) -> tuple[DefinitionReport, list[tuple[Case, dict[str, object], MappedWorkload]]]:
    loaded = dataset.definitions[name]
    report = DefinitionReport(name=name, file=loaded.file, op_type=loaded.definition.op_type)
    layout = layout_of(loaded.definition)
    if isinstance(layout, str):
        report.reason = layout
        return report, []
    cases = []
    for workload in dataset.workloads.get(name, []):
        uuid = workload.trace.workload.uuid
        made = _case(dataset.root, suite_dir, loaded.definition, workload)
        if isinstance(made, str):
            report.unmapped.append(UnmappedWorkload(uuid=uuid, file=workload.file, line=workload.line, reason=made))
            continue
        case, written = made
        mapped = MappedWorkload(uuid=uuid, file=workload.file, line=workload.line, case_id=case.case_id,
                                label=case.label)
        if check:
            found = target(case)
            agreement = found if isinstance(found, str) else cross_check(case, found)
            mapped.agreement, mapped.not_checked = (None, agreement) if isinstance(agreement, str) \
                else (agreement, None)
        report.mapped.append(mapped)
        cases.append((case, written, mapped))
    report.solutions = _solutions(dataset, name, problems)
    return report, cases


def suite_name(root: Path) -> str:
    return re.sub(r"[^a-z0-9_-]+", "-", root.resolve().name.lower()).strip("-") or "flashinfer"


def _suite_text(name: str, root: Path, impls: list[str], plugins: list[str],
                blocks: list[tuple[str, dict[str, object], MappedWorkload]]) -> str:
    head = {"name": name, "description": f"FlashInfer Trace dataset {root.name}, imported by bench import "
                                         "flashinfer-trace", "impls": impls, "plugins": plugins}
    lines = ["# Written by `bench import flashinfer-trace`: one case per workload; the comment above each says the",
             "# workload and how its definition's reference run() agreed with the float64 oracle.",
             yaml.safe_dump(head, sort_keys=False, width=1000).rstrip(), "sweeps:"]
    for definition, written, mapped in blocks:
        lines.append(f"  # {definition} workload {mapped.uuid} ({mapped.file}:{mapped.line})")
        if mapped.agreement is not None or mapped.not_checked is not None:
            text = mapped.agreement.summary() if mapped.agreement is not None else f"cross-check {mapped.not_checked}"
            lines.append(f"  # {text}")
        flow = yaml.safe_dump(written, default_flow_style=True, sort_keys=False, width=100_000).strip()
        lines.append(f"  - defaults: {flow}")
    return "\n".join(lines) + "\n"


def _plugin_file(path: Path, root: Path, names: list[str]) -> None:
    rel = os.path.relpath(root, path.parent)
    path.write_text(f'"""Registers the solutions of the FlashInfer Trace dataset {root.name} (bench import '
                    'flashinfer-trace wrote this file)."""\n\nfrom pathlib import Path\n\n'
                    "from bench.interop.flashinfer.solutions import register_solutions\n\n"
                    f"register_solutions(Path(__file__).parent / {rel!r}, names={names!r})\n", encoding="utf-8")


def import_dataset(root: Path, out: Path, impls: list[str], check: bool = True, name: str | None = None
                   ) -> ImportReport:
    """Write the suite (and its solutions' plugin file, and the report beside it); returns the report."""
    dataset = read_dataset(root)
    problems = list(dataset.problems)
    suite_dir = out.resolve().parent
    reports: list[DefinitionReport] = []
    blocks: list[tuple[str, dict[str, object], MappedWorkload]] = []
    for definition in dataset.definitions:
        report, cases = _definition(dataset, definition, suite_dir, check, problems)
        reports.append(report)
        blocks += [(definition, written, mapped) for _, written, mapped in cases]
    solution_impls = [s.impl for r in reports if r.mapped for s in r.solutions if s.impl is not None]
    solution_names = [s.name for r in reports if r.mapped for s in r.solutions if s.impl is not None]
    plugins = [PLUGIN_MODULE]
    if solution_names:
        plugin = out.with_name(f"{out.stem}_solutions.py")
        _plugin_file(plugin, dataset.root, solution_names)
        plugins.append(plugin.name)
    all_impls = list(dict.fromkeys([REFERENCE, *solution_impls, *impls]))
    if blocks:
        out.write_text(_suite_text(name or suite_name(root), dataset.root, all_impls, plugins, blocks),
                       encoding="utf-8")
        loaded = load_suite(out)  # what was written reads back, with the same cases
        assert [c.case_id for c in loaded.cases] == [m.case_id for _, _, m in blocks], "suite and import disagree"
    result = ImportReport(root=str(dataset.root), suite=str(out) if blocks else "", definitions=reports,
                          problems=problems)
    out.with_name(f"{out.stem}.import.json").write_text(json.dumps(result.model_dump(mode="json"), indent=1) + "\n",
                                                       encoding="utf-8")
    return result
