"""`bench ab`'s janitor: a small child that removes the A/B worktrees when its parent's pipe closes.

`bench ab` makes git worktrees of the revisions it compares. On SIGINT or SIGTERM it removes them itself; a
SIGKILL leaves it no chance, so before making any it starts this janitor through `bench.run.child` (its own
session, so a Ctrl-C at the terminal does not reach it) without the parent-death signal, and tells it
(`Watch`) every path it is about to create. The janitor reads its task pipe until `Exit` or end of file - the
parent's death closes the pipe - and then removes whatever of those paths still exists: `git worktree remove
--force --force`, a plain delete where git refuses, and `git worktree prune`. On a normal end the parent has
removed everything already and the janitor only confirms it.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.run import messages
from bench.run.child import ChildSide

JANITOR_MODULE = "bench.run.ab.janitor"
GIT_TIMEOUT_S = 60.0


def _git(repo: str, *args: str) -> None:
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        subprocess.run(["git", "-C", repo, *args], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=GIT_TIMEOUT_S)


def clean_up(watched: list[messages.Watch]) -> None:
    """Remove every watched path that still exists (worktrees first, then plain directories)."""
    repos: list[str] = []
    for watch in sorted(watched, key=lambda w: w.repo is None):
        path = Path(watch.path)
        if watch.repo is not None:
            if watch.repo not in repos:
                repos.append(watch.repo)
            if path.exists():
                _git(watch.repo, "worktree", "remove", "--force", "--force", str(path))
        if path.exists():
            shutil.rmtree(path, ignore_errors=True)
    for repo in repos:
        _git(repo, "worktree", "prune")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {JANITOR_MODULE}")
    ChildSide.add_arguments(parser)
    args = parser.parse_args(argv)
    side = ChildSide.from_args(args)
    parent_alive = side.start(outlive_parent=True)
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(0)  # clean up (below) and leave

    signal.signal(signal.SIGTERM, stop)
    watched: list[messages.Watch] = []
    try:
        if parent_alive:
            side.send(messages.Ready())
            for obj in side.tasks():
                message = messages.to_janitor(obj)
                if isinstance(message, messages.Exit):
                    break
                watched.append(message)
    except (OSError, ValueError):
        pass  # the parent went away mid-message: clean up what it announced
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        clean_up(watched)
    return 0


if __name__ == "__main__":
    sys.exit(main())
