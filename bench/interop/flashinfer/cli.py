"""The command-line side of bench.interop.flashinfer: `bench export --format flashinfer-trace` and `bench run
--solutions` (bench/cli/results.py and bench/cli/run.py call these)."""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

from bench.errors import BadInput
from bench.spec.suite import Suite, load_suite


def export_trace(run_dir: Path, root: Path | None, reference: str) -> int:
    from bench.interop.flashinfer.export import export_flashinfer

    if root is None:
        raise BadInput("flashinfer-trace writes a dataset directory: give -o ROOT", field="-o")
    if root.exists() and not root.is_dir():
        raise BadInput("not a directory; flashinfer-trace writes a dataset directory", file=str(root), field="-o")
    summary = export_flashinfer(run_dir, root, reference)
    by_reason: dict[str, list[str]] = {}  # one line per reason, not per record
    for left in summary.left_out:
        by_reason.setdefault(left.reason, []).append(f"{left.impl} on {left.case_id}")
    for reason, which in by_reason.items():
        shown = which[0] if len(which) == 1 else f"{len(which)} records ({which[0]}, ...)"
        print(f"bench export: left out {shown}: {reason}", file=sys.stderr)
    print(f"bench export: wrote {summary.traces} trace(s) of {len(summary.definitions)} definition(s) and "
          f"{len(summary.solutions)} solution(s) under {root} ({len(summary.left_out)} record(s) left out)",
          file=sys.stderr)
    return 0


def with_solutions(suite_file: Path, roots: list[str]) -> Suite:
    """The suite with the solutions of the datasets at `roots` registered and added to its implementations; its
    children register them too (bench.interop.flashinfer.plugin, through the environment they inherit)."""
    from bench.interop.flashinfer.plugin import SOLUTIONS_ENV
    from bench.interop.flashinfer.solutions import register_solutions

    resolved = [str(Path(r).resolve()) for r in roots]
    for root in resolved:
        if not Path(root).is_dir():
            raise BadInput("no such directory (a FlashInfer Trace dataset's root)", file=root, field="--solutions")
    os.environ[SOLUTIONS_ENV] = os.pathsep.join(resolved)
    names = [name for root in resolved for name in register_solutions(root)]
    suite = load_suite(suite_file)
    module = "bench.interop.flashinfer.plugin"
    plugins = list(dict.fromkeys([*suite.plugins, module]))
    impls = list(dict.fromkeys([*suite.impls, *names]))
    content = {**suite.content, "plugins": plugins, "impls": impls}
    return replace(suite, plugins=plugins, impls=impls, content=content)
