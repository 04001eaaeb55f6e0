"""pytest-benchmark entry: `pytest benchmarks/ --benchmark-json=out.json` runs suite cases under its fixture.

Options (this directory's own; pytest only reads them when `benchmarks/` is on the command line):

    --bench-suite FILE   the suite whose (case, impl) pairs become tests (default suites/smoke.yaml)
    --bench-impl NAME    only this implementation (repeatable)
    --bench-device D     auto | cpu | cuda: override every case's device
    --bench-rounds N     timed rounds per test (default: the suite's measure.repeat)

Select cases with pytest's own `-k` (test ids are `<impl>-<case_id>`). This directory is outside
`testpaths`, so the project's `python -m pytest` never collects it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.errors import BadInput

ROOT = Path(__file__).resolve().parent.parent
PAIRS = pytest.StashKey[list]()  # (case, impl, measure settings) per test


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("sparse-attention benchmarks")
    group.addoption("--bench-suite", default=str(ROOT / "suites" / "smoke.yaml"), metavar="FILE",
                    help="suite whose (case, impl) pairs are benchmarked (default suites/smoke.yaml)")
    group.addoption("--bench-impl", action="append", default=[], metavar="NAME",
                    help="only this implementation (repeatable)")
    group.addoption("--bench-device", choices=["auto", "cpu", "cuda"], default=None,
                    help="override every case's device")
    group.addoption("--bench-rounds", type=int, default=None, metavar="N",
                    help="timed rounds per benchmark (default: the suite's measure.repeat)")


def pytest_configure(config: pytest.Config) -> None:
    """Load and validate the suite once, before collection; a bad one is a usage error naming the field."""
    from bench.run.tasks import select_impls
    from bench.spec.suite import load_suite

    try:
        suite = load_suite(Path(config.getoption("--bench-suite")))
        impls = select_impls(suite, config.getoption("--bench-impl"))
    except BadInput as exc:
        raise pytest.UsageError(str(exc)) from None
    config.stash[PAIRS] = [(case, impl, suite.measure) for case in suite.cases for impl in impls]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "pair" in metafunc.fixturenames:
        pairs = metafunc.config.stash[PAIRS]
        metafunc.parametrize("pair", pairs, ids=[f"{impl}-{case.case_id}" for case, impl, _ in pairs])
