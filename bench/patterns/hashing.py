"""The counter-based hash behind the random patterns: a uniform draw for any (seed, a, b), on any sub-block.

Random patterns draw from a hash of (seed, i, j) rather than from a generator's stream, so the predicate can
be evaluated on any sub-block independently and depends only on the seed. Only out-of-place elementwise ops
on int64 tensors: FlexAttention's compiled mask_mods cannot lower in-place ones.
"""

from __future__ import annotations

import torch
from torch import Tensor

_MASK32 = 0xFFFFFFFF


def _fmix32(h: Tensor) -> Tensor:
    """MurmurHash3's 32-bit finaliser on int64 tensors holding values in [0, 2**32)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK32  # the product can wrap int64; the low 32 bits stay exact
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def seed_key(seed: int | Tensor) -> int | Tensor:
    """Mix the seed once so that nearby seeds give unrelated patterns (an int, or a 0-dim int64 tensor)."""
    h = seed & _MASK32
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def hash_keep(key: int | Tensor, a: Tensor, b: Tensor, threshold: int | Tensor) -> Tensor:
    """True where hash(seed, a, b) < threshold, a uniform draw with probability threshold / 2**32."""
    h = _fmix32(((a * 0x9E3779B1) ^ key) & _MASK32)
    h = _fmix32((h ^ ((b * 0x85EBCA77) & _MASK32)) & _MASK32)
    return h < threshold


def keep_threshold(p: float | Tensor) -> int | Tensor:
    """round(p * 2**32): the `hash_keep` threshold for probability p.

    p may also be a 0-dim float64 tensor (FlexAttention's mask_mod reads pattern fields from tensors so that
    compiled graphs do not bake them in); both round half to even and p * 2**32 is exact in float64.
    """
    scaled = p * 2**32
    return torch.round(scaled) if isinstance(scaled, Tensor) else round(scaled)
