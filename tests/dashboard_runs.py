"""A synthetic results store that exercises every dashboard view, written with the real record models and store.

Times follow known laws so that tests can check the figures' data exactly:
- dense: T_DENSE[seq_len] whatever the pattern; sdpa: half of dense;
- csr: dense * (0.2 + 1.6 * density) on block_random, so its break-even density against dense is exactly 0.5
  and against sdpa exactly 0.1875 (0.2 + 1.6 p = 0.5);
- triton_block_sparse: interpreter records (CPU emulation), 10x dense;
- naive_loop: out of memory at the largest seq_len, flex: skipped with a reason;
- cp_ring / tp_heads: world sizes 2 and 4 with communication bytes; one cp_ring record off its closed form;
- a modelled run of an H100 with peak fractions;
- three commits of the smoke-like suite where dense gets 2x slower at the third;
- a `workloads` suite (`workload_records`): causal prefill as MHA H8 (some records written before the new case
  fields existed, one with kv_heads and q_len written out as their defaults), GQA H32/8 and MQA H8/1; decode
  (q_len 1) over a growing KV cache as GQA H32/8; and, in bfloat16, a documents sweep at one length (1 to 64
  documents, 64 given as a list of lengths) where flex's time and memory fall as 1/documents.
Samples are the median times (1 + small symmetric offsets), so every median is exactly the law's value.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from bench.dashboard.data import Row, current_rows, facets, rows_from_runs
from bench.results.records import Record
from tests.synthetic import commit_id, params, record, write_run

T_DENSE = {128: 1e-3, 256: 4e-3, 512: 16e-3}
DENSITIES = (0.1, 0.3, 0.6, 0.9)
WINDOWS = (16, 32)
CPU = "cpu: Test CPU"
H100 = "NVIDIA H100 SXM (model)"


def samples(median: float, n: int = 11) -> list[float]:
    """n samples whose median is exactly `median` (odd n, symmetric offsets)."""
    return [median * (1 + 0.01 * x) for x in np.linspace(-1, 1, n)]


def case_id(p: dict[str, Any]) -> str:
    extra = f"-p{p['world_size']}" if p["world_size"] > 1 else ""
    field = f"p{p['density']}" if p["pattern"] == "block_random" else f"w{p['window']}"
    return f"{p['pattern']}_{field}-n{p['seq_len']}-{p['dtype']}-{p['mode']}{extra}"


def rec(impl: str, p: dict[str, Any], median: float | None, *, device: str = CPU, **fields: Any) -> Record:
    body = {"params": p, "device": device, "density": p.get("density") or 0.25, **fields}
    return record(case_id(p), impl, samples(median) if median is not None else None, **body)


def sweep_records() -> list[Record]:
    out = []
    for n, t in T_DENSE.items():
        for w in WINDOWS:
            p = params("local", n, window=w)
            out += [rec("dense", p, t), rec("sdpa", p, t / 2),
                    rec("csr", p, t * w / n * 4, memory={"peak_bytes": n * w * 64, "method": "rss_hwm"}),
                    rec("triton_block_sparse", p, t * 10, interpreter=True),
                    rec("flex", p, None, status="skipped", reason="flex needs torch.compile on this device")]
            if n == 512:
                out.append(rec("naive_loop", p, None, status="failed",
                               reason="out of memory during call: tried to allocate 2.0 GiB"))
            else:
                out.append(rec("naive_loop", p, t * 100, memory={"peak_bytes": n * n * 16, "method": "rss_hwm"}))
        for d in DENSITIES:
            p = params("block_random", n, density=d)
            out += [rec("dense", p, t, memory={"peak_bytes": n * n * 8, "method": "rss_hwm"}), rec("sdpa", p, t / 2),
                    rec("csr", p, t * (0.2 + 1.6 * d))]
    # one incorrect record
    p = params("local", 128, window=16, dtype="float16")
    out.append(rec("csr", p, 1e-3, status="incorrect", rel_l2=0.5))
    return out


def comm_records() -> list[Record]:
    out = []
    for world in (2, 4):
        p = params("local", 256, window=16, world_size=world, heads=4)
        ring_expected = (world - 1) * 2 * 256 * 4 * 32 * 4  # K and V, fp32, passed P-1 times
        ring_counted = ring_expected if world == 2 else ring_expected + 4096  # one off its closed form
        out.append(rec("cp_ring", p, 2e-3, comm={
            "backend": "gloo", "bytes_total": ring_counted, "bytes_max_rank": ring_counted // world,
            "by_op": {"send_recv": {"calls": world - 1, "bytes_total": ring_counted,
                                    "bytes_max_rank": ring_counted // world}},
            "expected_bytes": ring_expected, "world_size": world,
            "per_rank": [{"rank": r, "bytes": ring_counted // world, "flops": 1e6 * (r + 1), "comm_s": 1e-3,
                          "hidden_s": 4e-4, "compute_s": 1e-3} for r in range(world)],
            "imbalance": world / ((world + 1) / 2), "overlap_fraction": 0.4,
            "by_level": {"ring": {"calls": world - 1, "bytes_total": ring_counted,
                                  "bytes_max_rank": ring_counted // world, "expected_bytes": ring_expected}}}))
        ar = 2 * (world - 1) * 256 * 4 * 32 * 4 // world * world
        out.append(rec("tp_heads", p, 1e-3, comm={
            "backend": "gloo", "bytes_total": ar, "bytes_max_rank": ar // world,
            "by_op": {"all_reduce": {"calls": 1, "bytes_total": ar, "bytes_max_rank": ar // world}},
            "expected_bytes": ar, "world_size": world, "imbalance": 1.0, "overlap_fraction": 0.0}))
    return out


def model_records() -> list[Record]:
    out = []
    for n, t in T_DENSE.items():
        p = params("local", n, window=16, device="cuda")
        for impl, scale, fraction in (("dense", 1e-2, 0.4), ("csr", 5e-3, 0.1)):
            out.append(rec(impl, p, t * scale, device=H100, source="modelled", flops_per_s=1e14 * fraction,
                           peak={"fraction": fraction, "peak_flops": 989e12, "source": "datasheet",
                                 "hardware": "H100 SXM"}))
    return out


def history_records(step: bool) -> list[Record]:
    out = []
    for n, t in T_DENSE.items():
        p = params("local", n, window=16)
        out += [rec("dense", p, t * (2 if step else 1)), rec("sdpa", p, t / 2)]
    return out


WORKLOAD_N = (1024, 2048, 4096)
DECODE_N = (1024, 4096, 16384)
DOCUMENTS = (1, 4, 16, 64)
DOCS_N = 8192
T_DOCS_DENSE = 64e-3  # dense at DOCS_N, whatever the documents


def new_fields(**given: Any) -> dict[str, Any]:
    """The case fields added with the workloads, at their defaults unless given (as bench.spec.case writes them)."""
    return {"kv_heads": None, "q_len": None, "documents": None, "prefix": 0, "image_width": None, **given}


def workload_case_id(p: dict[str, Any]) -> str:
    q = f"q{p['q_len']}" if p.get("q_len") not in (None, p["seq_len"]) else ""
    kv = f"kv{p['kv_heads']}" if p.get("kv_heads") not in (None, p["heads"]) else ""
    docs = p.get("documents")
    doc = "" if docs is None else f"_docs{len(docs) if isinstance(docs, list) else docs}"
    return f"{p['pattern']}{doc}-n{p['seq_len']}{q}-b1h{p['heads']}{kv}d64-{p['dtype']}-{p['mode']}"


def workload_rec(impl: str, p: dict[str, Any], median: float | None, **fields: Any) -> Record:
    body = {"params": p, "device": CPU, "density": 0.5, **fields}
    return record(workload_case_id(p), impl, samples(median) if median is not None else None, **body)


def workload_records() -> list[Record]:
    out = []
    for n in WORKLOAD_N:
        t = 1e-3 * (n / 1024) ** 2
        for heads, kv_heads in ((8, None), (32, 8), (8, 1)):
            if kv_heads is None and n < 4096:  # MHA records of a run made before the new fields existed
                p = params("causal", n, heads=heads, head_dim=64)
            elif kv_heads is None:  # written out as heads and seq_len: still the defaults
                p = params("causal", n, heads=heads, head_dim=64, **new_fields(kv_heads=8, q_len=n))
            else:
                p = params("causal", n, heads=heads, head_dim=64, **new_fields(kv_heads=kv_heads))
            out += [workload_rec("dense", p, t * heads / 8), workload_rec("sdpa", p, t * heads / 16)]
    for n in DECODE_N:  # one query over a KV cache of n keys
        p = params("causal", n, heads=32, head_dim=64, **new_fields(kv_heads=8, q_len=1))
        out += [workload_rec("dense", p, 1e-5 * n / 1024), workload_rec("sdpa", p, 0.5e-5 * n / 1024)]
    for docs in DOCUMENTS:
        given: int | list[int] = [DOCS_N // docs] * docs if docs == 64 else docs
        p = params("causal", DOCS_N, heads=8, head_dim=64, dtype="bfloat16", **new_fields(documents=given))
        out += [workload_rec("dense", p, T_DOCS_DENSE, memory={"peak_bytes": 2**30, "method": "rss_hwm"}),
                workload_rec("flex", p, T_DOCS_DENSE / docs, memory={"peak_bytes": 2**24 // docs, "method": "rss_hwm"})]
        if docs == 64:
            out.append(workload_rec("sdpa", p, None, status="skipped", reason="sdpa: 64 documents need a dense mask"))
        else:
            out.append(workload_rec("sdpa", p, T_DOCS_DENSE / 2))
    return out


def write_store(root: Path) -> dict[str, Path]:
    """Every synthetic run under `root`; returns them by name."""
    runs = {
        "sweep": write_run(root, commit=commit_id(3), suite="sweep", records=sweep_records(),
                           started_at="2026-01-04T00:00:00.000000Z"),
        "comm": write_run(root, commit=commit_id(3), suite="multi", records=comm_records(),
                          started_at="2026-01-04T01:00:00.000000Z"),
        "model": write_run(root, commit=commit_id(3), suite="h100", records=model_records(), source="modelled",
                           started_at="2026-01-04T02:00:00.000000Z"),
        "workloads": write_run(root, commit=commit_id(3), suite="workloads", records=workload_records(),
                               started_at="2026-01-04T04:00:00.000000Z"),
    }
    for i in range(4):
        runs[f"history{i}"] = write_run(root, commit=commit_id(i), suite="nightly", records=history_records(i >= 2),
                                        started_at=f"2026-01-0{i + 1}T03:00:00.000000Z")
    return runs


def facet_rows(run, pattern: str, dtype: str = "float32", mode: str = "fwd", device: str = CPU,
               workload: str | None = None) -> list[Row]:
    """The rows of one facet; `workload` may be left out where the run has one workload for these keys."""
    found = [members for key, members in facets(current_rows(rows_from_runs([run]))).items()
             if key[:4] == (pattern, dtype, mode, device) and workload in (None, key[4])]
    assert len(found) == 1, f"{len(found)} facets match"
    return found[0]
