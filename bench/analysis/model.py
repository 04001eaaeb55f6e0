"""`bench model SUITE --gpu KEY`: lower-bound times for hardware that is not here, from FLOPs, bytes and peaks.

For each case three ideal fused kernels are bounded (roofline: time >= max(FLOPs / peak FLOP/s, bytes /
memory bandwidth)), each written as a record whose `impl` names the bound:

- `bound_dense`: every (query, key) pair computed, a FlashAttention-style kernel that skips nothing;
- `bound_block`: only the blocks of the pattern's block layout at the case's block_size (block-sparse kernels);
- `bound_sparse`: only the allowed pairs (the useful FLOPs of bench.measure.case.flops).

Bytes are the least any kernel must move: q, k, v read and the output written once forward; in fwd_bwd also
q, k, v, the output and its gradient read and dq, dk, dv written. The peak is the datasheet's tensor-core
rate of the dtype (TF32 for float32, the fastest unit an implementation may use). No kernel reaches these
times; they say how far a measurement is from the hardware's limit and where sparsity could pay off.

The run is marked `source: "modelled"` in run.json and in every record, its directory name says `model`,
and each record's `device` names the modelled card and says it is a model: it is never a measurement.
"""

from __future__ import annotations

import platform
import socket
import sys
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from bench.console.format import format_gib, format_seconds
from bench.errors import BadInput
from bench.measure.case import flops as flop_counts
from bench.measure.machine.env import git_info, versions
from bench.measure.machine.hardware import HardwareSpec, resolve
from bench.measure.memory_model import kv_tensor_bytes, tensor_bytes
from bench.results.records import Record, RunInfo, SuiteInfo
from bench.results.store import RECORDS, RUN_JSON, RecordWriter, create_run_dir, utc_now, write_json_atomic
from bench.spec.case import Case
from bench.spec.suite import load_suite

BOUNDS = ("bound_dense", "bound_block", "bound_sparse")


def min_bytes(case: Case) -> int:
    """Bytes any attention kernel must move at least: q, k, v and the output forward (k and v at kv_heads);
    in fwd_bwd also the upstream gradient, dq, dk, dv and a second read of q, k, v and the output."""
    per_pass = 2 * tensor_bytes(case) + 2 * kv_tensor_bytes(case)
    return (3 if case.mode == "fwd_bwd" else 1) * per_pass


def block_pairs(layout: torch.Tensor, seq_len: int, block_size: int, q_len: int | None = None) -> int:
    """(query, key) pairs inside the layout's kept blocks; the last block row/column may be short."""
    rows = seq_len if q_len is None else q_len
    nqb, nkb = layout.shape
    row_sizes = torch.full((nqb,), block_size, dtype=torch.float64)
    row_sizes[-1] = rows - block_size * (nqb - 1)
    col_sizes = torch.full((nkb,), block_size, dtype=torch.float64)
    col_sizes[-1] = seq_len - block_size * (nkb - 1)
    return int(row_sizes @ layout.to(torch.float64) @ col_sizes)


def bound(case: Case, pairs: int, spec: HardwareSpec) -> dict[str, Any]:
    """Roofline lower bound of one call computing `pairs` pairs per head on `spec`."""
    flops = flop_counts.attention_flops(case, pairs)
    peak, unit = spec.peak_flops(case.dtype, tf32=True)
    nbytes = min_bytes(case)
    compute_s, memory_s = flops / peak, nbytes / spec.memory_bandwidth
    return {"flops": flops, "bytes": nbytes, "time_s": max(compute_s, memory_s), "compute_s": compute_s,
            "memory_s": memory_s, "bound_by": "compute" if compute_s >= memory_s else "memory",
            "peak_flops": peak, "unit": unit, "bandwidth": spec.memory_bandwidth}


def device_label(spec: HardwareSpec) -> str:
    return f"model: {spec.name} (datasheet figures; not a measurement)"


def model_records(case: Case, case_id: str, spec: HardwareSpec) -> list[Record]:
    """The three bound records of one case (or skipped ones saying why it is not modelled)."""
    base: dict[str, Any] = {"case_id": case_id, "params": case.params(), "source": "modelled",
                            "device": device_label(spec), "started_at": utc_now()}
    if case.world_size > 1:
        return [Record(**base, impl=name, status="skipped", reason="world_size > 1: communication is not modelled")
                for name in BOUNDS]
    needed = min_bytes(case)
    if needed > spec.memory_bytes:
        reason = (f"memory model: inputs and outputs alone need {format_gib(needed)}; {spec.key} has "
                  f"{format_gib(spec.memory_bytes)}")
        memory = {"peak_bytes": needed, "method": "model", "note": "modelled lower bound"}
        return [Record(**base, impl=name, status="skipped", reason=reason, memory=memory) for name in BOUNDS]
    pattern = case.make_pattern()
    layout = pattern.block_layout(case.block_size)
    pairs = {"bound_dense": case.n_queries * case.seq_len,
             "bound_block": block_pairs(layout, case.seq_len, case.block_size, case.n_queries),
             "bound_sparse": pattern.nnz}
    base.update(density=pattern.density, block_density=float(layout.sum()) / layout.numel(),
                flops_dense=flop_counts.dense_flops(case))
    useful = flop_counts.useful_flops(case, pattern.nnz)
    records = []
    for name in BOUNDS:
        b = bound(case, pairs[name], spec)
        t = b["time_s"]
        time_s = {"median": t, "min": t, "max": t, "mean": t, "std": 0.0, "q1": t, "q3": t, "n": 0,
                  "samples": [], "ci95": None, "rel_ci95": None, "stopped_by": "model"}
        rate = useful / t  # useful FLOP/s, as measured records report it
        records.append(Record(
            **base, impl=name, status="ok", time_s=time_s, flops=useful, flops_per_s=rate,
            peak={"fraction": rate / b["peak_flops"], "peak_flops": b["peak_flops"], "source": "datasheet",
                  "hardware": f"{spec.key} {b['unit']}"},
            memory={"peak_bytes": b["bytes"], "method": "model", "note": "least bytes moved by an ideal kernel"},
            config={"hardware": spec.key, "pairs": pairs[name], **{k: v for k, v in b.items() if k != "time_s"}}))
    return records


def model_command(suite_path: Path, gpu: str, out: Path, console: Console) -> int:
    """Write a modelled run of `suite_path` for `gpu` under `out`; returns the exit code."""
    try:
        spec = resolve(gpu)
    except ValueError as exc:
        raise BadInput(str(exc), field="--gpu") from None
    suite = load_suite(suite_path)
    git = git_info()
    # Where the model was computed, not what it models: that is `modelled_hardware`.
    env = {"backend": "model", "modelled_hardware": spec.to_json(), "git": git.model_dump(),
           "fingerprint": f"model-{spec.key}", "host": {"hostname": socket.gethostname(), "os": platform.platform()},
           "cpu": {}, "gpus": [], "versions": versions().model_dump(by_alias=True)}
    run_id, run_dir = create_run_dir(out, f"model-{spec.key}-{suite.name}"[:100], git.commit or "nogit")
    info = RunInfo(run_id=run_id, suite=SuiteInfo(name=suite.name, file=str(suite_path), content=suite.content),
                   started_at=utc_now(), env=env, source="modelled", command=sys.argv[1:] or None)
    write_json_atomic(run_dir / RUN_JSON, info.model_dump(mode="json"))
    table = Table(title=f"lower bounds on {spec.name} (model, not a measurement)")
    table.add_column("case", no_wrap=True)
    for name in BOUNDS:
        table.add_column(name, justify="right")
    with RecordWriter(run_dir / RECORDS) as writer:
        for case in suite.cases:
            records = model_records(case, case.case_id, spec)
            for record in records:
                writer.append(record)
            table.add_row(case.label, *(format_seconds(r.time_s.median) if r.time_s else r.status for r in records))
    write_json_atomic(run_dir / RUN_JSON, {**info.model_dump(mode="json"), "finished_at": utc_now()})
    table.caption = ("roofline lower bounds from datasheet peaks (launch overheads and softmax not counted); "
                     "no kernel reaches them")
    console.print(table)
    console.print(f"modelled run: {run_dir}")
    return 0

