"""Run directories on disk: creating them, appending records safely, reading them back with validation.

`results/<run_id>/run.json` is replaced atomically (write to a temporary file, fsync, rename), so a reader
never sees half of it. `records.jsonl` is append-only; each record is one line, flushed and fsynced as
soon as it is measured. A process killed mid-write can leave a torn last line (no trailing newline): it is
detected, reported as a warning, dropped, and re-measured on `--resume`. Any other bad line is corruption
and is named with its file and line number.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from bench.errors import BadInput
from bench.results.records import SCHEMA_VERSION, Record, RecordGit, RunInfo

RUN_JSON = "run.json"
RECORDS = "records.jsonl"
# A shard of a run (bench run --shard I/N) writes its own part, records.<I>of<N>.jsonl; a run is all its parts.
PART_RE = re.compile(r"^records\.(\d+)of(\d+)\.jsonl$")
# The one directory of the store that is not a run: `bench calibrate`'s rates per fingerprint
# (bench.measure.machine.calibrate).
CALIBRATION_DIR = "calibration"


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def write_json_atomic(path: Path, data: Any) -> None:
    """Replace `path` with JSON `data` so that readers see the old or the new file, never a mix."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, allow_nan=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_output_dir(out: Path, option: str, holds: str) -> None:
    """An output directory a command will make if missing: a directory, or one to make in an existing directory (a
    mistyped path is refused rather than made with every missing parent). `holds`: what goes in it, for the message."""
    if out.exists() and not out.is_dir():
        raise BadInput(f"exists and is not a directory; {option} is {holds}", file=str(out), field=option)
    if not out.exists() and not out.parent.is_dir():
        raise BadInput(f"its parent {out.parent} does not exist; give an existing directory or one to make in an "
                       "existing directory", file=str(out), field=option)


def create_run_dir(root: Path, suite_name: str, commit: str) -> tuple[str, Path]:
    """Make `root/<UTC yyyymmddTHHMMSS>-<short commit>-<suite>` atomically; a taken id waits for the next second.

    Two runs started in the same second into the same root get distinct ids: mkdir is atomic, and the
    loser of the race takes the following second.
    """
    if not re.fullmatch(r"[a-z0-9_-]+", suite_name):
        raise BadInput(f"got {suite_name!r}; must match [a-z0-9_-]+", field="name")
    short = re.sub(r"[^0-9a-z]", "", commit.lower())[:7] or "nogit"
    root.mkdir(parents=True, exist_ok=True)
    while True:
        run_id = f"{datetime.now(timezone.utc):%Y%m%dT%H%M%S}-{short}-{suite_name}"
        run_dir = root / run_id
        try:
            run_dir.mkdir()
            return run_id, run_dir
        except FileExistsError:
            time.sleep(0.25)


class RecordWriter:
    """Appends records to records.jsonl, each flushed and fsynced before `append` returns; `git` (the commit) and
    `code` (digests of measured code outside git): the code that measured them, stamped on every record that does
    not say it already."""

    def __init__(self, path: Path, git: RecordGit | None = None, code: dict[str, str] | None = None) -> None:
        self.path = Path(path)
        self.git, self.code = git, code
        self._file = open(self.path, "ab")  # noqa: SIM115 - held open for the run

    def append(self, record: Record) -> None:
        if record.git is None and self.git is not None:
            record = record.model_copy(update={"git": self.git})
        if record.code is None and self.code:
            record = record.model_copy(update={"code": self.code})
        line = record.to_json().encode("utf-8") + b"\n"
        self._file.write(line)
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class RecordsFile:
    records: list[Record]
    warnings: list[str] = field(default_factory=list)
    torn_tail_bytes: int = 0  # bytes after the last newline (a torn write)


def read_records(path: Path) -> RecordsFile:
    """Validate every line of a records.jsonl. Raises BadInput naming the file and line of a bad one."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise BadInput(f"cannot read: {exc.strerror}", file=str(path)) from None
    result = RecordsFile([])
    end = data.rfind(b"\n") + 1
    if end < len(data):
        result.torn_tail_bytes = len(data) - end
        result.warnings.append(f"{path}: last line is incomplete ({len(data) - end} bytes, a write torn by "
                               "a kill); it is ignored and its (case, impl) counts as not measured")
    for number, raw in enumerate(data[:end].split(b"\n")[:-1], start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise BadInput(f"line {number} is not valid JSON ({exc}); expected one record object per line",
                           file=str(path)) from None
        result.records.append(_validate_record(obj, path, number))
    return result


def _validate_record(obj: Any, path: Path, line: int) -> Record:
    if isinstance(obj, dict) and obj.get("schema_version") not in (None, SCHEMA_VERSION):
        raise BadInput(f"line {line}: schema_version {obj.get('schema_version')!r}; this version reads "
                       f"{SCHEMA_VERSION}", file=str(path))
    try:
        return Record.model_validate(obj)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "(record)"
        raise BadInput(f"line {line}: field {where}: {err['msg']} (got {str(err.get('input'))[:60]!r})",
                       file=str(path)) from None


def drop_torn_tail(path: Path) -> int:
    """Truncate records.jsonl after its last complete line, so appends start on a fresh line."""
    path = Path(path)
    if not path.exists():
        return 0
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with open(path, "r+b") as f:
            f.truncate(end)
            f.flush()
            os.fsync(f.fileno())
    return len(data) - end


def read_run_info(run_dir: Path) -> RunInfo:
    path = Path(run_dir) / RUN_JSON
    if not path.is_file():
        raise BadInput("not a run directory (no run.json)", file=str(run_dir))
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadInput(f"not valid JSON: {exc}", file=str(path)) from None
    try:
        return RunInfo.model_validate(obj)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        got = repr(err.get("input"))
        got = got if len(got) <= 60 else got[:57] + "..."
        raise BadInput(f"field {where}: got {got}; {err['msg']}", file=str(path)) from None


@dataclass
class Run:
    path: Path
    info: RunInfo
    records: list[Record]
    warnings: list[str] = field(default_factory=list)


def first_per_pair(records: list[Record]) -> tuple[list[Record], int]:
    """One record per (case, impl), the first written: the one rule for a run that holds a pair twice (a resume
    that raced, a shard resubmitted while its first process still ran). Every reader goes through `load_run`
    or `read_run_records`, which apply it. (kept, dropped)"""
    seen: set[tuple[str, str]] = set()
    kept = []
    for r in records:
        if (r.case_id, r.impl) not in seen:
            seen.add((r.case_id, r.impl))
            kept.append(r)
    return kept, len(records) - len(kept)


def part_name(index: int, count: int) -> str:
    return f"records.{index}of{count}.jsonl"


def records_files(run_dir: Path) -> list[Path]:
    """Every records file of a run: records.jsonl, then the shards' parts in (count, index) order."""
    run_dir = Path(run_dir)
    parts = []
    for path in run_dir.glob("records.*of*.jsonl"):
        match = PART_RE.match(path.name)
        if match:
            parts.append(((int(match[2]), int(match[1])), path))
    main = [run_dir / RECORDS] if (run_dir / RECORDS).exists() else []
    return main + [path for _, path in sorted(parts)]


def read_run_records(run_dir: Path) -> RecordsFile:
    """The records of every part of a run as one list, one per (case, impl) by `first_per_pair` (files in
    `records_files` order), with a warning naming how many later records were set aside."""
    merged = RecordsFile([])
    everything: list[Record] = []
    for path in records_files(run_dir):
        parsed = read_records(path)
        merged.warnings.extend(parsed.warnings)
        everything.extend(parsed.records)
    merged.records, dropped = first_per_pair(everything)
    if dropped:
        merged.warnings.append(f"{run_dir}: {dropped} later records of pairs already recorded were set aside (the "
                               "first record of a pair counts)")
    return merged


def load_run(run_dir: Path) -> Run:
    """A run directory, validated: run.json and every complete line of its records files (all shards' parts),
    one record per pair."""
    run_dir = Path(run_dir)
    info = read_run_info(run_dir)
    parsed = read_run_records(run_dir)
    return Run(run_dir, info, parsed.records, parsed.warnings)
