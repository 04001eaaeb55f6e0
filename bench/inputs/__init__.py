"""A case's q, k, v: random Gaussians, the structured generator, or a file of captured tensors.

`make(spec, shape, ...)` is the one place inputs are made; every implementation, the oracle and every
measurement of a case see what it returns (bench.measure.case.steps.make_inputs calls it once per case, untimed).
The kinds and the case field are described in `bench.inputs.spec`; the generator in `bench.inputs.structured`;
files in `bench.inputs.files`; FlashInfer-Bench workloads in `bench.inputs.flashinfer`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from bench.inputs import files, flashinfer
from bench.inputs.spec import (
    INPUT_KINDS,
    KNOB_NAMES,
    InputsError,
    InputsInfo,
    InputsKind,
    InputsSpec,
    StructuredKnobs,
)
from bench.inputs.structured import Needle, structured_inputs

__all__ = ["INPUT_KINDS", "KNOB_NAMES", "CaseInputs", "InputsError", "InputsInfo", "InputsKind", "InputsShape",
           "InputsSpec", "Needle", "StructuredKnobs", "another_set", "make", "random_tensors"]

# Seeds of the further input sets timed calls cycle through (bench.measure.cold): far from any case's own seed.
OTHER_SET_SEED = 1_000_000_007


@dataclass(frozen=True)
class InputsShape:
    batch: int
    heads: int
    kv_heads: int
    seq_len: int
    q_len: int
    head_dim: int
    block_size: int

    def q_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.heads, self.q_len, self.head_dim)

    def kv_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.kv_heads, self.seq_len, self.head_dim)


@dataclass
class CaseInputs:
    """q (B, H, q_len, D), k, v (B, Hkv, N, D) in the case's dtype on its device, and where they came from."""

    q: Tensor
    k: Tensor
    v: Tensor
    kind: InputsKind
    seed: int
    file: str | None = None
    file_sha256: str | None = None
    layer: int | None = None
    needles: list[Needle] = field(default_factory=list)

    @property
    def tensors(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.q, self.k, self.v

    def info(self) -> InputsInfo:
        """The record's `inputs`: {kind, seed, file, file_sha256, layer, needles (how many were planted)}."""
        return InputsInfo(kind=self.kind, seed=self.seed, file=self.file, file_sha256=self.file_sha256,
                          layer=self.layer, needles=len(self.needles) if self.kind == "structured" else None)


def random_tensors(shape: InputsShape, seed: int, dtype: torch.dtype, device: str, salt: int = 0
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """Independent standard normals q, k, v, drawn in float32 on the device from (seed, salt), then cast."""
    gen = torch.Generator(device=torch.device(device)).manual_seed(seed * 1_000_003 + salt)
    return tuple(  # type: ignore[return-value]
        torch.randn(s, generator=gen, device=device, dtype=torch.float32).to(dtype)
        for s in (shape.q_shape(), shape.kv_shape(), shape.kv_shape())
    )


def make(spec: InputsSpec, shape: InputsShape, seed: int, dtype: torch.dtype, device: str) -> CaseInputs:
    """The case's inputs (module docstring). Raises InputsError for a file that no longer fits the case."""
    if spec.kind == "random":
        q, k, v = random_tensors(shape, seed, dtype, device)
        return CaseInputs(q, k, v, "random", seed)
    if spec.kind == "structured":
        made = structured_inputs(batch=shape.batch, heads=shape.heads, kv_heads=shape.kv_heads,
                                 seq_len=shape.seq_len, q_len=shape.q_len, head_dim=shape.head_dim,
                                 block_size=shape.block_size, seed=seed, knobs=spec.structured)
        q, k, v = (t.to(device=device, dtype=dtype) for t in (made.q, made.k, made.v))
        return CaseInputs(q, k, v, "structured", seed, needles=made.needles)
    if spec.kind == "flashinfer":  # what the workload does not store is drawn as `random` draws it
        drawn = random_tensors(shape, seed, dtype, device)
        given = flashinfer.load(spec, shape.batch, shape.heads, shape.kv_heads, shape.seq_len, shape.q_len,
                                shape.head_dim)
        q, k, v = (d if g is None else g.to(device=device, dtype=dtype)
                   for d, g in zip(drawn, (given.q, given.k, given.v), strict=True))
        return CaseInputs(q, k, v, "flashinfer", seed, file=given.file, file_sha256=given.sha256)
    files.check_shapes(spec, batch=shape.batch, heads=shape.heads, kv_heads=shape.kv_heads,
                       head_dim=shape.head_dim, seq_len=shape.seq_len, q_len=shape.q_len)
    q, k, v = (t.to(device=device, dtype=dtype) for t in files.load(spec, seq_len=shape.seq_len, q_len=shape.q_len))
    return CaseInputs(q, k, v, "file", seed, file=spec.file, file_sha256=spec.sha256, layer=spec.layer)


def another_set(made: CaseInputs, spec: InputsSpec, shape: InputsShape, dtype: torch.dtype, device: str,
                index: int = 1) -> tuple[Tensor, Tensor, Tensor]:
    """Other values for the same case, written into its tensors between timed calls (bench.measure.cold): drawn
    again from another seed for the generated kinds (random, structured); for given tensors (a file, a workload)
    the same tensors negated, which keeps every score q.k (so every selection and the work it implies) and
    negates the output."""
    seed = made.seed + index * OTHER_SET_SEED
    if made.kind in ("random", "structured"):
        other = make(spec, shape, seed, dtype, device)
        return other.q, other.k, other.v
    return -made.q, -made.k, -made.v
