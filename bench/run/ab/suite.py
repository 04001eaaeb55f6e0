"""The worker's side of `LoadSuite` (`bench ab`): a checkout's suite file, read and expanded by its own code.

`bench ab` runs one worker per checkout, each in that checkout's directory with that checkout's `bench/` and
`impls/` on its path. The parent must not expand a side's suite itself (the cases, their ids, the plugins and the
tasks are that side's code), so it sends `LoadSuite` and gets back, in `SuiteLoaded`, what `bench run` would
have made of the suite in that checkout: its pairs with their tasks (as JSON, handed back to this worker unread),
the run's environment (git state of that checkout) and the suite's content for run.json.
"""

from __future__ import annotations

from pathlib import Path

from bench import registry
from bench.errors import BadInput
from bench.measure.machine.env import capture
from bench.measure.task import MeasureSettings
from bench.run import calibration, messages
from bench.run.tasks import Pair, backend_of, plugin_specs, task_for
from bench.spec.suite import load_suite

ROOT = Path(__file__).resolve().parents[3]  # (bench/run/ab/ -> /) the checkout this worker's `bench` package lives in


def load_for_ab(request: messages.LoadSuite) -> messages.SuiteLoaded:
    """Read, validate and expand the suite; a SuiteLoaded with `error` for bad input (never raises it)."""
    try:
        return _load(request)
    except BadInput as exc:
        return messages.SuiteLoaded(error=str(exc), root=str(ROOT))


def _load(request: messages.LoadSuite) -> messages.SuiteLoaded:
    suite = load_suite(Path(request.suite))
    known = registry.names()
    unknown = [name for name in dict.fromkeys(request.impls) if name not in known]
    impls = [name for name in dict.fromkeys(request.impls) if name in known] if request.impls else list(suite.impls)
    backend = backend_of(suite, request.device)
    env = capture(backend=backend)
    stored = calibration.for_run(False, backend, [], Path(request.results), env.fingerprint or "") \
        if request.results else None
    settings = MeasureSettings(**suite.measure.model_dump(), calibration=stored)
    pairs = []
    for case in suite.cases:
        for impl in impls:
            pair = Pair(case, impl)
            task = task_for(pair, request.device, settings)
            pairs.append(messages.SuitePair(case_id=case.case_id, impl=impl, label=case.label,
                                            world_size=case.world_size, task=task.model_dump(mode="json")))
    return messages.SuiteLoaded(
        name=suite.name, file=str(suite.path) if suite.path else request.suite, root=str(ROOT),
        content=suite.content, env=env, plugins=plugin_specs(suite),
        timeout_s=suite.measure.timeout_s, warmup=suite.measure.warmup, repeat=suite.measure.repeat, pairs=pairs,
        unknown_impls=unknown)
