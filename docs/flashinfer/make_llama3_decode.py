"""Writes docs/flashinfer/llama3-8b-decode/: a FlashInfer Trace dataset of one Llama-3-8B decode layer.

The definition is FlashInfer-Bench's gqa_paged decode (docs/op-types/gqa-paged.mdx) at Llama-3-8B's shape: 32
query heads, 8 KV heads, head_dim 128, bfloat16, pages of 16 tokens with kv_last_page_len (as their published
page_size 64 definitions take it); its reference is the one `bench export` writes (reference_code.py). Three
workloads (one long sequence; a ragged batch of four; sixteen short ones) store their page tables; q and the
caches are random. One python Solution gathers each sequence's pages and calls torch's SDPA. docs/flashinfer.md
runs it all. Run: .venv/bin/python docs/flashinfer/make_llama3_decode.py
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.interop.flashinfer.synth import synth_definition
from bench.spec.case import Case

ROOT = Path(__file__).parent / "llama3-8b-decode"
NAME = "gqa_paged_decode_h32_kv8_d128_ps16"
PS = 16

SOLUTION = '''import torch
import torch.nn.functional as F


def run(q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, sm_scale):
    """Each sequence's pages gathered in order, then torch's SDPA with grouped-query heads; LSE from the scores."""
    output = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    page_size = k_cache.shape[1]
    for b in range(q.shape[0]):
        pages = kv_indices[int(kv_indptr[b]) : int(kv_indptr[b + 1])].long()
        length = (pages.numel() - 1) * page_size + int(kv_last_page_len[b])
        k = k_cache[pages].flatten(0, 1)[:length].transpose(0, 1)  # (Hkv, T, D)
        v = v_cache[pages].flatten(0, 1)[:length].transpose(0, 1)
        qb = q[b][:, None]  # (H, 1, D)
        output[b] = F.scaled_dot_product_attention(qb, k, v, scale=sm_scale, enable_gqa=True)[:, 0]
        group = q.shape[1] // k.shape[0]
        scores = torch.einsum("hd,htd->ht", q[b].float(), k.float().repeat_interleave(group, 0)) * sm_scale
        lse[b] = torch.logsumexp(scores, dim=-1) / 0.6931471805599453
    return output, lse
'''


def workload(uuid: str, kv_lens: list[int], pool: int, seed: int) -> dict[str, object]:
    counts = [math.ceil(n / PS) for n in kv_lens]
    ids = torch.randperm(pool, generator=torch.Generator().manual_seed(seed))[: sum(counts)].to(torch.int32)
    tensors = {"kv_indptr": torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32),
               "kv_indices": ids,
               "kv_last_page_len": torch.tensor([n - (c - 1) * PS for n, c in zip(kv_lens, counts, strict=True)],
                                                dtype=torch.int32)}
    rel = f"blob/workloads/gqa_paged/{NAME}/{NAME}_{uuid}.safetensors"
    (ROOT / rel).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(ROOT / rel))
    stored = {k: {"type": "safetensors", "path": f"./{rel}", "tensor_key": k} for k in tensors}
    inputs = {"q": {"type": "random"}, "k_cache": {"type": "random"}, "v_cache": {"type": "random"},
              **stored, "sm_scale": {"type": "scalar", "value": 1 / math.sqrt(128)}}
    axes = {"batch_size": len(kv_lens), "num_pages": pool, "len_indptr": len(kv_lens) + 1,
            "num_kv_indices": sum(counts)}
    return {"definition": NAME, "solution": None, "evaluation": None,
            "workload": {"uuid": uuid, "axes": axes, "inputs": inputs}}


def main() -> None:
    shutil.rmtree(ROOT, ignore_errors=True)
    case = Case(batch=1, heads=32, kv_heads=8, head_dim=128, seq_len=16, q_len=1, page_size=PS, pattern="causal",
                dtype="bfloat16")
    definition = synth_definition(case).model_copy(update={
        "tags": ["stage:decode", "model:llama-3-8b", "status:example"],
        "description": "Batched grouped-query attention decode over a paged KV cache (page_size=16), the shape of "
                       "one Llama-3-8B attention layer (32 query heads, 8 KV heads, head_dim 128)."})
    (ROOT / "definitions/gqa_paged").mkdir(parents=True)
    text = definition.model_dump_json(indent=2, exclude_unset=True)  # as their save_json_file writes
    (ROOT / f"definitions/gqa_paged/{NAME}.json").write_text(text + "\n")
    lines = [workload("llama-b1-4096", [4096], 300, 1), workload("llama-b4-ragged", [1024, 517, 2048, 33], 300, 2),
             workload("llama-b16-512", [512] * 16, 600, 3)]
    (ROOT / "workloads/gqa_paged").mkdir(parents=True)
    (ROOT / f"workloads/gqa_paged/{NAME}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    solution = {"name": "llama3_decode_sdpa", "definition": NAME, "author": "docs", "description":
                "Pages gathered per sequence, torch SDPA (enable_gqa).",
                "spec": {"language": "python", "target_hardware": ["cpu", "cuda"], "entry_point": "main.py::run",
                         "dependencies": ["torch"], "destination_passing_style": False},
                "sources": [{"path": "main.py", "content": SOLUTION}]}
    (ROOT / f"solutions/docs/gqa_paged/{NAME}").mkdir(parents=True)
    (ROOT / f"solutions/docs/gqa_paged/{NAME}/llama3_decode_sdpa.json").write_text(json.dumps(solution, indent=2))


if __name__ == "__main__":
    main()
