"""`dense`: materialise the (B, H, N, N) scores, mask them with the pattern, softmax, multiply by V."""

from __future__ import annotations

from bench.registry import Impl, register
from impls.common import accum_dtype, masked_softmax, masked_softmax_, softmax_scale


@register
class Dense(Impl):
    name = "dense"
    description = "materialised scores + dense mask + softmax (O(N^2) memory)"
    fwd_bwd = True

    def prepare(self, case, pattern, q, k, v):
        mask = pattern.dense_mask().to(q.device)  # (N, N)
        scale = softmax_scale(case.head_dim)
        acc = accum_dtype(q.dtype)
        needs_grad = any(t.requires_grad for t in (q, k, v))

        def call():
            scores = (q @ k.transpose(-1, -2)).to(acc)  # (B, H, N, N)
            # inference: softmax in place, so only one score-sized buffer is alive
            probs = masked_softmax(scores * scale, mask) if needs_grad else masked_softmax_(scores.mul_(scale), mask)
            return (probs.to(v.dtype) @ v).to(q.dtype)

        return call
