"""A run's pairs and the tasks sent to children: which implementations, which device, which plugins.

Apart from the runner so that `bench ab`'s suite loading in a worker (bench.run.ab.suite) uses the same pairs and
tasks without importing the runner, which imports the worker.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench import registry
from bench.errors import BadInput
from bench.measure.task import MeasureSettings, Task
from bench.results.records import FailureKind, Record
from bench.spec.case import Case, resolve_device
from bench.spec.suite import Suite


@dataclass
class Pair:
    case: Case  # as written in the suite (device may be "auto")
    impl: str

    @property
    def key(self) -> tuple[str, str]:
        return (self.case.case_id, self.impl)


def select_impls(suite: Suite, wanted: list[str], added: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The implementations a run measures: the suite's, or those of them named by `--impl` (a filter), then the
    ones `--add-impl` adds from outside the suite. A name outside the suite under --impl is refused, so that a
    filter never quietly adds an implementation (dense at N=16384 is 8.6 GB of scores)."""
    known = registry.names()
    for name, option in [*((n, "--impl") for n in wanted), *((n, "--add-impl") for n in added)]:
        if name not in known:
            raise BadInput(f"got {name!r}; known implementations: {', '.join(sorted(known))}", field=option)
    outside = [name for name in wanted if name not in suite.impls]
    if outside:
        raise BadInput(f"got {', '.join(map(repr, outside))}, not among suite {suite.name}'s implementations "
                       f"({', '.join(suite.impls)}); --impl picks among those. To measure one outside the suite, "
                       f"add it with --add-impl {outside[0]}", field="--impl")
    chosen = list(dict.fromkeys(wanted)) if wanted else list(suite.impls)
    return chosen + [name for name in dict.fromkeys(added) if name not in chosen]


def resolved(case: Case, device_override: str | None) -> Case:
    return case.with_device(resolve_device(device_override or case.device))


def failed_record(pair: Pair, reason: str, started: str, kind: FailureKind) -> Record:
    return Record(case_id=pair.case.case_id, impl=pair.impl, params=pair.case.params(), status="failed",
                  reason=reason, started_at=started, failure=kind)


def task_for(pair: Pair, device: str | None, settings: MeasureSettings) -> Task:
    return Task.of(resolved(pair.case, device), pair.impl, settings, written=pair.case)


def plugin_specs(suite: Suite) -> list[tuple[str, str | None]]:
    """(spec, directory it is relative to) of each plugin, as children load them."""
    return [(spec, str(suite.path.parent) if suite.path else None) for spec in suite.plugins]


def backend_of(suite: Suite, device_override: str | None) -> str:
    devices = {resolve_device(device_override or c.device) for c in suite.cases}
    return "cuda" if "cuda" in devices else "cpu"
