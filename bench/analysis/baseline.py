"""The committed baseline run that CI compares the smoke suite's deterministic figures against.

`results/BASELINE` names one run directory under `results/` (comment lines start with `#`). CI runs

    python -m bench.analysis.baseline check      # run the suite into a temporary directory, compare exactly

which fails (exit 1) when a (case, impl) became failed or incorrect or moved more communication bytes than
the baseline, and lists every other change of a deterministic figure (FLOPs, density, error numbers). Times
are not compared: the baseline was measured at another moment, on a machine others share. Pairs in only one of
the two runs (an implementation added or removed since) are listed, not failed, so the baseline survives the
registry changing; but when no pair at all is in common the check fails and asks for a refresh.

    python -m bench.analysis.baseline refresh    # run the suite into results/, point results/BASELINE at the new run
    python -m bench.analysis.baseline refresh --run results/<run_id>    # or name a run already there

then commit `results/BASELINE` and the new run's run.json and records.jsonl. A refresh refuses to bless a run
with failed or incorrect records (it would hide those failures from every later check).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console

from bench.analysis.compare import compare_specs
from bench.analysis.report import print_comparison
from bench.console.terminal import make_console
from bench.errors import BadInput
from bench.results.store import RUN_JSON, load_run

ROOT = Path(__file__).resolve().parents[2]  # the checkout: bench/analysis/ -> /
HEADER = """\
# The baseline run of the smoke suite that CI (`.ci/run`) compares deterministic figures against:
# status, FLOPs, density, correctness numbers and communication bytes, exactly (not times).
# Refresh it from committed code with:  python -m bench.analysis.baseline refresh
# and commit this file with the run directory it names.
"""


def read_baseline(path: Path) -> str | None:
    """The run id named in a BASELINE file, or None if the file does not exist."""
    if not path.exists():
        return None
    lines = [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines()]
    names = [ln for ln in lines if ln and not ln.startswith("#")]
    if len(names) != 1:
        raise BadInput(f"expected exactly one run id line (besides # comments), found {len(names)}", file=str(path))
    return names[0]


def write_baseline(path: Path, run_id: str) -> None:
    path.write_text(HEADER + run_id + "\n", encoding="utf-8")


def _run_suite(suite: Path, out: Path) -> tuple[int, Path | None]:
    """`bench run SUITE --out OUT` in a subprocess; (exit code, the new run directory)."""
    out = out.resolve()
    before = set(out.iterdir()) if out.is_dir() else set()
    code = subprocess.call([sys.executable, "-m", "bench", "run", str(suite.resolve()), "--out", str(out)], cwd=ROOT)
    new = [p for p in out.iterdir() if p.is_dir() and p not in before] if out.is_dir() else []
    return code, (new[0] if len(new) == 1 else None)


def check(baseline_file: Path, results: Path, suite: Path, console: Console, err: Console) -> int:
    run_id = read_baseline(baseline_file)
    if run_id is None:
        err.print(f"[bold yellow]NOTICE:[/] {baseline_file} does not exist: the deterministic baseline check was "
                  "NOT run. Create it with `python -m bench.analysis.baseline refresh`.")
        return 0
    base_dir = results / run_id
    if not (base_dir / RUN_JSON).is_file():
        raise BadInput(f"names {run_id!r}, which is not a run directory under {results}", file=str(baseline_file))
    with tempfile.TemporaryDirectory(prefix="bench-baseline-") as tmp:
        code, new_dir = _run_suite(suite, Path(tmp))
        if code not in (0, 1) or new_dir is None:  # 1 (failed/incorrect records) is for compare to judge
            err.print(f"[bold red]bench run {suite} exited with {code}[/]")
            return code or 2
        result = compare_specs(str(base_dir), str(new_dir), deterministic_only=True)
        console.print(f"[bold]deterministic figures of {suite} against the baseline {run_id}[/]")
        print_comparison(result, console, err)
        if not result.pairs:
            err.print(f"[bold red]no (case, impl) pair in common with the baseline {run_id}[/]: the suite's cases "
                      "changed. Refresh the baseline: python -m bench.analysis.baseline refresh")
            return 1
        return result.exit_code


def refresh(baseline_file: Path, results: Path, suite: Path, err: Console, run_dir: Path | None = None) -> int:
    """Run the suite into `results` (or take the existing `run_dir` there) and name it in `baseline_file`."""
    if run_dir is not None:
        if run_dir.resolve().parent != results.resolve():
            raise BadInput(f"must be a run directory directly under {results}", file=str(run_dir), field="--run")
        new_dir = run_dir
    else:
        code, made = _run_suite(suite, results)
        if made is None or code not in (0, 1):
            err.print(f"[bold red]bench run {suite} exited with {code}; the baseline is unchanged[/]")
            return code or 2
        new_dir = made
    run = load_run(new_dir)
    bad = [r for r in run.records if r.status in ("failed", "incorrect")]
    if bad:
        err.print(f"[bold red]{len(bad)} records of {new_dir} are failed or incorrect[/] (first: {bad[0].case_id} "
                  f"{bad[0].impl}: {bad[0].reason}); a baseline must be healthy, so {baseline_file} is unchanged")
        return 1
    if run.info.env.git.dirty:
        err.print("[yellow]warning:[/] the run was made from a working tree with uncommitted changes")
    write_baseline(baseline_file, new_dir.name)
    err.print(f"{baseline_file} now names {new_dir.name}. Commit them:\n"
              f"  git add {baseline_file} {new_dir / RUN_JSON} {new_dir / 'records.jsonl'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.analysis.baseline", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["check", "refresh"])
    parser.add_argument("--suite", default="suites/smoke.yaml", help="suite to run (default suites/smoke.yaml)")
    parser.add_argument("--results", default="results", help="results store holding the baseline run")
    parser.add_argument("--baseline-file", default=None, help="default: RESULTS/BASELINE")
    parser.add_argument("--run", default=None, metavar="RUN_DIR",
                        help="refresh: name this existing run under RESULTS instead of making a new one")
    args = parser.parse_args(argv)
    results = Path(args.results)
    baseline_file = Path(args.baseline_file) if args.baseline_file else results / "BASELINE"
    console, err = make_console(), make_console(stderr=True)
    try:
        if args.action == "check":
            return check(baseline_file, results, Path(args.suite), console, err)
        return refresh(baseline_file, results, Path(args.suite), err, Path(args.run) if args.run else None)
    except BadInput as exc:
        print(f"bench.analysis.baseline {args.action}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
