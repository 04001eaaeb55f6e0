"""Small maths shared by several implementations (implementations never import each other)."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def softmax_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """Low-precision inputs accumulate the softmax in float32."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def masked_softmax(scores: Tensor, mask: Tensor) -> Tensor:
    """Softmax over the last dim where `mask` allows; a row with no allowed entry gives zeros."""
    scores = scores.masked_fill(~mask, -math.inf)
    probs = torch.softmax(scores, dim=-1)
    return torch.where(mask.any(dim=-1, keepdim=True), probs, torch.zeros_like(probs))


def masked_softmax_(scores: Tensor, mask: Tensor) -> Tensor:
    """In-place `masked_softmax` for inference: no second score-sized buffer."""
    scores.masked_fill_(~mask, -math.inf)
    peak = scores.amax(dim=-1, keepdim=True)
    peak.nan_to_num_(0.0, posinf=0.0, neginf=0.0)
    scores.sub_(peak).exp_()
    denom = scores.sum(dim=-1, keepdim=True)
    return scores.div_(denom.clamp_min_(torch.finfo(scores.dtype).tiny))


def fold_heads(x: Tensor) -> Tensor:
    """(B, H, N, D) -> (B*H, N, D), a view when x is contiguous."""
    b, h, n, d = x.shape
    return x.reshape(b * h, n, d)


def unfold_heads(x: Tensor, shape: torch.Size | tuple[int, ...]) -> Tensor:
    """(B*H, N, D) -> (B, H, N, D) of `shape`."""
    return x.reshape(shape)
