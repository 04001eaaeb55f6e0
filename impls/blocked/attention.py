"""The entry point of `blocked`: inference without autograd, or an autograd.Function over both passes."""

from __future__ import annotations

import torch
from torch import Tensor

from impls.blocked.backward import band_backward, gather_backward
from impls.blocked.compute import band_forward, gather_forward
from impls.blocked.fused import band_fused
from impls.blocked.plan import BandPlan, GatherPlan


def _forward(plan: BandPlan | GatherPlan, q: Tensor, k: Tensor, v: Tensor, keep: bool) -> tuple[Tensor, list]:
    if isinstance(plan, BandPlan):
        return band_forward(plan, q, k, v, keep)
    return gather_forward(plan, q, k, v, keep)


class BlockedAttention(torch.autograd.Function):
    """Differentiable blocked attention over grouped inputs; saves each step's probabilities (O(nnz))."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, plan: BandPlan | GatherPlan) -> Tensor:
        out, probs = _forward(plan, q, k, v, keep=True)
        ctx.save_for_backward(q, k, v, out)
        ctx.probs, ctx.plan = probs, plan
        return out[:, :, : q.shape[2]]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out: Tensor):
        q, k, v, out = ctx.saved_tensors
        backward = band_backward if isinstance(ctx.plan, BandPlan) else gather_backward
        grads = backward(ctx.plan, q, k, v, out, ctx.probs, d_out.contiguous())
        ctx.probs = None
        return (*grads, None)


def blocked_attention(plan: BandPlan | GatherPlan, q: Tensor, k: Tensor, v: Tensor,
                      fused: BandPlan | None = None) -> Tensor:
    """q (B*Hkv, G, q_len, D), k, v (B*Hkv, N, D) -> (B*Hkv, G, q_len, D) in k's dtype: query head g of KV
    head h reads h's keys. The products run in k's dtype (float64, float32, bfloat16 or float16; q is
    converted to it step by step where it differs), low-precision softmax and key gradients in float32.
    Without autograd and with a `fused` band plan, through the fused kernel (`fused`) instead. Rows without an
    allowed key are zero."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        out = BlockedAttention.apply(q, k, v, plan)
    elif fused is not None:
        plan = fused
        out = band_fused(fused, q, k, v)[:, :, : q.shape[2]]
    else:
        out = _forward(plan, q, k, v, keep=False)[0][:, :, : q.shape[2]]
    if plan.empty_rows is not None:
        out = out.masked_fill(plan.empty_rows[:, None], 0.0)
    return out
