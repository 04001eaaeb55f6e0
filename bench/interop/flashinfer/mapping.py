"""What of a FlashInfer-Bench definition and its workloads is a case here, and why the rest is not.

Op types and variants that map (their published docs, docs/op-types/gqa-*.mdx):

- `gqa_ragged` prefill: q (total_q, H, D), k, v (total_kv, Hkv, D), qo_indptr, kv_indptr, sm_scale. Sequences whose
  queries are all their keys become packed documents (`documents`, batch 1); sequences that all have the same
  (q_len, kv_len) a batch with `q_len` (bottom-right, as the reference's `delta = kv - q` aligns them).
- `gqa_paged` prefill (qo_indptr, kv_indptr, kv_indices) and decode (kv_indptr, kv_indices; one query per
  sequence): `page_size`, each sequence's keys as `kv_lens` (from the page counts and kv_last_page_len, or full last
  pages where the definition has none), the batch's one q_len.

Causal is read from the name (`..._prefill_causal_...`, FlashInfer-Bench's convention); decode's one query per
sequence sees all its keys, which is causal at the last position. The import's cross-check runs the definition's
own reference against the float64 oracle on every workload, so a definition whose code says otherwise shows.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel

from bench.interop.flashinfer.schema import Definition, SafetensorsInput, ScalarInput, Workload

OpKind = Literal["ragged_prefill", "paged_prefill", "paged_decode"]
INPUTS: dict[str, tuple[set[str], set[str]]] = {  # required, optional
    "ragged_prefill": ({"q", "k", "v", "qo_indptr", "kv_indptr"}, {"sm_scale"}),
    "paged_prefill": ({"q", "k_cache", "v_cache", "qo_indptr", "kv_indptr", "kv_indices"},
                      {"kv_last_page_len", "sm_scale"}),
    "paged_decode": ({"q", "k_cache", "v_cache", "kv_indptr", "kv_indices"}, {"kv_last_page_len", "sm_scale"}),
}
FLOAT_DTYPES = ("float32", "float16", "bfloat16")
_NOT_ATTENTION = ("gemm", "rmsnorm", "fused_add_rmsnorm", "moe", "gdn", "rope", "sampling")
_OTHER_ATTENTION = {
    "mla_paged": "MLA attention: keys are ckv (512) + kpe (64) wide and values ckv (512); a case holds one head_dim "
                 "for q, k and v",
    "mla_ragged": "MLA attention: keys and values of different head dims; a case holds one head_dim for q, k and v",
    "dsa_paged": "DeepSeek Sparse Attention: MLA attention (keys ckv 512 + kpe 64, values ckv 512) over top-k "
                 "indices stored per token; a case holds one head_dim for q, k and v, and takes its selections "
                 "from a selector, not from a workload's tensors",
}


class Layout(BaseModel):
    """How a definition lays out attention: the variant, its shape constants and causality."""

    kind: OpKind
    heads: int
    kv_heads: int
    head_dim: int
    page_size: int | None
    dtype: str
    causal: bool
    last_page_len: bool  # the definition takes kv_last_page_len (else a sequence's last page is full)


class CaseFields(BaseModel):
    """The case fields a workload becomes (the rest at their defaults)."""

    batch: int
    heads: int
    kv_heads: int | None
    head_dim: int
    seq_len: int
    q_len: int | None
    documents: list[int] | None
    page_size: int | None
    kv_lens: list[int] | None
    dtype: str
    pattern: str


def op_kind(definition: Definition) -> OpKind | str:
    """The definition's variant, or why it does not map."""
    op, names = definition.op_type, set(definition.inputs)
    if op in _OTHER_ATTENTION:
        return f"op type {op}: {_OTHER_ATTENTION[op]}"
    if op in _NOT_ATTENTION:
        return f"op type {op} is not attention"
    if op == "gqa_ragged":
        kind: OpKind = "ragged_prefill"
    elif op == "gqa_paged":
        kind = "paged_prefill" if "qo_indptr" in names else "paged_decode"
    else:
        return f"op type {op!r} has no mapping (mapped: gqa_ragged prefill, gqa_paged prefill and decode)"
    required, optional = INPUTS[kind]
    if required - names:
        return f"{op} {kind.split('_')[1]} needs inputs {sorted(required)}; missing {sorted(required - names)}"
    if names - required - optional:
        return f"inputs {sorted(names - required - optional)} have no counterpart in a case"
    if "output" not in definition.outputs:
        return f"outputs {sorted(definition.outputs)} have no `output`"
    return kind


def _axis(definition: Definition, name: str, workload: Workload | None) -> int | None:
    consts = definition.const_axes()
    if name in consts:
        return consts[name]
    return None if workload is None else workload.axes.get(name)


def layout_of(definition: Definition, workload: Workload | None = None) -> Layout | str:
    """The definition's layout (axes given by the workload where they are variable), or why it does not map."""
    kind = op_kind(definition)
    if kind not in INPUTS:
        return kind
    kv_name = "k" if kind == "ragged_prefill" else "k_cache"
    q_shape, kv_shape = definition.inputs["q"].shape, definition.inputs[kv_name].shape
    if q_shape is None or len(q_shape) != 3 or kv_shape is None or len(kv_shape) != (3 if kv_name == "k" else 4):
        dims = "[tokens" if kv_name == "k" else "[pages, page_size"
        return f"q must be [tokens, heads, head_dim] and {kv_name} {dims}, kv_heads, head_dim]"
    sizes = {"heads": _axis(definition, q_shape[1], workload), "head_dim": _axis(definition, q_shape[2], workload),
             "kv_heads": _axis(definition, kv_shape[-2], workload)}
    page_size = None if kind == "ragged_prefill" else _axis(definition, kv_shape[1], workload)
    if any(v is None for v in sizes.values()) or (kind != "ragged_prefill" and page_size is None):
        return "heads, kv_heads, head_dim and page_size must be constant axes or given by the workload"
    dtypes = {definition.inputs[n].dtype for n in ("q", kv_name, "v" if kv_name == "k" else "v_cache")}
    if len(dtypes) != 1 or next(iter(dtypes)) not in FLOAT_DTYPES:
        return f"q, k, v in {sorted(dtypes)}; a case holds them in one of {', '.join(FLOAT_DTYPES)}"
    heads, kv_heads, head_dim = int(sizes["heads"] or 0), int(sizes["kv_heads"] or 0), int(sizes["head_dim"] or 0)
    if kv_heads < 1 or heads % kv_heads:
        return f"num_qo_heads {heads} is not a multiple of num_kv_heads {kv_heads}"
    if page_size is not None and (page_size < 1 or page_size & (page_size - 1)):
        return f"page_size {page_size}: a case's pages hold a power of two of tokens"
    return Layout(kind=kind, heads=heads, kv_heads=kv_heads, head_dim=head_dim, page_size=page_size,
                  dtype=next(iter(dtypes)), causal=kind == "paged_decode" or "causal" in definition.name,
                  last_page_len="kv_last_page_len" in definition.inputs)


def _stored(root: Path, workload: Workload, name: str) -> torch.Tensor | str:
    from safetensors import safe_open

    spec = workload.inputs.get(name)
    if not isinstance(spec, SafetensorsInput):
        kind = "missing" if spec is None else spec.type
        return f"{name} is {kind}; a workload's index tensors must be stored (safetensors) to say its sequences"
    with safe_open(str(root / spec.path), framework="pt") as handle:
        return handle.get_tensor(spec.tensor_key).to(torch.int64)


def sequence_lengths(layout: Layout, root: Path, workload: Workload) -> tuple[list[int], list[int]] | str:
    """(queries, keys) of each sequence, from the workload's stored index tensors; or why they cannot be read."""
    names = ["kv_indptr"] + (["qo_indptr"] if layout.kind != "paged_decode" else [])
    if layout.kind != "ragged_prefill":
        names += ["kv_indices"] + (["kv_last_page_len"] if layout.last_page_len else [])
    tensors: dict[str, torch.Tensor] = {}
    for name in names:
        got = _stored(root, workload, name)
        if isinstance(got, str):
            return got
        tensors[name] = got
    kv_indptr = tensors["kv_indptr"]
    if kv_indptr.numel() < 2 or int(kv_indptr[0]) != 0 or bool((kv_indptr.diff() < 0).any()):
        return f"kv_indptr {kv_indptr.tolist()[:8]} must start at 0 and never decrease"
    batch = kv_indptr.numel() - 1
    if layout.kind == "ragged_prefill":
        kv = kv_indptr.diff().tolist()
    else:
        pages, size = kv_indptr.diff(), int(layout.page_size or 1)
        last = tensors["kv_last_page_len"] if layout.last_page_len else torch.full((batch,), size)
        kv = [(int(n) - 1) * size + int(t) if int(n) else 0 for n, t in zip(pages, last, strict=True)]
    if layout.kind == "paged_decode":
        return [1] * batch, kv
    qo_indptr = tensors["qo_indptr"]
    if qo_indptr.numel() != batch + 1 or int(qo_indptr[0]) != 0 or bool((qo_indptr.diff() < 0).any()):
        return f"qo_indptr {qo_indptr.tolist()[:8]} must start at 0, never decrease and match kv_indptr's length"
    return qo_indptr.diff().tolist(), kv


def check_scale(layout: Layout, workload: Workload) -> str | None:
    """Why the workload's sm_scale is not 1/sqrt(head_dim) (every case's scale), or None."""
    spec = workload.inputs.get("sm_scale")
    if spec is None:
        return None
    if not isinstance(spec, ScalarInput):
        return f"sm_scale is {spec.type}; a scalar 1/sqrt(head_dim) is what cases use"
    expected = 1.0 / math.sqrt(layout.head_dim)
    if abs(float(spec.value) - expected) > 1e-6 * expected:
        return f"sm_scale {spec.value} is not 1/sqrt(head_dim) = {expected:.6g}, the scale every case uses"
    return None


def _shape(layout: Layout, q: list[int], kv: list[int]) -> CaseFields | str:
    batch = len(q)
    if batch == 0 or min(q) < 1 or min(kv) < 1:
        return f"sequences with no queries or no keys (queries {q[:8]}, keys {kv[:8]}): a case's rows each see a key"
    bad = [b for b in range(batch) if q[b] > kv[b]]
    if bad:
        b = bad[0]
        return (f"sequence {b} has {q[b]} queries over {kv[b]} keys: its first rows see no key (LSE -inf); a case's "
                "queries are the last q_len of its keys")
    base = {"heads": layout.heads, "kv_heads": layout.kv_heads if layout.kv_heads != layout.heads else None,
            "head_dim": layout.head_dim, "dtype": layout.dtype, "pattern": "causal" if layout.causal else "dense"}
    if layout.kind == "ragged_prefill" and q == kv:
        return CaseFields(batch=1, seq_len=sum(kv), q_len=None, documents=kv if batch > 1 else None,
                          page_size=None, kv_lens=None, **base)
    if len(set(q)) != 1:
        return (f"sequences with their own query counts {q[:8]}: a batch has one q_len"
                + (" (packed documents need each sequence's queries to be all its keys)"
                   if layout.kind == "ragged_prefill" else ""))
    if layout.kind == "ragged_prefill":
        if len(set(kv)) != 1:
            return f"sequences with their own key counts {kv[:8]} and fewer queries than keys: a ragged batch maps " \
                   "to packed documents (queries = keys) or to one (q_len, seq_len) for every sequence"
        return CaseFields(batch=batch, seq_len=kv[0], q_len=q[0] if q[0] != kv[0] else None, documents=None,
                          page_size=None, kv_lens=None, **base)
    seq_len = max(kv)
    return CaseFields(batch=batch, seq_len=seq_len, q_len=q[0] if q[0] != seq_len else None, documents=None,
                      page_size=layout.page_size, kv_lens=None if set(kv) == {seq_len} else kv, **base)


def case_fields(definition: Definition, root: Path, workload: Workload) -> CaseFields | str:
    """The case a workload of `definition` becomes, or why it does not map."""
    layout = layout_of(definition, workload)
    if isinstance(layout, str):
        return layout
    scale = check_scale(layout, workload)
    if scale is not None:
        return scale
    lengths = sequence_lengths(layout, root, workload)
    if isinstance(lengths, str):
        return lengths
    return _shape(layout, *lengths)
