"""Shards: one run's (case, impl) pairs split over several `bench run --shard I/N` processes (docs/cluster.md).

Every shard computes the same split (`split`): pairs in suite order, the heaviest first (a pair weighs its
world_size: its ranks), each to the shard with the least weight so far (ties: the lower index). A multi-rank
pair is one pair, so it stays whole. Shards given the same run id share one run directory: the first creates
run.json under the run's lock (`run_lock`), the others check that it was made from the same suite. Each shard
appends only to its own part, records.<I>of<N>.jsonl, and holds an exclusive lock on it while it runs
(`PartLock`): a second process of the same shard is refused (exit 2) instead of measuring the same pairs again,
and a shard that is killed releases it with its process. A shard measures the pairs of its part that no part of
the run holds yet, so a resubmitted shard (even under another N) measures only what is missing.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from bench.errors import BadInput
from bench.results.store import part_name

LOCK_FILE = ".lock"  # in the run directory: run.json's creation and its finish


@dataclass(frozen=True)
class ShardSpec:
    index: int
    count: int

    @property
    def part(self) -> str:
        return part_name(self.index, self.count)

    @property
    def label(self) -> str:
        return f"{self.index}/{self.count}"


def parse_shard(text: str) -> ShardSpec:
    """`I/N` with 0 <= I < N."""
    match = re.fullmatch(r"(\d+)/(\d+)", text.strip())
    if not match:
        raise BadInput(f"got {text!r}; expected I/N, two integers with 0 <= I < N (e.g. 0/4)", field="--shard")
    index, count = int(match[1]), int(match[2])
    if count < 1 or index >= count:
        raise BadInput(f"got {text!r}; the shard index I must satisfy 0 <= I < N (here N = {count}, so I in "
                       f"0..{max(count - 1, 0)})", field="--shard")
    return ShardSpec(index, count)


def derived_run_id(suite_name: str, commit: str | None) -> str:
    """Shards started without --run-id agree on one: the checked-out commit's time, its id and the suite."""
    if not commit:
        raise BadInput("--shard without --run-id derives the run id from the git commit, and there is none here; "
                       "give every shard the same --run-id", field="--run-id")
    root = Path(__file__).resolve().parents[3]  # the checkout: bench/run/cluster/ -> /
    try:
        out = subprocess.run(["git", "-C", str(root), "log", "-1", "--format=%ct", commit], capture_output=True,
                             text=True, timeout=30, check=True).stdout.strip()
        stamp = datetime.fromtimestamp(int(out), timezone.utc)
    except (OSError, subprocess.SubprocessError, ValueError):
        raise BadInput(f"cannot read the time of commit {commit[:7]} to derive the run id; give every shard the "
                       "same --run-id", field="--run-id") from None
    short = re.sub(r"[^0-9a-z]", "", commit.lower())[:7]
    return f"{stamp:%Y%m%dT%H%M%S}-{short}-{suite_name}"


def split(weights: Sequence[int], count: int) -> list[list[int]]:
    """Indices of the pairs of each of `count` shards (each in suite order); the same on every machine."""
    loads = [0] * count
    parts: list[list[int]] = [[] for _ in range(count)]
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        target = min(range(count), key=lambda s: (loads[s], s))
        loads[target] += weights[i]
        parts[target].append(i)
    return [sorted(p) for p in parts]


def split_rank_groups(world_sizes: Sequence[int], count: int) -> list[list[int]]:
    """With rank groups as shards of their own (`bench submit --nodes-per-rank-group K`, which launches each
    across K nodes): shard g < G holds every pair of the g-th world size above 1 (ascending), the other count - G
    shards split the single-rank pairs as `split` does."""
    groups = sorted({w for w in world_sizes if w > 1})
    singles = [i for i, w in enumerate(world_sizes) if w == 1]
    if singles and count <= len(groups):
        raise BadInput(f"got {count} shards; with rank groups as shards of their own, the {len(groups)} world sizes "
                       f"{groups} take the first {len(groups)} and the single-rank pairs need at least one more",
                       field="--shard")
    parts = [[i for i, w in enumerate(world_sizes) if w == g] for g in groups]
    rest = split([1] * len(singles), count - len(groups)) if count > len(groups) else []
    return parts + [[singles[i] for i in part] for part in rest]


@contextlib.contextmanager
def run_lock(run_dir: Path) -> Iterator[None]:
    """Exclusive lock of a run directory (blocking): creating run.json, setting finished_at."""
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


class PartLock:
    """An exclusive, non-blocking lock on one shard's part for as long as the shard runs."""

    def __init__(self, run_dir: Path, shard: ShardSpec) -> None:
        path = run_dir / f".{shard.part}.lock"
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 64, 0).decode(errors="replace").strip() or "another process"
            os.close(self.fd)
            raise BadInput(f"shard {shard.label} of this run is being written by {holder}; wait for it to end (or "
                           "end it) before starting that shard again", file=str(run_dir), field="--shard") from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"pid {os.getpid()} on {os.uname().nodename}".encode(), 0)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
