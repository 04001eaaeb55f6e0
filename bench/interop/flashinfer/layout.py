"""Our tensors in FlashInfer-Bench's layout, and their outputs back in ours.

Ours: q (B, H, q_len, D), k and v (B, Hkv, N, D), or a paged pool (bench.inputs.paged: pages (P, Hkv, page_size,
D), FlashInfer's HND layout, a page table (B, max pages), kv_lens). Theirs (docs/op-types/gqa-*.mdx): q (total_q,
H, D); ragged k, v (total_kv, Hkv, D) with qo_indptr, kv_indptr; paged k_cache, v_cache (pages, page_size, Hkv,
D) (NHD) with kv_indptr, kv_indices, kv_last_page_len; sm_scale a Python float. Everything here is untimed setup
(a call's conversion happens once, in prepare); the output comes back as a view, no copy in the timed call.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from bench.inputs.paged import PagedKV
from bench.interop.flashinfer.mapping import Layout
from bench.interop.flashinfer.schema import Definition
from bench.patterns import document_lengths
from bench.spec.case import Case

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int64": torch.int64,
          "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "bool": torch.bool}


def _tokens(t: Tensor) -> Tensor:
    """(B, heads, L, D) -> (B * L, heads, D), contiguous."""
    return t.permute(0, 2, 1, 3).reshape(-1, t.shape[1], t.shape[3]).contiguous()


def _indptr(lengths: list[int], device: torch.device) -> Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def ragged_lengths(case: Case) -> tuple[list[int], list[int]]:
    """The query and key counts of each ragged sequence: every batch row's packed documents in turn, or B
    sequences of (q_len, seq_len)."""
    lengths = document_lengths(case.documents, case.seq_len, case.seed)
    if lengths is not None:
        return list(lengths) * case.batch, list(lengths) * case.batch
    return [case.n_queries] * case.batch, [case.seq_len] * case.batch


def ragged_inputs(case: Case, q: Tensor, k: Tensor, v: Tensor) -> dict[str, Tensor | float]:
    """A ragged batch: packed documents, or B sequences of (q_len, seq_len) each."""
    q_lens, kv_lens = ragged_lengths(case)
    return {"q": _tokens(q), "k": _tokens(k), "v": _tokens(v), "qo_indptr": _indptr(q_lens, q.device),
            "kv_indptr": _indptr(kv_lens, q.device)}


def page_indices(paged: PagedKV) -> dict[str, Tensor]:
    """kv_indptr, kv_indices, kv_last_page_len of a pool's page table."""
    lengths = [int(n) for n in paged.kv_lens]
    counts = [math.ceil(n / paged.page_size) for n in lengths]
    indices = torch.cat([paged.page_table[b, :c] for b, c in enumerate(counts)]).to(torch.int32)
    last = torch.tensor([n - (c - 1) * paged.page_size for n, c in zip(lengths, counts, strict=True)],
                        dtype=torch.int32, device=indices.device)
    return {"kv_indptr": _indptr(counts, indices.device), "kv_indices": indices, "kv_last_page_len": last}


def paged_inputs(case: Case, q: Tensor, paged: PagedKV) -> dict[str, Tensor | float]:
    """A paged batch: every sequence's last q_len positions as its queries."""
    out: dict[str, Tensor | float] = {"q": _tokens(q), "k_cache": paged.k_pages.transpose(1, 2).contiguous(),
                           "v_cache": paged.v_pages.transpose(1, 2).contiguous(), **page_indices(paged)}
    out["qo_indptr"] = _indptr([case.n_queries] * case.batch, q.device)
    return out


def call_inputs(definition: Definition, layout: Layout, case: Case, q: Tensor, kv: tuple[Tensor, Tensor] | PagedKV
                ) -> list[Tensor | float]:
    """The definition's inputs, in its order."""
    given = paged_inputs(case, q, kv) if isinstance(kv, PagedKV) else ragged_inputs(case, q, *kv)
    given["sm_scale"] = 1.0 / math.sqrt(layout.head_dim)
    if layout.kind == "paged_decode":  # one query per sequence: (batch, H, D)
        given["q"] = _tokens(q).reshape(case.batch, layout.heads, layout.head_dim)
    missing = [name for name in definition.inputs if name not in given]
    if missing:
        raise ValueError(f"definition {definition.name}'s inputs {missing} have no counterpart here")
    return [given[name] for name in definition.inputs]


def axis_values(definition: Definition, inputs: list[Tensor | float]) -> dict[str, int]:
    """Every axis's value: the constants, and the variables bound by the inputs' shapes."""
    values = definition.const_axes()
    for spec, value in zip(definition.inputs.values(), inputs, strict=True):
        for axis, size in zip(spec.shape or [], getattr(value, "shape", ()), strict=False):
            values.setdefault(axis, int(size))
    return values


def allocate_outputs(definition: Definition, inputs: list[Tensor | float], device: torch.device) -> list[Tensor]:
    """Empty outputs of the definition's shapes and dtypes (destination-passing style)."""
    values = axis_values(definition, inputs)
    out = []
    for name, spec in definition.outputs.items():
        unknown = [a for a in spec.shape or [] if a not in values]
        if unknown:
            raise ValueError(f"output {name}'s axes {unknown} are bound by no input")
        out.append(torch.empty([values[a] for a in spec.shape or []], dtype=DTYPES[spec.dtype], device=device))
    return out


def ours(t: Tensor, case: Case, name: str, lse: bool = False) -> Tensor:
    """Their (total_q, H[, D]) -> ours (B, H, q_len[, D]), a view. Raises ValueError naming the shapes."""
    b, h, nq, d = case.batch, case.heads, case.n_queries, case.head_dim
    want = (b * nq, h) if lse else (b * nq, h, d)
    if case.q_len == 1 and not lse and t.dim() == 3 and tuple(t.shape) == (b, h, d):
        want = (b, h, d)
    if tuple(t.shape) != want:
        raise ValueError(f"output {name} has shape {list(t.shape)}; the definition's is {list(want)}")
    if lse:
        return t.view(b, nq, h).permute(0, 2, 1)
    return t.reshape(b, nq, h, d).permute(0, 2, 1, 3)
