"""`dense`: materialise the (B, H, N, N) scores, mask them with the pattern, softmax, multiply by V."""

from __future__ import annotations

from bench.memory_model import ELEMENT_BYTES, score_bytes
from bench.registry import Impl, register
from impls.common import accum_dtype, masked_softmax, masked_softmax_, softmax_scale


@register
class Dense(Impl):
    name = "dense"
    description = "materialised scores + dense mask + softmax (O(N^2) memory)"
    fwd_bwd = True

    def memory_bytes(self, case):
        # the (N, N) bool mask and the float32 (B, H, N, N) scores; low precision also holds the matmul's
        # scores in the input dtype while converting; backward keeps a second float32 buffer (scaled scores)
        low = ELEMENT_BYTES[case.dtype] < 4
        buffers = score_bytes(case) * (2 if case.mode == "fwd_bwd" else 1)
        return case.seq_len**2 + buffers + (score_bytes(case, ELEMENT_BYTES[case.dtype]) if low else 0)

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
