"""Shared test helpers: run the `bench` command line in a subprocess, write suites into temp dirs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
PLUGINS = Path(__file__).resolve().parent / "plugins"

# The same console width whether the tests run in one process or in parallel workers (pytest-xdist's workers
# get COLUMNS=80, which folds the tables the tests read); every `bench` subprocess inherits it.
os.environ["COLUMNS"] = "200"
os.environ.pop("LINES", None)


def outer_pytest_env() -> dict[str, str]:
    """The environment for a pytest started from a test, without the parallel worker's marks: pytest-benchmark
    disables itself where PYTEST_XDIST_WORKER is set."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}


def bench_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "bench", *args]


def run_bench(*args: str, cwd: Path | None = None, timeout: float = 600, env: dict | None = None
              ) -> subprocess.CompletedProcess:
    """`bench ARGS` in a subprocess with this checkout importable; output captured as text."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                **(env or {})}
    return subprocess.run(bench_cmd(*args), cwd=cwd or ROOT, capture_output=True, text=True, timeout=timeout,
                          env=full_env)


def write_suite(directory: Path, content: dict | str, name: str = "suite.yaml") -> Path:
    """A suite file from a dict (or YAML text). Unless a dict's `measure` says otherwise, memory is read in the
    worker and sampling stops after 50 ms (past `repeat` samples): the defaults, a fresh process per pair and up to
    2 s of sampling until the median is known to 1%, make a small run several times slower, and the tests of what
    they do (tests/test_memory.py, test_prepare_case.py, test_timing.py) ask for them by name."""
    path = directory / name
    if isinstance(content, dict) and isinstance(content.get("measure", {}), dict):
        content = {**content, "measure": {"memory": "worker", "max_time_s": 0.05, **content.get("measure", {})}}
    path.write_text(content if isinstance(content, str) else yaml.safe_dump(content, sort_keys=False))
    return path


def only_run_dir(results: Path) -> Path:
    runs = [p for p in results.iterdir() if p.is_dir()]
    assert len(runs) == 1, runs
    return runs[0]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture
def faulty_plugin(tmp_path: Path) -> Path:
    """The planted-fault plugin copied beside the suites a test writes."""
    target = tmp_path / "faulty.py"
    target.write_text((PLUGINS / "faulty.py").read_text())
    return target


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The dashboard tests' synthetic results store (tests/dashboard_runs.py), its runs loaded by name."""
    from bench.results.store import load_run
    from tests import dashboard_runs

    root = tmp_path_factory.mktemp("results")
    paths = dashboard_runs.write_store(root)
    return {"root": root, **{name: load_run(path) for name, path in paths.items()}}
