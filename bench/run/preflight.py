"""`bench run --dry-run`: every check a real run makes before it measures, then what it would measure.

A dry run validates what the real run would refuse (the run id, `--out`, the `--resume` target and its identity),
lists the pairs it would measure (with `--resume`, only the missing ones) and the skips it can predict without
measuring: an implementation unavailable here, a case it does not support (a CUDA case without a GPU, world
sizes, flex's backward on CPU, a selection it does not take) and a case the memory model says cannot fit.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from bench import registry
from bench.errors import BadInput
from bench.measure.case.steps import skip_reason
from bench.measure.memory_model import does_not_fit
from bench.results.store import RUN_JSON, check_output_dir
from bench.run.identity import check_run_id
from bench.run.tasks import Pair, resolved
from bench.spec.case import resolve_device
from bench.spec.suite import Suite


def check_out(out: Path) -> None:
    """`--out`: the results root, made if missing in an existing directory."""
    check_output_dir(out, "--out", "the results root that run directories go in")


def check_new_run_id(out: Path, run_id: str) -> Path:
    """A `--run-id` for a new run: well-formed, and not a run of `out` already (that is --resume)."""
    check_run_id(run_id)
    run_dir = out / run_id
    if (run_dir / RUN_JSON).exists():
        raise BadInput(f"run {run_id!r} exists already in {out}; add to it with --resume {run_dir}, or give another "
                       "--run-id", field="--run-id")
    return run_dir


@dataclass(frozen=True)
class Planned:
    pair: Pair
    skip: str | None  # the predicted skip, or None: measured


def plan_pairs(pairs: list[Pair], device: str | None) -> list[Planned]:
    """Each pair with the skip a real run would record before measuring it, where it can be told now."""
    planned = []
    for pair in pairs:
        case = resolved(pair.case, device)
        impl = registry.get(pair.impl)
        reason = skip_reason(impl, case)
        if reason is None and case.device == "cpu":
            too_big = does_not_fit(impl, case)
            reason = too_big[0] if too_big is not None else None
        planned.append(Planned(pair, reason))
    return planned


def print_preflight(console: Console, suite: Suite, impls: list[str], planned: list[Planned], *,
                    device: str | None, already: int, resume: Path | None, shard_pairs: int | None,
                    added: list[str]) -> None:
    table = Table(title=f"suite {suite.name}: {len(suite.cases)} cases x {len(impls)} implementations")
    table.add_column("#", justify="right")
    table.add_column("case_id", no_wrap=True)
    table.add_column("device")
    for index, case in enumerate(suite.cases):
        table.add_row(str(index), case.case_id, resolve_device(device or case.device))
    console.print(table)
    avail = []
    for name in impls:
        why = registry.get(name).unavailable()
        note = " (added: not in the suite)" if name in added else ""
        avail.append(f"{name}{note} ({'available' if why is None else 'unavailable: ' + why})")
    console.print("implementations: " + "; ".join(avail))
    skips: dict[str, int] = {}
    for p in planned:
        if p.skip is not None:
            skips[f"{p.pair.impl}: {p.skip}"] = skips.get(f"{p.pair.impl}: {p.skip}", 0) + 1
    if skips:
        console.print(f"predicted skips ({sum(skips.values())} pairs):")
        for reason, count in skips.items():
            console.print(f"  {count} x {escape(reason)}", highlight=False)
    measured = sum(p.skip is None for p in planned)
    where = f" of {resume}" if resume is not None else ""
    done = f"; {already} already in the run{where}" if resume is not None else ""
    mine = f" in this shard ({shard_pairs} pairs)" if shard_pairs is not None else ""
    console.print(f"{len(planned)} (case, impl) pairs to run{mine}{done}: {measured} to measure, "
                  f"{len(planned) - measured} predicted skips; every option checked; nothing was run (--dry-run)")
