"""A run's identity, and the names it may be given.

Records of one run are comparable with each other only if they were measured by the same code on the same
machine from the same suite. So a run is identified by its suite content, the commit its code came from, whether
tracked files differed from that commit (and then the hash of the difference: two dirty trees are two codes), and
the machine's fingerprint (bench.results.environment.FINGERPRINT_FIELDS), and the sha256 of each file of measured
code git does not describe (`env.code`: the suite's plugins, registered solutions, untracked files under impls/:
a plugin edited between a run and its `--resume` is another code). `--resume` and `--shard` add records to
an existing run only when all of these are equal here; otherwise they refuse (exit 2) naming what differs, since
a store that silently mixes commits or machines is worse than none. Each record also carries `git` {commit,
dirty}.

A run's name (`--run-id`) is free: letters, digits, `.`, `_`, `-`. Its time and commit are read from run.json,
never parsed from the name.
"""

from __future__ import annotations

import re

from bench.errors import BadInput
from bench.results.environment import Environment, GitInfo
from bench.results.records import RecordGit, RunInfo
from bench.results.store import CALIBRATION_DIR
from bench.spec.suite import Suite, parse_suite

RUN_ID_RE = re.compile(r"[A-Za-z0-9._-]{1,100}")


def check_run_id(run_id: str) -> str:
    """A run name the store can hold: 1-100 letters, digits, `.`, `_`, `-`, not starting with `.` (a hidden
    directory, which the store skips) and not the calibration directory's name."""
    if not RUN_ID_RE.fullmatch(run_id) or run_id.startswith(".") or run_id == CALIBRATION_DIR:
        raise BadInput(f"got {run_id!r}; a run id is 1-100 letters, digits, '.', '_' or '-', not starting with '.' "
                       f"and not {CALIBRATION_DIR!r} (e.g. nightly-42)", field="--run-id")
    return run_id


def record_git(git: GitInfo) -> RecordGit:
    """What each record says of the commit that measured it."""
    return RecordGit(commit=git.commit, dirty=git.dirty)


def _describe_tree(git: GitInfo) -> str:
    if git.commit is None:
        return "no git commit"
    state = "clean" if not git.dirty else f"dirty, diff {(git.diff_sha256 or 'unknown')[:12]}"
    return f"commit {git.commit[:12]} ({state})"


def _code_differences(stored: GitInfo, here: GitInfo) -> list[str]:
    if stored.commit == here.commit and bool(stored.dirty) == bool(here.dirty) and (
            not here.dirty or stored.diff_sha256 == here.diff_sha256):
        return []
    return [f"code: the run has {_describe_tree(stored)}, this checkout {_describe_tree(here)}"]


def same_content(stored: dict, suite: Suite) -> bool:
    """Whether a run's stored suite content is this suite's: equal, or equal once read through today's schema
    (a field added since, with its default, must not stop a run from being resumed)."""
    if stored == suite.content:
        return True
    try:
        again = parse_suite(stored, file=str(suite.path or "<suite>"),
                            base_dir=suite.path.parent if suite.path else None)
    except BadInput:
        return False
    return again.content == suite.content


def _measured_code_differences(stored: dict[str, str] | None, here: dict[str, str] | None) -> list[str]:
    """One line per file of measured code outside git (a plugin, a solution, an untracked file under impls/) that
    was added, removed or changed since the run was made."""
    stored, here = stored or {}, here or {}
    found = []
    for name in sorted(set(stored) | set(here)):
        if stored.get(name) != here.get(name):
            what = "is new" if name not in stored else "is gone" if name not in here else \
                f"changed (sha256 {stored[name][:12]} -> {here[name][:12]})"
            found.append(f"code: {name} {what} since the run was made")
    return found


def differences(info: RunInfo, suite: Suite, here: Environment) -> list[str]:
    """What differs between a stored run and a run of `suite` started here now: its suite, its code, the
    machine (each fingerprinted field that differs); empty when they are the same run."""
    found = []
    if info.suite.name != suite.name or not same_content(info.suite.content, suite):
        found.append(f"suite: the run was made from suite {info.suite.name!r} with other content than "
                     f"{suite.name!r} here")
    found += _code_differences(info.env.git, here.git)
    found += _measured_code_differences(info.env.code, here.code)
    machine = info.env.differences(here)
    if machine:
        found.append("machine: " + "; ".join(machine))
    return found


def check_same_run(info: RunInfo, suite: Suite, here: Environment, run_dir: str, option: str) -> None:
    """BadInput naming every difference when a run of `suite` started here may not add records to `info`'s."""
    if info.source != "measured":
        raise BadInput(f"a {info.source} run (bench model); only measured runs can be resumed", file=run_dir,
                       field=option)
    found = differences(info, suite, here)
    if found:
        raise BadInput(f"this run's identity differs from here: {' | '.join(found)}; records of one run must come "
                       "from one suite, commit, tree and machine: resume or join it from those, or start a new run",
                       file=run_dir, field=option)
