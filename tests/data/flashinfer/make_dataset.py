"""Writes the small FlashInfer Trace dataset beside this file (tests/test_flashinfer_*.py, docs/flashinfer.md).

Definitions follow FlashInfer-Bench's op-type docs (docs/op-types/gqa-ragged.mdx, gqa-paged.mdx) in input names,
axes and constraints, at small shapes (4 query heads, 2 KV heads, head_dim 32) so that a CPU runs them in
seconds; their reference code is ours (bench.interop.flashinfer.reference_code), in theirs' style. Workloads
store their index tensors (and, for two of them, q, k, v) in safetensors blobs, as their datasets do; two
workloads do not map (sequences with their own query counts; more queries than keys). Each workload draws from
its own seed, so adding one leaves the others' blobs as they were. Solutions: a correct python one and a wrong
one (no causal mask) for the ragged definition; a correct destination-passing one and a wrong one (softmax scale
1/head_dim, not sm_scale) for paged decode. Run: .venv/bin/python tests/data/flashinfer/make_dataset.py
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.interop.flashinfer.reference_code import reference_source

ROOT = Path(__file__).parent
H, HKV, D = 4, 2, 32
SCALE = 1.0 / math.sqrt(D)


def var(description: str) -> dict[str, str]:
    return {"type": "var", "description": description}


def const(value: int, description: str) -> dict[str, object]:
    return {"type": "const", "value": value, "description": description}


def tensor(shape: list[str] | None, dtype: str, description: str) -> dict[str, object]:
    return {"shape": shape, "dtype": dtype, "description": description}


HEADS = {"num_qo_heads": const(H, "Number of query/output attention heads."),
         "num_kv_heads": const(HKV, "Number of key-value attention heads."),
         "head_dim": const(D, "Dimension of each attention head.")}
OUT = {"output": tensor(["total_q", "num_qo_heads", "head_dim"], "bfloat16", "Attention output tensor."),
       "lse": tensor(["total_q", "num_qo_heads"], "float32", "The 2-based log-sum-exp of attention logits.")}
SM_SCALE = tensor(None, "float32", "Softmax scale. Default is (1/sqrt(head_dim)).")
CACHE = ["num_pages", "page_size", "num_kv_heads", "head_dim"]


def ragged() -> dict[str, object]:
    return {
        "name": f"gqa_ragged_prefill_causal_h{H}_kv{HKV}_d{D}", "op_type": "gqa_ragged",
        "description": "Batched grouped-query attention prefill over ragged inputs, causal (test data).",
        "tags": ["stage:prefill", "status:test"],
        "axes": {**HEADS, "len_indptr": var("batch_size + 1"), "total_q": var("Total query tokens."),
                 "total_kv": var("Total key-value tokens.")},
        "constraints": ["total_q == qo_indptr[-1].item()", "total_kv == kv_indptr[-1].item()"],
        "inputs": {"q": tensor(["total_q", "num_qo_heads", "head_dim"], "bfloat16", "Query tensor."),
                   "k": tensor(["total_kv", "num_kv_heads", "head_dim"], "bfloat16", "Key tensor."),
                   "v": tensor(["total_kv", "num_kv_heads", "head_dim"], "bfloat16", "Value tensor."),
                   "qo_indptr": tensor(["len_indptr"], "int32", "Query offsets for each sequence."),
                   "kv_indptr": tensor(["len_indptr"], "int32", "Key-value offsets for each sequence."),
                   "sm_scale": SM_SCALE},
        "outputs": OUT,
        "reference": reference_source("ragged_prefill", causal=True, heads=H, kv_heads=HKV, head_dim=D,
                                      page_size=None, last_page_len=False),
    }


def paged_prefill(ps: int) -> dict[str, object]:
    return {
        "name": f"gqa_paged_prefill_causal_h{H}_kv{HKV}_d{D}_ps{ps}", "op_type": "gqa_paged",
        "description": f"Batched grouped-query attention prefill over a paged KV cache (page_size={ps}), causal.",
        "tags": ["stage:prefill", "status:test"],
        "axes": {**HEADS, "page_size": const(ps, "Number of tokens stored per page."),
                 "len_indptr": var("batch_size + 1"), "total_q": var("Total query tokens."),
                 "num_kv_indices": var("Total KV page indices."), "num_pages": var("Allocated pages."),
                 "batch_size": var("Number of sequences.")},
        "constraints": ["total_q == qo_indptr[-1].item()", "num_kv_indices == kv_indptr[-1].item()"],
        "inputs": {"q": tensor(["total_q", "num_qo_heads", "head_dim"], "bfloat16", "Query tensor."),
                   "k_cache": tensor(CACHE, "bfloat16", "Paged key cache."),
                   "v_cache": tensor(CACHE, "bfloat16", "Paged value cache."),
                   "qo_indptr": tensor(["len_indptr"], "int32", "Query offsets for each sequence."),
                   "kv_indptr": tensor(["len_indptr"], "int32", "KV page offsets for each sequence."),
                   "kv_indices": tensor(["num_kv_indices"], "int32", "Page IDs for KV cache lookups."),
                   "kv_last_page_len": tensor(["batch_size"], "int32", "Valid tokens in each last page."),
                   "sm_scale": SM_SCALE},
        "outputs": OUT,
        "reference": reference_source("paged_prefill", causal=True, heads=H, kv_heads=HKV, head_dim=D,
                                      page_size=ps, last_page_len=True),
    }


def paged_decode(ps: int) -> dict[str, object]:
    out = {"output": tensor(["batch_size", "num_qo_heads", "head_dim"], "bfloat16", "Attention output tensor."),
           "lse": tensor(["batch_size", "num_qo_heads"], "float32", "The 2-based log-sum-exp of attention logits.")}
    return {
        "name": f"gqa_paged_decode_h{H}_kv{HKV}_d{D}_ps{ps}", "op_type": "gqa_paged",
        "description": f"Batched grouped-query attention decode over a paged KV cache (page_size={ps}).",
        "tags": ["stage:decode", "status:test"],
        "axes": {"batch_size": var("Number of sequences (one query each)."), **HEADS,
                 "num_pages": var("Allocated pages."), "page_size": const(ps, "Number of tokens stored per page."),
                 "len_indptr": var("Length of kv_indptr."), "num_kv_indices": var("Total KV page indices.")},
        "constraints": ["len_indptr == batch_size + 1", "num_kv_indices == kv_indptr[-1].item()"],
        "inputs": {"q": tensor(["batch_size", "num_qo_heads", "head_dim"], "bfloat16", "Query tensor for decode."),
                   "k_cache": tensor(CACHE, "bfloat16", "Paged key cache."),
                   "v_cache": tensor(CACHE, "bfloat16", "Paged value cache."),
                   "kv_indptr": tensor(["len_indptr"], "int32", "KV page offsets for each sequence."),
                   "kv_indices": tensor(["num_kv_indices"], "int32", "Page IDs for KV cache lookups."),
                   "sm_scale": SM_SCALE},
        "outputs": out,
        "reference": reference_source("paged_decode", causal=True, heads=H, kv_heads=HKV, head_dim=D,
                                      page_size=ps, last_page_len=False),
    }


def rmsnorm() -> dict[str, object]:
    return {"name": "rmsnorm_h64", "op_type": "rmsnorm", "description": "RMSNorm (not attention: does not map).",
            "axes": {"batch_size": var("Rows."), "hidden_size": const(64, "Hidden size.")},
            "inputs": {"input": tensor(["batch_size", "hidden_size"], "bfloat16", "Input."),
                       "weight": tensor(["hidden_size"], "bfloat16", "Weight."), "eps": tensor(None, "float32", "")},
            "outputs": {"output": tensor(["batch_size", "hidden_size"], "bfloat16", "Output.")},
            "reference": "import torch\n\n\ndef run(input, weight, eps):\n    x = input.to(torch.float32)\n"
                         "    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)\n"
                         "    return (x * weight).to(input.dtype)\n"}


def indptr(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def blob(definition: dict[str, object], uuid: str, tensors: dict[str, torch.Tensor]) -> str:
    rel = f"blob/workloads/{definition['op_type']}/{definition['name']}/{definition['name']}_{uuid}.safetensors"
    (ROOT / rel).parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(ROOT / rel))
    return "./" + rel


def workload(definition: dict[str, object], uuid: str, axes: dict[str, int], tensors: dict[str, torch.Tensor]
             ) -> dict[str, object]:
    path = blob(definition, uuid, tensors)
    inputs: dict[str, object] = {}
    for name, spec in definition["inputs"].items():  # type: ignore[attr-defined]
        if name in tensors:
            inputs[name] = {"type": "safetensors", "path": path, "tensor_key": name}
        elif spec["shape"] is None:
            inputs[name] = {"type": "scalar", "value": SCALE}
        else:
            inputs[name] = {"type": "random"}
    return {"definition": definition["name"], "solution": None, "evaluation": None,
            "workload": {"uuid": uuid, "axes": axes, "inputs": inputs}}


def ragged_workloads(d: dict[str, object]) -> list[dict[str, object]]:
    gen = torch.Generator().manual_seed(7)
    out = []
    for uuid, q_lens, kv_lens in (("r-single-24", [24], [24]), ("r-docs-5-11-8", [5, 11, 8], [5, 11, 8]),
                                  ("r-chunk-2x4of16", [4, 4], [16, 16]), ("r-mixed", [3, 2], [3, 9])):
        t = {"qo_indptr": indptr(q_lens), "kv_indptr": indptr(kv_lens)}
        out.append(workload(d, uuid, {"len_indptr": len(q_lens) + 1, "total_q": sum(q_lens),
                                      "total_kv": sum(kv_lens)}, t))
    n = 16  # q, k, v stored too
    t = {"qo_indptr": indptr([n]), "kv_indptr": indptr([n]),
         "q": torch.randn(n, H, D, generator=gen).to(torch.bfloat16),
         "k": torch.randn(n, HKV, D, generator=gen).to(torch.bfloat16),
         "v": torch.randn(n, HKV, D, generator=gen).to(torch.bfloat16)}
    out.append(workload(d, "r-stored-16", {"len_indptr": 2, "total_q": n, "total_kv": n}, t))
    return out


def pages(kv_lens: list[int], ps: int, pool: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kv_indptr, kv_indices (scattered over a pool of `pool` pages), kv_last_page_len."""
    counts = [math.ceil(n / ps) for n in kv_lens]
    ids = torch.randperm(pool, generator=torch.Generator().manual_seed(seed))[: sum(counts)].to(torch.int32)
    last = torch.tensor([n - (c - 1) * ps for n, c in zip(kv_lens, counts, strict=True)], dtype=torch.int32)
    return indptr(counts), ids, last


def paged_workloads(prefill: dict[str, object], decode: dict[str, object]) -> list[dict[str, object]]:
    out = []
    kv_indptr, kv_indices, last = pages([40, 23], 16, 9, seed=1)
    out.append(workload(prefill, "p-2x8-of-40-23", {"len_indptr": 3, "total_q": 16, "num_kv_indices": 5,
                                                     "num_pages": 9, "batch_size": 2},
                        {"qo_indptr": indptr([8, 8]), "kv_indptr": kv_indptr, "kv_indices": kv_indices,
                         "kv_last_page_len": last}))
    kv_indptr, kv_indices, last = pages([5], 16, 2, seed=2)
    out.append(workload(prefill, "p-9-over-5", {"len_indptr": 2, "total_q": 9, "num_kv_indices": 1,
                                                 "num_pages": 2, "batch_size": 1},
                        {"qo_indptr": indptr([9]), "kv_indptr": kv_indptr, "kv_indices": kv_indices,
                         "kv_last_page_len": last}))
    kv_indptr, kv_indices, last = pages([50, 17, 32], 16, 12, seed=5)  # 4 queries at the end of each sequence
    out.append(workload(prefill, "p-3x4-of-50-17-32", {"len_indptr": 4, "total_q": 12, "num_kv_indices": 8,
                                                        "num_pages": 12, "batch_size": 3},
                        {"qo_indptr": indptr([4, 4, 4]), "kv_indptr": kv_indptr, "kv_indices": kv_indices,
                         "kv_last_page_len": last}))
    kv_indptr, kv_indices, _ = pages([7, 12, 3], 1, 30, seed=3)
    out.append(workload(decode, "d-3-of-7-12-3", {"batch_size": 3, "num_pages": 30, "len_indptr": 4,
                                                   "num_kv_indices": 22},
                        {"kv_indptr": kv_indptr, "kv_indices": kv_indices}))
    gen = torch.Generator().manual_seed(11)
    kv_indptr, kv_indices, _ = pages([20], 1, 24, seed=4)
    stored = {"kv_indptr": kv_indptr, "kv_indices": kv_indices,
              "q": torch.randn(1, H, D, generator=gen).to(torch.bfloat16),
              "k_cache": torch.randn(24, 1, HKV, D, generator=gen).to(torch.bfloat16),
              "v_cache": torch.randn(24, 1, HKV, D, generator=gen).to(torch.bfloat16)}
    out.append(workload(decode, "d-stored-20", {"batch_size": 1, "num_pages": 24, "len_indptr": 2,
                                                 "num_kv_indices": 20}, stored))
    kv_indptr, kv_indices, _ = pages([9, 1, 15, 4, 6], 1, 40, seed=6)  # one sequence of a single key
    out.append(workload(decode, "d-5-of-9-1-15-4-6", {"batch_size": 5, "num_pages": 40, "len_indptr": 6,
                                                       "num_kv_indices": 35},
                        {"kv_indptr": kv_indptr, "kv_indices": kv_indices}))
    return out


RAGGED_SOLUTION = '''import math

import torch


def run(q, k, v, qo_indptr, kv_indptr, sm_scale):
    """Causal grouped-query attention per sequence, float32 softmax{note}."""
    total_q, heads, head_dim = q.shape
    group = heads // k.shape[1]
    output = torch.empty_like(q)
    lse = torch.full((total_q, heads), -math.inf, dtype=torch.float32)
    for b in range(qo_indptr.numel() - 1):
        qs, qe, ks, ke = (int(x) for x in (qo_indptr[b], qo_indptr[b + 1], kv_indptr[b], kv_indptr[b + 1]))
        keys = k[ks:ke].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[qs:qe].float(), keys) * sm_scale
        if {masked}:
            rows = torch.arange(qe - qs)[:, None] + (ke - ks) - (qe - qs)
            scores = scores.masked_fill(torch.arange(ke - ks)[None, :] > rows, -math.inf)
        lse[qs:qe] = (torch.logsumexp(scores, dim=-1) / math.log(2.0)).T
        weights = torch.softmax(scores, dim=-1)
        values = v[ks:ke].float().repeat_interleave(group, dim=1)
        output[qs:qe] = torch.einsum("hqk,khd->qhd", weights, values).to(q.dtype)
    return output, lse
'''

DECODE_SOLUTION = '''import math

import torch


def run(q, k_cache, v_cache, kv_indptr, kv_indices, sm_scale, output, lse):
    """Paged decode, destination-passing style: writes output and lse{note}."""
    group = q.shape[1] // k_cache.shape[2]
    for b in range(q.shape[0]):
        rows = kv_indices[int(kv_indptr[b]) : int(kv_indptr[b + 1])].long()
        keys = k_cache[rows].flatten(0, 1).float().repeat_interleave(group, dim=1)
        values = v_cache[rows].flatten(0, 1).float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,khd->hk", q[b].float(), keys) * {scale}
        lse[b] = torch.logsumexp(scores, dim=-1) / math.log(2.0)
        output[b] = torch.einsum("hk,khd->hd", torch.softmax(scores, dim=-1), values).to(output.dtype)
'''


def solution(name: str, definition: str, code: str, dps: bool, description: str) -> dict[str, object]:
    return {"name": name, "definition": definition, "author": "sparse-attention-bench tests",
            "description": description,
            "spec": {"language": "python", "target_hardware": ["cpu", "cuda"], "entry_point": "main.py::run",
                     "dependencies": ["torch"], "destination_passing_style": dps},
            "sources": [{"path": "main.py", "content": code}]}


def write_json(rel: str, data: object) -> None:
    (ROOT / rel).parent.mkdir(parents=True, exist_ok=True)
    (ROOT / rel).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def main() -> None:
    for sub in ("definitions", "workloads", "solutions", "blob"):
        shutil.rmtree(ROOT / sub, ignore_errors=True)
    r, pp, pd, norm = ragged(), paged_prefill(16), paged_decode(1), rmsnorm()
    for d in (r, pp, pd, norm):
        write_json(f"definitions/{d['op_type']}/{d['name']}.json", d)
    for d, lines in ((r, ragged_workloads(r)), (None, paged_workloads(pp, pd))):
        for line in lines:
            name = line["definition"]
            op = "gqa_ragged" if d is r else "gqa_paged"
            (ROOT / f"workloads/{op}").mkdir(parents=True, exist_ok=True)
            with open(ROOT / f"workloads/{op}/{name}.jsonl", "a", encoding="utf-8") as out:
                out.write(json.dumps(line) + "\n")
    for sol in (solution("ragged_causal_python", r["name"], RAGGED_SOLUTION.format(note="", masked="True"), False,
                         "Per-sequence causal attention in torch."),
                solution("ragged_no_mask_python", r["name"], RAGGED_SOLUTION.format(
                    note=" - WRONG: it forgets the causal mask", masked="False"), False,
                    "A wrong solution: no causal mask (tests expect INCORRECT_NUMERICAL)."),
                solution("decode_dps_python", pd["name"], DECODE_SOLUTION.format(note="", scale="sm_scale"), True,
                         "Paged decode, destination-passing."),
                solution("decode_wrong_scale_python", pd["name"], DECODE_SOLUTION.format(
                    note=" - WRONG: it scales by 1/head_dim, not sm_scale", scale="(1.0 / q.shape[-1])"), True,
                    "A wrong solution: softmax scale 1/head_dim (tests expect INCORRECT_NUMERICAL).")):
        write_json(f"solutions/tests/{sol['definition']}/{sol['name']}.json", sol)


if __name__ == "__main__":
    main()
