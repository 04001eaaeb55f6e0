"""`bench export RUN_DIR --format pytest-benchmark|csv|github-action-benchmark|bencher`: a run for other tools.

(github-action-benchmark's customSmallerIsBetter JSON and Bencher's BMF are bench.results.export_ci's.)

pytest-benchmark: the JSON that `pytest --benchmark-json` writes and `pytest-benchmark compare` reads:
`machine_info`, `commit_info`, `benchmarks` (one per measured `ok` (case, impl): name `impl[case_id]`,
group = case_id so that compare puts the implementations of a case side by side, `params` the case fields,
`stats` computed by pytest-benchmark's own Stats class from our raw samples, which are kept in `data`; one
call per sample, so `iterations` is 1). Records that are not measured times - skipped, failed, incorrect, or
modelled - have no pytest-benchmark form and are left out; their count is reported on stderr.

CSV: one row per record, every status and source, flat columns (params expanded, times in seconds).
"""

from __future__ import annotations

import csv
import io
import json
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

from bench.errors import BadInput
from bench.results.export_ci import FORMATS, to_bencher, to_github_action_benchmark
from bench.results.records import Record
from bench.results.store import Run, load_run, write_json_atomic
from bench.spec.case import Case

CSV_COLUMNS = [
    "run_id", "commit", "suite", "case_id", "impl", "source", "status", "reason", "device", "interpreter",
    *[f"param.{f.name}" for f in fields(Case)],  # every case field: a new one is a column without an edit here
    "time_median_s", "time_min_s", "time_max_s", "time_mean_s", "time_std_s", "time_q1_s", "time_q3_s", "time_n",
    "time_rel_ci95", "setup_s", "memory_peak_bytes", "memory_method", "comm_backend", "comm_bytes_total",
    "comm_bytes_max_rank", "comm_expected_bytes", "error_rel_l2", "error_max_abs", "error_tolerance",
    "error_rows_checked", "flops", "flops_per_s", "density", "block_density", "fingerprint",
    "contention_verdict", "contention_cpu_pressure", "contention_load", "contention_cpu_over_wall",
]


def _commit_info(run: Run) -> dict[str, Any]:
    git = run.info.env.git
    return {"id": git.commit or "unversioned", "time": None, "author_time": None,
            "dirty": bool(git.dirty), "project": "sparse-attention-bench", "branch": git.branch or "(unknown)"}


def _machine_info(run: Run) -> dict[str, Any]:
    env = run.info.env
    cpu, host = env.cpu, env.host
    return {
        "node": host.hostname, "processor": cpu.model, "machine": cpu.machine,
        "python_version": env.versions.python, "system": (host.os or "").split("-")[0] or None,
        "release": None, "python_implementation": None, "python_compiler": None,
        "cpu": {"brand_raw": cpu.model, "count": cpu.logical_cores},
        # ours, beyond pytest-benchmark's keys: what makes timings comparable
        "gpus": [g.model_dump(mode="json") for g in env.gpus], "backend": env.backend,
        "versions": env.versions.model_dump(mode="json", by_alias=True), "fingerprint": env.fingerprint,
    }


def _benchmark(run: Run, record: Record) -> dict[str, Any]:
    from pytest_benchmark.stats import Stats

    assert record.time_s is not None
    stats = Stats()
    for sample in record.time_s.samples:
        stats.update(sample)
    measure = run.info.suite.content.get("measure") or {}
    timer = "cuda_event" if str(record.params.get("device", "")).startswith("cuda") else "perf_counter"
    return {
        "group": record.case_id,
        "name": f"{record.impl}[{record.case_id}]",
        "fullname": f"{run.info.suite.name}::{record.impl}[{record.case_id}]",
        "params": record.params,
        "param": record.case_id,
        "extra_info": {"impl": record.impl, "case_id": record.case_id, "device": record.device,
                       "source": record.source, "interpreter": record.interpreter, "setup_s": record.setup_s,
                       "flops": record.flops, "flops_per_s": record.flops_per_s, "density": record.density,
                       "memory_peak_bytes": record.memory.peak_bytes if record.memory else None,
                       "error_rel_l2": record.error.rel_l2 if record.error else None,
                       "comm_bytes_total": record.comm.bytes_total if record.comm else None,
                       "run_id": run.info.run_id},
        "options": {"disable_gc": False, "timer": timer, "min_rounds": measure.get("repeat"),
                    "max_time": measure.get("max_time_s"), "min_time": 0, "warmup": measure.get("warmup")},
        "stats": {**stats.as_dict(), "data": list(record.time_s.samples), "iterations": 1},
    }


def exportable(record: Record, run: Run) -> bool:
    return (record.status == "ok" and record.time_s is not None and record.time_s.n > 0
            and record.source == "measured" and run.info.source == "measured")


def to_pytest_benchmark(run: Run) -> tuple[dict[str, Any], int]:
    """(the pytest-benchmark JSON document, number of records left out)."""
    from pytest_benchmark import __version__

    benchmarks = [_benchmark(run, r) for r in run.records if exportable(r, run)]
    doc = {"machine_info": _machine_info(run), "commit_info": _commit_info(run), "benchmarks": benchmarks,
           "datetime": run.info.started_at, "version": __version__}
    return doc, len(run.records) - len(benchmarks)


def _row(run: Run, r: Record) -> dict[str, Any]:
    t = r.time_s
    row: dict[str, Any] = {
        "run_id": run.info.run_id, "commit": run.info.env.git.commit, "suite": run.info.suite.name,
        "case_id": r.case_id, "impl": r.impl, "source": "modelled" if run.info.source == "modelled" else r.source,
        "status": r.status, "reason": r.reason, "device": r.device, "interpreter": r.interpreter,
        "setup_s": r.setup_s, "flops": r.flops, "flops_per_s": r.flops_per_s, "density": r.density,
        "block_density": r.block_density, "fingerprint": run.info.env.fingerprint,
    }
    # lists and mappings (documents, kv_lens, inputs) as JSON: one cell each, readable back
    row.update({f"param.{k}": json.dumps(v) if isinstance(v, list | dict) else v for k, v in r.params.items()
                if f"param.{k}" in CSV_COLUMNS})
    if r.contention is not None:
        row.update({"contention_verdict": r.contention.verdict, "contention_cpu_pressure": r.contention.cpu_pressure,
                    "contention_load": r.contention.load, "contention_cpu_over_wall": r.contention.cpu_over_wall})
    if t is not None:
        row.update({"time_median_s": t.median, "time_min_s": t.min, "time_max_s": t.max, "time_mean_s": t.mean,
                    "time_std_s": t.std, "time_q1_s": t.q1, "time_q3_s": t.q3, "time_n": t.n,
                    "time_rel_ci95": t.rel_ci95})
    if r.memory is not None:
        row.update({"memory_peak_bytes": r.memory.peak_bytes, "memory_method": r.memory.method})
    if r.comm is not None:
        row.update({"comm_backend": r.comm.backend, "comm_bytes_total": r.comm.bytes_total,
                    "comm_bytes_max_rank": r.comm.bytes_max_rank, "comm_expected_bytes": r.comm.expected_bytes})
    if r.error is not None:
        row.update({"error_rel_l2": r.error.rel_l2, "error_max_abs": r.error.max_abs,
                    "error_tolerance": r.error.tolerance, "error_rows_checked": r.error.rows_checked})
    return row


def to_csv(run: Run) -> str:
    """One row per record of the run, columns CSV_COLUMNS; empty cells for unmeasured fields."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=CSV_COLUMNS, lineterminator="\n")
    writer.writeheader()
    for record in run.records:
        writer.writerow({k: ("" if v is None else v) for k, v in _row(run, record).items()})
    return out.getvalue()


def export_command(run_dir: Path, fmt: str, output: Path | None) -> int:
    run = load_run(run_dir)
    if output is not None and output.is_dir():
        raise BadInput(f"is a directory; -o names the file to write (e.g. {output / ('run.' + fmt.split('-')[0])})",
                       file=str(output), field="-o")
    if output is not None and not output.parent.is_dir():
        raise BadInput("the output file's directory does not exist", file=str(output), field="-o")
    for warning in run.warnings:  # a torn last line: its record is not exported, and the user is told
        print(f"bench export: warning: {warning}", file=sys.stderr)
    if fmt in FORMATS:  # github-action-benchmark, bencher
        doc, left_out = to_github_action_benchmark(run) if fmt == FORMATS[0] else to_bencher(run)
        if left_out:
            print(f"bench export: {left_out} of {len(run.records)} records left out (not measured ok times)",
                  file=sys.stderr)
        if output is None:
            print(json.dumps(doc, indent=2))
        else:
            write_json_atomic(output, doc)
    elif fmt == "pytest-benchmark":
        doc, left_out = to_pytest_benchmark(run)
        if left_out:
            print(f"bench export: {left_out} of {len(run.records)} records left out (not measured ok times: "
                  "skipped, failed, incorrect or modelled); the CSV format keeps every record", file=sys.stderr)
        if output is None:
            print(json.dumps(doc, indent=2))
        else:
            write_json_atomic(output, doc)
    else:
        text = to_csv(run)
        if output is None:
            sys.stdout.write(text)
        else:
            output.write_text(text, encoding="utf-8")
    if output is not None:
        print(f"bench export: wrote {output}", file=sys.stderr)
    return 0
