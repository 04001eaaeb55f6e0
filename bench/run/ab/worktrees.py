"""The checkouts `bench ab` compares: git revisions (temporary worktrees) or directories given as they are.

`resolve_side` turns what the user typed into a `Checkout`: an existing directory holding `bench/` is used as
it is; anything else is a revision of the repository around the current directory, checked out with `git
worktree add --detach` into a temporary directory that `Worktrees` removes on every way out - normally, on an
exception, on SIGINT or SIGTERM (the caller turns them into exceptions), and after a SIGKILL through the
janitor child (bench.run.ab.janitor) that outlives this process. Stale worktree entries of earlier runs are pruned
(`git worktree prune`) before any is made.

A revision that names the commit checked out in a working tree with uncommitted changes to what is measured
(bench/, impls/, the suite's directory, pyproject.toml) is refused: its worktree would not contain them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.errors import BadInput
from bench.run import messages
from bench.run.ab.janitor import JANITOR_MODULE
from bench.run.child import Child, describe_exit

GIT_TIMEOUT_S = 120.0
MEASURED_PATHS = ("bench", "impls", "pyproject.toml")  # besides the suite file's directory


def git(repo: Path, *args: str, check: bool = False) -> subprocess.CompletedProcess[str]:
    """`git -C repo ARGS`, output captured; BadInput when git itself is missing."""
    try:
        out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=GIT_TIMEOUT_S,
                             stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise BadInput("git is not installed; bench ab needs it to check out revisions") from None
    except subprocess.TimeoutExpired:
        raise BadInput(f"git {' '.join(args)} did not finish within {GIT_TIMEOUT_S:g} s", file=str(repo)) from None
    if check and out.returncode != 0:
        raise BadInput(f"git {' '.join(args)} failed: {out.stderr.strip() or out.stdout.strip()}", file=str(repo))
    return out


def repo_root(cwd: Path) -> Path | None:
    out = git(cwd, "rev-parse", "--show-toplevel")
    return Path(out.stdout.strip()) if out.returncode == 0 and out.stdout.strip() else None


def resolve_commit(repo: Path, rev: str) -> str | None:
    out = git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def changed_paths(repo: Path, paths: list[str]) -> list[str]:
    """Uncommitted changes (tracked and untracked, not ignored) under `paths` of the working tree."""
    out = git(repo, "status", "--porcelain", "--untracked-files=all", "--", *paths)
    return [line[3:] for line in out.stdout.splitlines() if line.strip()]


@dataclass
class Checkout:
    """One side: `spec` as typed, the directory its code runs from, its commit (None: not a git checkout)."""

    role: str  # BASE | NEW
    spec: str
    path: Path
    commit: str | None
    worktree: bool  # made by bench ab (and removed by it)

    @property
    def title(self) -> str:
        short = f" ({self.commit[:10]})" if self.commit else ""
        return f"{self.role} {self.spec}{short}"


def is_checkout(path: Path) -> bool:
    return (path / "bench" / "__init__.py").is_file()


def suite_relative(suite: str, cwd: Path, repo: Path | None) -> str:
    """The suite file's path as each side reads it, relative to the side's root where it lies in the repository.

    Inside a repository a path (relative to the current directory, or absolute) is made relative to the
    repository's root, and each side reads its own copy of that file; a path outside the repository stays
    absolute (both sides read that one file, each with its own code). Outside a repository the path is left as
    given: relative paths are then relative to each checkout.
    """
    given = Path(suite)
    if repo is None:
        return suite
    absolute = Path(os.path.normpath(given if given.is_absolute() else cwd / given))
    try:
        return str(absolute.relative_to(repo))
    except ValueError:
        return str(absolute)


class Worktrees:
    """Temporary worktrees of one repository, watched by a janitor; `close()` removes them (idempotent)."""

    def __init__(self, repo: Path) -> None:
        self.repo = repo
        self.tmp = Path(tempfile.mkdtemp(prefix="bench-ab-"))
        self.made: list[Path] = []
        self._janitor: Child | None = None
        git(repo, "worktree", "prune")  # entries of worktrees removed without git (a crash before this janitor)
        self._janitor = _start_janitor()
        self._janitor.send(messages.Watch(path=str(self.tmp)))

    def add(self, name: str, commit: str) -> Path:
        path = self.tmp / name
        assert self._janitor is not None
        self._janitor.send(messages.Watch(path=str(path), repo=str(self.repo)))  # before it exists: no gap
        out = git(self.repo, "worktree", "add", "--detach", str(path), commit)
        if out.returncode != 0:
            raise BadInput(f"git worktree add {commit[:10]} failed: {out.stderr.strip()}", file=str(self.repo))
        self.made.append(path)
        return path

    def close(self) -> None:
        for path in self.made:
            if path.exists():
                git(self.repo, "worktree", "remove", "--force", "--force", str(path))
            if path.exists():
                shutil.rmtree(path, ignore_errors=True)
        self.made = []
        git(self.repo, "worktree", "prune")
        shutil.rmtree(self.tmp, ignore_errors=True)
        if self._janitor is not None:
            self._janitor.close(messages.Exit(), grace_s=30.0)
            self._janitor = None


def _start_janitor() -> Child:
    child = Child(JANITOR_MODULE, [], with_tasks=True)
    first = child.receive(time.monotonic() + 60.0)
    if not first or first.get("type") != "ready":
        code = child.wait(1.0)
        child.kill()
        raise RuntimeError(f"the worktree janitor did not start ({describe_exit(code)})")
    return child


def checkout_dir(role: str, spec: str, path: Path) -> Checkout:
    """A directory given as a side: a checkout of this project, measured as it is (uncommitted changes too)."""
    if not is_checkout(path):
        raise BadInput(f"{role}: {spec!r} is a directory without bench/__init__.py; give a checkout of this project "
                       "or a git revision")
    path = path.resolve()
    root = repo_root(path)
    return Checkout(role, spec, path, resolve_commit(root, "HEAD") if root is not None else None, worktree=False)


def check_revision(role: str, spec: str, cwd: Path, repo: Path | None, suite_rel: str) -> str:
    """The commit `spec` names in `repo`; BadInput for an unknown revision or a dirty checked-out commit."""
    if repo is None:
        raise BadInput(f"{role}: {spec!r} is not a directory, and {cwd} is not in a git repository where it could be "
                       "a revision")
    commit = resolve_commit(repo, spec)
    if commit is None:
        raise BadInput(f"{role}: unknown revision {spec!r} in {repo} (not a branch, tag or commit that "
                       "`git rev-parse` can resolve)")
    if commit == resolve_commit(repo, "HEAD"):
        suite_dir = [] if Path(suite_rel).is_absolute() else [str(Path(suite_rel).parent)]
        changed = changed_paths(repo, [*MEASURED_PATHS, *suite_dir])
        if changed:
            listed = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
            raise BadInput(f"{role}: {spec!r} is the checked-out commit {commit[:10]}, but the working tree has "
                           f"uncommitted changes a worktree of it would not contain ({listed}); commit them, or "
                           "give the working tree itself as a directory (e.g. `.`) to measure it as it is")
    return commit
