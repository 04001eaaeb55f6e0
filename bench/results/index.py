"""The results store as a whole: every run under `results/`, validated, indexed by commit, suite and fingerprint.

`load_index(root)` reads every run directory and validates each `run.json` and every line of each
`records.jsonl` (bench.results.store does the per-file work); the first corrupt file stops the load with a BadInput
naming it, so a damaged store is never half-read and silently compared. Files in the root that are not
directories (README.md, BASELINE) are ignored; a directory without a run.json is an error, as it is not a run.

`resolve(spec, ...)` turns what a user types after `bench compare` into runs: a run directory, or a commit id
prefix found in the index (all runs of that commit for one suite, which compare pools).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from bench.errors import BadInput
from bench.results.records import Record
from bench.results.store import CALIBRATION_DIR, RUN_JSON, Run, load_run


@dataclass
class StoreIndex:
    """Runs of one results root, oldest first, with lookups by commit, suite and fingerprint."""

    root: Path
    runs: list[Run] = field(default_factory=list)

    @property
    def warnings(self) -> list[str]:
        return [w for run in self.runs for w in run.warnings]

    def select(self, *, commit: str | None = None, suite: str | None = None, fingerprint: str | None = None,
               source: str | None = None) -> list[Run]:
        """Runs matching every given filter; `commit` is a prefix of the full commit id."""
        out = []
        for run in self.runs:
            if commit is not None and not (run_commit(run) or "").startswith(commit.lower()):
                continue
            if suite is not None and run.info.suite.name != suite:
                continue
            if fingerprint is not None and run_fingerprint(run) != fingerprint:
                continue
            if source is not None and run.info.source != source:
                continue
            out.append(run)
        return out

    def commits(self) -> list[str]:
        """Distinct full commit ids, in the order of their first run."""
        return list(dict.fromkeys(c for c in (run_commit(r) for r in self.runs) if c))

    def suites(self) -> list[str]:
        return list(dict.fromkeys(r.info.suite.name for r in self.runs))

    def fingerprints(self) -> list[str]:
        return list(dict.fromkeys(run_fingerprint(r) for r in self.runs))


def run_commit(run: Run) -> str | None:
    commit = run.info.env.git.commit
    return commit.lower() if commit else None


def run_fingerprint(run: Run) -> str:
    return run.info.env.fingerprint_or_unknown


ORDINARY = "run"  # a plain `bench run` (or `bench submit`) of the whole suite


def run_kind(run: Run) -> str:
    """How a run was made, from its command: `run` for a whole suite, `ab` for one side of a `bench ab` (its own
    interleaved rounds, often one implementation), `filtered` for a run restricted by `--impl`. Pooling runs of
    different kinds mixes samples measured under different conditions, so a comparison says which it pools."""
    command = run.info.command or []
    if command[:1] == ["ab"]:
        return "ab"
    if any(arg == "--impl" or arg.startswith("--impl=") for arg in command):
        return "filtered"
    return ORDINARY


def describe_kind(run: Run) -> str:
    """The run's id and, unless ordinary, how it was made (`bench ab ...`, `--impl ...`)."""
    kind = run_kind(run)
    if kind == ORDINARY:
        return run.info.run_id
    return f"{run.info.run_id} (`bench {' '.join(run.info.command or [])}`)"


def committed_run_dirs(root: Path) -> set[str] | None:
    """Names of the run directories under `root` that git tracks (their run.json is committed); None when `root`
    is not inside a git work tree, where every run counts."""
    import subprocess

    try:
        out = subprocess.run(["git", "-C", str(root), "ls-files", "--", "."], capture_output=True, text=True,
                             check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return {Path(line).parts[0] for line in out.splitlines() if line.endswith("/" + RUN_JSON)}


def record_device(record: Record, run: Run) -> str:
    """The record's device string; for one that failed before naming it, the run's device of its kind, so
    that it sits in its measured neighbours' section (cuda:0 NVIDIA H200, not cuda)."""
    if record.device:
        return record.device
    requested = record.params.get("device")
    env = run.info.env
    kind = str(requested if requested not in (None, "auto") else env.backend or "unknown device")
    if kind.startswith("cuda") and env.gpus:
        index = int(kind.partition(":")[2] or 0)
        gpu = next((g for g in env.gpus if g.cuda_index == index), None)
        if gpu is not None and gpu.name:
            return f"cuda:{index} {gpu.name}"
    elif kind == "cpu" and env.cpu.model:
        return f"cpu: {env.cpu.model}"
    return kind


def load_index(root: Path) -> StoreIndex:
    """Every run under `root`, validated; raises BadInput naming the first corrupt file."""
    root = Path(root)
    if not root.is_dir():
        raise BadInput("no such results directory", file=str(root))
    runs = []
    for path in sorted(p for p in root.iterdir()
                       if p.is_dir() and not p.name.startswith(".") and p.name != CALIBRATION_DIR):
        if not (path / RUN_JSON).is_file():
            raise BadInput(f"a directory in the results store without {RUN_JSON}; every directory under "
                           f"{root} must be a run (move other files elsewhere)", file=str(path))
        runs.append(load_run(path))
    runs.sort(key=lambda r: (r.info.started_at, r.info.run_id))
    return StoreIndex(root, runs)


def load_runs(paths: Iterable[Path]) -> list[Run]:
    """Run directories given explicitly, each validated."""
    return [load_run(Path(p)) for p in paths]


def resolve(spec: str, root: Path, *, suite: str | None = None, what: str = "run") -> list[Run]:
    """A run directory, or every run of the commit whose id starts with `spec` (for one suite).

    Raises BadInput when nothing matches, when the prefix names several commits, or when the commit has
    runs of several suites and `suite` does not pick one.
    """
    path = Path(spec)
    if (path / RUN_JSON).is_file():
        return [load_run(path)]
    if path.is_dir():
        raise BadInput(f"{what}: a directory without {RUN_JSON} is not a run directory", file=spec)
    if not _looks_like_commit(spec):
        raise BadInput(f"{what}: got {spec!r}; expected a run directory (containing {RUN_JSON}) or a commit id "
                       "prefix of at least 4 hex digits found in the results store")
    index = load_index(root)
    matches = index.select(commit=spec, suite=suite)
    if not matches:
        known = ", ".join(c[:10] for c in index.commits()[-8:]) or "none"
        where = f" for suite {suite!r}" if suite else ""
        raise BadInput(f"{what}: no run of a commit starting with {spec!r}{where} in {root} "
                       f"(latest commits there: {known})")
    commits = {run_commit(r) for r in matches}
    if len(commits) > 1:
        listed = ", ".join(sorted(c[:12] for c in commits if c))
        raise BadInput(f"{what}: commit prefix {spec!r} is ambiguous; it matches {listed}; give more digits")
    suites = {r.info.suite.name for r in matches}
    if len(suites) > 1:
        raise BadInput(f"{what}: commit {spec!r} has runs of several suites ({', '.join(sorted(suites))}); "
                       "pick one with --suite NAME or pass a run directory")
    return matches


def _looks_like_commit(spec: str) -> bool:
    return 4 <= len(spec) <= 40 and all(c in "0123456789abcdefABCDEF" for c in spec)
