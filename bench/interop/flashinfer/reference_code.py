"""The reference `run()` of the definitions `bench export` writes for cases that did not come from a dataset.

Written as FlashInfer-Bench's own references are (plain torch, float32, a loop over sequences, the base-2 LSE,
-inf and zeros for a row with no key), from our own account of attention: sequence b's queries are the last
q_len of its keys (bottom-right), causal where the name says so.
"""

from __future__ import annotations

_ATTEND = '''

def _attend(q, k, v, sm_scale, out, lse):
    """q (n, H, D) the last n positions of k, v (m, Hkv, D); writes out (n, H, D) and lse (n, H)."""
    n, m = q.shape[0], k.shape[0]
    if n == 0 or m == 0:
        return
    group = q.shape[1] // k.shape[1]
    keys = k.to(torch.float32).repeat_interleave(group, dim=1)
    values = v.to(torch.float32).repeat_interleave(group, dim=1)
    logits = torch.einsum("qhd,khd->hqk", q.to(torch.float32), keys) * sm_scale
    if CAUSAL:
        rows = torch.arange(n, device=q.device)[:, None] + (m - n)
        logits = logits.masked_fill(torch.arange(m, device=q.device)[None, :] > rows, -math.inf)
    lse.copy_((torch.logsumexp(logits, dim=-1) / math.log(2.0)).transpose(0, 1))
    weights = torch.nan_to_num(torch.softmax(logits, dim=-1), nan=0.0)
    out.copy_(torch.einsum("hqk,khd->qhd", weights, values).to(out.dtype))
'''

_HEADER = '''import math

import torch

CAUSAL = {causal}
'''

_RAGGED = '''

@torch.no_grad()
def run(q, k, v, qo_indptr, kv_indptr, sm_scale):
    total_q, num_qo_heads, head_dim = q.shape
    assert (num_qo_heads, k.shape[1], head_dim) == ({heads}, {kv_heads}, {head_dim})
    assert total_q == qo_indptr[-1].item() and k.shape[0] == kv_indptr[-1].item()
    output = torch.zeros_like(q)
    lse = torch.full((total_q, num_qo_heads), -math.inf, dtype=torch.float32, device=q.device)
    for b in range(qo_indptr.shape[0] - 1):
        qs, qe = int(qo_indptr[b]), int(qo_indptr[b + 1])
        ks, ke = int(kv_indptr[b]), int(kv_indptr[b + 1])
        _attend(q[qs:qe], k[ks:ke], v[ks:ke], sm_scale, output[qs:qe], lse[qs:qe])
    return output, lse
'''

_PAGED = '''

def _keys(cache, pages, length):
    return cache[pages].reshape(-1, cache.shape[2], cache.shape[3])[:length]


@torch.no_grad()
def run({signature}):
    num_qo_heads, head_dim = q.shape[1], q.shape[2]
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert (num_qo_heads, num_kv_heads, head_dim, page_size) == ({heads}, {kv_heads}, {head_dim}, {page_size})
    output = torch.zeros_like(q)
    lse = torch.full(q.shape[:2], -math.inf, dtype=torch.float32, device=q.device)
    for b in range(kv_indptr.shape[0] - 1):
        pages = kv_indices[int(kv_indptr[b]) : int(kv_indptr[b + 1])].to(torch.long)
        if pages.numel() == 0:
            continue
        last = {last}
        length = (pages.numel() - 1) * page_size + last
        k, v = _keys(k_cache, pages, length), _keys(v_cache, pages, length)
        qs, qe = {rows}
        _attend(q[qs:qe], k, v, sm_scale, output[qs:qe], lse[qs:qe])
    return output, lse
'''


def reference_source(kind: str, *, causal: bool, heads: int, kv_heads: int, head_dim: int,
                     page_size: int | None, last_page_len: bool) -> str:
    """The reference code of a definition of `kind` (ragged_prefill, paged_prefill, paged_decode)."""
    header = _HEADER.format(causal=causal)
    if kind == "ragged_prefill":
        return header + _ATTEND + _RAGGED.format(heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    names = ["q", "k_cache", "v_cache"] + (["qo_indptr"] if kind == "paged_prefill" else [])
    names += ["kv_indptr", "kv_indices"] + (["kv_last_page_len"] if last_page_len else []) + ["sm_scale"]
    rows = "int(qo_indptr[b]), int(qo_indptr[b + 1])" if kind == "paged_prefill" else "b, b + 1"
    last = "int(kv_last_page_len[b])" if last_page_len else "page_size"
    return header + _ATTEND + _PAGED.format(signature=", ".join(names), heads=heads, kv_heads=kv_heads,
                                            head_dim=head_dim, page_size=page_size, last=last, rows=rows)
