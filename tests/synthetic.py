"""Synthetic run directories for compare/history/export tests, written with the real record models and store.

`write_run(root, commit=..., records=[...])` makes `root/<run_id>/{run.json,records.jsonl}` exactly as
`bench run` would (RunInfo/Record validation, atomic run.json, fsynced appends), so the code under test reads
what it reads in production, without spending minutes measuring.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from bench.measure.timing import summarize
from bench.results.records import Record, RunInfo, SuiteInfo
from bench.results.store import RECORDS, RUN_JSON, RecordWriter, write_json_atomic

FINGERPRINT = "f00dcafe12345678"


def params(pattern: str = "local", seq_len: int = 128, **extra: Any) -> dict[str, Any]:
    base = {"batch": 1, "heads": 2, "head_dim": 32, "seq_len": seq_len, "dtype": "float32", "pattern": pattern,
            "window": 16, "density": None, "block_size": 32, "dilation": 1, "global_tokens": 0, "seed": 0,
            "mode": "fwd", "checkpoint": False, "world_size": 1, "device": "cpu"}
    base.update(extra)
    return base


def record(case_id: str, impl: str, samples: list[float] | np.ndarray | None, *, status: str = "ok",
           flops: float = 4.0e6, rel_l2: float | None = 1e-7, **fields: Any) -> Record:
    """A record as `bench run` writes it; `samples` in seconds (None: no timing, as for a skip)."""
    body: dict[str, Any] = {"case_id": case_id, "impl": impl, "params": params(), "status": status,
                            "flops": flops, "density": 0.25, "block_density": 0.5, "device": "cpu: test"}
    if samples is not None:
        body["time_s"] = summarize([float(s) for s in samples], "precision").model_dump()
    if rel_l2 is not None and status in ("ok", "incorrect"):
        body["error"] = {"max_abs": rel_l2, "rel_l2": rel_l2, "tolerance": 1e-4, "rows_checked": 128}
    if status != "ok" and "reason" not in fields:
        body["reason"] = f"synthetic {status}"
    body.update(fields)
    return Record.model_validate(body)


def write_run(root: Path, *, commit: str, records: list[Record], started_at: str = "2026-01-01T00:00:00.000000Z",
              suite: str = "smoke", fingerprint: str = FINGERPRINT, source: str = "measured",
              dirty: bool = False, cpu: str = "Test CPU", finished: bool = True,
              command: list[str] | None = None) -> Path:
    stamp = started_at[:19].replace("-", "").replace(":", "")
    run_id = f"{stamp}-{commit[:7]}-{suite}"
    run_dir = Path(root) / run_id
    run_dir.mkdir(parents=True)
    env = {"git": {"commit": commit, "branch": "main", "dirty": dirty}, "host": {"hostname": "test", "os": "Linux"},
           "cpu": {"model": cpu, "logical_cores": 2, "usable_cores": 2, "machine": "x86_64"}, "gpus": [],
           "versions": {"python": "3.11", "torch": "2.13.0", "cuda": None, "triton": "3.9"}, "backend": "cpu",
           "fingerprint": fingerprint}
    info = RunInfo(run_id=run_id, suite=SuiteInfo(name=suite, file=None, content={"name": suite}),
                   started_at=started_at, finished_at=started_at if finished else None, env=env, source=source,
                   command=command)
    write_json_atomic(run_dir / RUN_JSON, info.model_dump(mode="json"))
    with RecordWriter(run_dir / RECORDS) as writer:
        for r in records:
            writer.append(r)
    return run_dir


def noisy(rng: np.random.Generator, median: float, n: int = 20, sigma: float = 0.02) -> np.ndarray:
    """`n` log-normal timing samples around `median` seconds with log-spread `sigma`."""
    return median * rng.lognormal(0.0, sigma, n)


def commit_id(i: int) -> str:
    """A distinct 40-hex-digit commit id per integer."""
    return f"{i:07x}" + "ab" * 16 + "c"
