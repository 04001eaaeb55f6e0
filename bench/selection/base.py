"""A `Selection`: the keys a data-dependent sparse attention chose, and the mask it makes with the base pattern.

Conventions (docs/DESIGN.md "Selection"): `indices` int32 (B, H_sel, query units, K), padded with -1 (NSA's and
FlashMLA's convention). A query unit is one query row (`q_unit` 1: MoBA, NSA, DSA, Quest) or a block of rows
(`q_unit` block_size: XAttention, block-sparse kernels); an index stands for `kv_unit` keys (1: a token; the
block size; a page). H_sel is the number of query heads (shared per head), KV heads (shared per KV group: the
query heads of a GQA group read one selection) or 1 (shared by all heads). The effective mask of query row i
and key j: the base pattern allows (i, j) and j lies in a unit selected for i's query unit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

Shared = Literal["head", "kv_group", "all"]
SHARED: tuple[str, ...] = ("head", "kv_group", "all")
KvUnitName = Literal["token", "block", "page"]
QUnitName = Literal["row", "block"]
# What an implementation attends over: {"q_unit": (1, "block"), "kv_unit": ("token", "block", "page")}
TakesSelections = dict[str, tuple[int | str, ...]]
DEFAULT_PAGE_SIZE = 16  # Quest's and FlashInfer's page of 16 tokens, where the case sets none


class SelectionError(ValueError):
    """A selector's output that is not a valid selection: names the first bad index."""


def unit_size(name: str, block_size: int, page_size: int | None = None) -> int:
    """Keys (or query rows) one unit stands for: token/row 1, block block_size, page page_size (default 16)."""
    if name in ("token", "row"):
        return 1
    if name == "block":
        return block_size
    if name == "page":
        return page_size or DEFAULT_PAGE_SIZE
    raise ValueError(f"unknown unit {name!r}; allowed: token, block, page (keys), row, block (queries)")


def selection_heads(shared: str, heads: int, kv_heads: int) -> int:
    return {"head": heads, "kv_group": kv_heads, "all": 1}[shared]


@dataclass(frozen=True)
class Selection:
    """Selected key units per (batch, selection head, query unit); module docstring."""

    indices: Tensor  # int32 (B, H_sel, Nq / q_unit rounded up, K); -1 = padding
    q_unit: int  # query rows per query unit
    kv_unit: int  # keys per selected index
    shared: Shared

    @property
    def units(self) -> int:
        return self.indices.shape[2]

    def head_index(self, heads: int, kv_heads: int) -> Tensor:
        """(H,) int64: the selection head each query head reads."""
        group = heads // kv_heads
        if self.shared == "head":
            return torch.arange(heads)
        if self.shared == "kv_group":
            return torch.arange(heads) // group
        return torch.zeros(heads, dtype=torch.int64)

    def validate(self, batch: int, heads: int, kv_heads: int, q_len: int, seq_len: int) -> None:
        """Shape, dtype, range, padding and duplicates; SelectionError naming the first bad index."""
        idx = self.indices
        if not isinstance(idx, Tensor) or idx.dtype not in (torch.int32, torch.int64):
            got = idx.dtype if isinstance(idx, Tensor) else type(idx).__name__
            raise SelectionError(f"indices must be an int32 tensor, got {got}")
        units = math.ceil(q_len / self.q_unit)
        expected = (batch, selection_heads(self.shared, heads, kv_heads), units)
        if idx.dim() != 4 or tuple(idx.shape[:3]) != expected:
            raise SelectionError(f"indices have shape {list(idx.shape)}; expected [B, H_sel, query units, K] = "
                                 f"{[*expected, 'K']} (shared {self.shared!r}, q_unit {self.q_unit}, q_len {q_len})")
        kv_units = math.ceil(seq_len / self.kv_unit)
        cpu = idx.detach().to("cpu", torch.int64)
        bad = (cpu < -1) | (cpu >= kv_units)
        if bool(bad.any()):
            where = tuple(int(x) for x in bad.nonzero()[0])
            raise SelectionError(f"index {int(cpu[where])} at {list(where)} is out of range: key units are 0.."
                                 f"{kv_units - 1} ({seq_len} keys in units of {self.kv_unit}), -1 pads")
        ordered = cpu.sort(dim=-1).values
        dup = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)
        if bool(dup.any()):
            b, h, u, slot = (int(x) for x in dup.nonzero()[0])
            raise SelectionError(f"index {int(ordered[b, h, u, slot + 1])} appears twice in query unit "
                                 f"{[b, h, u]}: each key unit may be selected once")

    def unit_mask(self, kv_units: int) -> Tensor:
        """bool (B, H_sel, query units, kv_units): True where a unit is selected."""
        return _selected_units(self.indices, kv_units)

    def kept_units(self, kv_units: int) -> Tensor:
        """bool (B, H_sel, kv_units): True where some query unit selected the unit."""
        return _selected_units(self.indices.flatten(2), kv_units)

    def mask_rows(self, rows: Tensor, seq_len: int, heads: int, kv_heads: int) -> Tensor:
        """bool (B, H, len(rows), N): the selection alone (no base pattern) on query `rows`."""
        kv_units = math.ceil(seq_len / self.kv_unit)
        rows = rows.to(self.indices.device)
        # Only the rows' own units: every unit's mask is N x N / kv_unit booleans per head at long contexts.
        per_row = _selected_units(self.indices[:, :, rows // self.q_unit], kv_units)  # (B, H_sel, c, KU)
        per_row = per_row[:, self.head_index(heads, kv_heads).to(per_row.device)]  # (B, H, c, KU)
        keys = torch.arange(seq_len, device=per_row.device) // self.kv_unit
        return per_row[..., keys]

    def dense_mask(self, base: Tensor, heads: int, kv_heads: int) -> Tensor:
        """bool (B, H, q_len, N): the effective mask over every row, `base` the pattern's dense (q_len, N) mask on
        the selection's device (what implementations that mask dense scores use)."""
        rows = torch.arange(base.shape[0], device=self.indices.device)
        return self.mask_rows(rows, base.shape[1], heads, kv_heads) & base

    def counts(self) -> Tensor:
        """int64 (B, H_sel, query units): the units kept per query unit (padding not counted)."""
        return (self.indices >= 0).sum(dim=-1)


def _selected_units(indices: Tensor, kv_units: int) -> Tensor:
    """bool (*indices.shape[:-1], kv_units): True at each index (-1 pads)."""
    idx = indices.to(torch.int64)
    out = torch.zeros(*idx.shape[:-1], kv_units + 1, dtype=torch.bool, device=idx.device)
    out.scatter_(-1, torch.where(idx < 0, kv_units, idx), True)  # padding lands in the spare column
    return out[..., :kv_units]


def effective_mask(selection: Selection, pattern: object, rows: Tensor, heads: int, kv_heads: int) -> Tensor:
    """bool (B, H, len(rows), N): the base pattern AND the selection, on query `rows` (rows of the q_len x N
    matrix)."""
    seq_len = pattern.seq_len  # type: ignore[attr-defined]
    base = pattern.mask(rows.cpu()[:, None], torch.arange(seq_len)[None, :])  # type: ignore[attr-defined]
    chosen = selection.mask_rows(rows, seq_len, heads, kv_heads)
    return chosen & base.to(chosen.device)
