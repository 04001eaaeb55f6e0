"""A case: one point of a sweep. Every field of DESIGN.md's case table, with its default."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import torch

from bench.patterns import PATTERN_FIELDS, Pattern, make_pattern

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
MODES = ("fwd", "fwd_bwd")
DEVICES = ("auto", "cpu", "cuda")
_DTYPE_SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


@dataclass(frozen=True)
class Case:
    batch: int = 1
    heads: int = 4
    head_dim: int = 64
    seq_len: int = 1024
    dtype: str = "float32"
    pattern: str = "local"
    window: int = 64
    density: float | None = None
    block_size: int = 64
    dilation: int = 1
    global_tokens: int = 0
    seed: int = 0
    mode: str = "fwd"
    checkpoint: bool = False
    world_size: int = 1
    device: str = "auto"

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def params(self) -> dict[str, Any]:
        """Every case field, in declaration order (the record's `params`)."""
        return asdict(self)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def pattern_fields(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in PATTERN_FIELDS}

    def make_pattern(self) -> Pattern:
        return make_pattern(self.pattern, self.seq_len, **self.pattern_fields())

    def pattern_label(self) -> str:
        return self.make_pattern().label

    @property
    def case_id(self) -> str:
        """Readable and stable: the same parameters give the same id in every run, on every machine."""
        digest = hashlib.sha1(json.dumps(self.params(), sort_keys=True).encode()).hexdigest()[:8]
        parts = [self.pattern_label(), f"n{self.seq_len}",
                 f"b{self.batch}h{self.heads}d{self.head_dim}", _DTYPE_SHORT[self.dtype], self.mode]
        if self.checkpoint:
            parts.append("ckpt")
        if self.world_size > 1:
            parts.append(f"p{self.world_size}")
        parts.append(digest)
        return "-".join(parts)

    @property
    def label(self) -> str:
        """Short label for tables: pattern, shape and mode."""
        extra = " ckpt" if self.checkpoint else ""
        world = f" P={self.world_size}" if self.world_size > 1 else ""
        return (f"{self.pattern_label()} N={self.seq_len} B{self.batch}H{self.heads}D{self.head_dim} "
                f"{_DTYPE_SHORT[self.dtype]} {self.mode}{extra}{world}")

    def with_device(self, device: str) -> Case:
        return replace(self, device=device)


def resolve_device(requested: str) -> str:
    """`auto` is cuda when a GPU is visible, else cpu."""
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested
