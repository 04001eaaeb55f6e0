"""Packed documents: the sequence is several documents back to back, and no pair crosses documents.

A case's `documents` is a list of lengths summing to seq_len, or a count whose lengths are drawn from the
case's seed (each at least 1). Inside each document the pattern applies on positions relative to the
document's start (attention-gym's `generate_doc_mask_mod`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# Salt of the generator that draws document lengths from a count, so that they do not follow the draws of
# the inputs or of a random pattern with the same seed.
_DRAW_SALT = 0x5D0C


def document_lengths(spec: int | list[int] | tuple[int, ...] | None, seq_len: int, seed: int
                     ) -> tuple[int, ...] | None:
    """The document lengths of `spec`, or None without documents. Raises ValueError naming what is wrong."""
    if spec is None:
        return None
    if isinstance(spec, bool):
        raise ValueError(f"got {spec!r}; documents is a count or a list of lengths")
    if isinstance(spec, int):
        if not 1 <= spec <= seq_len:
            raise ValueError(f"got a count of {spec}; allowed: 1 to seq_len ({seq_len}) documents, each of "
                             "length >= 1")
        if spec == 1:
            return (seq_len,)
        gen = torch.Generator().manual_seed(seed * 1_000_003 + _DRAW_SALT)
        cuts = torch.sort(torch.randperm(seq_len - 1, generator=gen)[: spec - 1] + 1).values
        bounds = torch.cat([torch.tensor([0]), cuts, torch.tensor([seq_len])])
        return tuple(int(x) for x in bounds.diff())
    lengths = tuple(spec)
    if not lengths:
        raise ValueError("got an empty list; allowed: a count, or a list of lengths >= 1 summing to seq_len")
    for index, length in enumerate(lengths):
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(f"document {index} has length {length!r}; every length must be an integer >= 1")
    if sum(lengths) != seq_len:
        raise ValueError(f"lengths {_short(lengths)} sum to {sum(lengths)}; they must sum to seq_len "
                         f"({seq_len})")
    return lengths


def _short(lengths: tuple[int, ...]) -> str:
    text = repr(list(lengths))
    return text if len(text) <= 60 else text[:57] + "...]"


@dataclass(frozen=True)
class DocumentIndex:
    """Per-position document ids and per-document starts and lengths, as int64 tensors on one device."""

    doc_id: Tensor  # (N,)
    start: Tensor  # (documents,)
    length: Tensor  # (documents,)

    @classmethod
    def of(cls, lengths: tuple[int, ...], device: torch.device | str = "cpu") -> DocumentIndex:
        length = torch.tensor(lengths, dtype=torch.int64)
        start = torch.cumsum(length, 0) - length
        doc_id = torch.repeat_interleave(torch.arange(len(lengths)), length)
        return cls(doc_id.to(device), start.to(device), length.to(device))

    def to(self, device: torch.device | str) -> DocumentIndex:
        return DocumentIndex(self.doc_id.to(device), self.start.to(device), self.length.to(device))


def label_of(spec: int | list[int] | tuple[int, ...], lengths: tuple[int, ...]) -> str:
    """`docs8` for a count; `docs3=1+5+10` for a short explicit list; `docs12~1a2b` for a long one."""
    if isinstance(spec, int):
        return f"docs{len(lengths)}"
    if len(lengths) <= 4:
        return f"docs{len(lengths)}=" + "+".join(str(n) for n in lengths)
    import hashlib

    digest = hashlib.sha1(repr(lengths).encode()).hexdigest()[:4]
    return f"docs{len(lengths)}~{digest}"
