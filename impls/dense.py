"""`dense`: materialise the (B, H, q_len, N) scores, mask them with the pattern, softmax, multiply by V.

Grouped-query attention without copying K or V: the query heads of one KV head are stacked as rows,
(B, Hkv, G*q_len, D), and multiplied against that head's keys in one batched matmul.
"""

from __future__ import annotations

from typing import ClassVar

from bench.registry import Impl, register, setup_phase
from bench.selection import TakesSelections
from impls.common import (
    accum_dtype,
    apply_sinks,
    masked_lse_softmax,
    masked_softmax,
    masked_softmax_,
    positions,
    score_mod_fn,
    softmax_scale,
)


@register
class Dense(Impl):
    name = "dense"
    description = "materialised scores + dense mask + softmax (O(N^2) memory)"
    fwd_bwd = True
    score_mods = frozenset({"softcap", "alibi", "relative_bias", "custom"})  # applied in torch on the scores
    selections: ClassVar[TakesSelections] = {"q_unit": (1, "block"), "kv_unit": ("token", "block", "page")}
    applies_sinks = True  # through the log-sum-exp of the materialised scores

    def memory_bytes(self, case):
        # the (N, N) bool mask and the float32 (B, H, N, N) scores; low precision also holds float32 copies of
        # q and k (the scores are computed in float32); backward keeps a second float32 buffer (scaled scores)
        low = case.element_bytes < 4
        buffers = case.score_bytes() * (2 if case.mode == "fwd_bwd" else 1)
        mask = case.score_bytes(1) if case.selector is not None else case.n_queries * case.seq_len  # bool
        copies = 4 * case.head_dim * (case.batch * case.heads * case.n_queries + case.batch * case.n_kv_heads
                                      * case.seq_len)
        return mask + buffers + (copies if low else 0)

    def prepare(self, case, pattern, q, k, v):
        with setup_phase("mask"):
            mask = pattern.dense_mask().to(q.device)  # (Nq, N)
        scale = softmax_scale(case.head_dim)
        acc = accum_dtype(q.dtype)
        needs_grad = any(t.requires_grad for t in (q, k, v))
        b, h, nq, d = q.shape
        hkv, n = k.shape[1], k.shape[2]
        modify = score_mod_fn(case, q.device, acc)
        i, j = positions(case, q.device)
        sinks = case.sink_logits()

        def call():
            grouped = q.reshape(b, hkv, h // hkv * nq, d)  # (B, Hkv, G*Nq, D)
            # scores in the accumulation dtype: bfloat16 scores round a logit of 30 by 0.1 (a weight by 10%)
            scores = (grouped.to(acc) @ k.to(acc).transpose(-1, -2)).view(b, h, nq, n)  # (B, H, Nq, N)
            if sinks is not None:  # the sinks need the rows' log-sum-exp
                scaled = scores * scale
                probs, lse = masked_lse_softmax(scaled if modify is None else modify(scaled, i, j), mask)
                out = (probs.to(v.dtype).view(b, hkv, -1, n) @ v).view(b, h, nq, d)
                return apply_sinks(out, lse, sinks).to(q.dtype)
            if modify is not None:  # on the scaled scores, before the mask
                probs = masked_softmax(modify(scores * scale, i, j), mask)
                return (probs.to(v.dtype).view(b, hkv, -1, n) @ v).view(b, h, nq, d).to(q.dtype)
            # inference: softmax in place, so only one score-sized buffer is alive
            probs = masked_softmax(scores * scale, mask) if needs_grad else masked_softmax_(scores.mul_(scale), mask)
            out = probs.to(v.dtype).view(b, hkv, -1, n) @ v  # (B, Hkv, G*Nq, D)
            return out.view(b, h, nq, d).to(q.dtype)

        return call

    def prepare_selected(self, case, pattern, q, k, v):
        """Attention over a selection: the scores masked by the effective (B, H, q_len, N) mask, with the rows'
        log-sum-exp."""
        with setup_phase("mask"):
            base = pattern.dense_mask().to(q.device)  # (Nq, N)
        scale = softmax_scale(case.head_dim)
        acc = accum_dtype(q.dtype)
        b, h, nq, d = q.shape
        hkv, n = k.shape[1], k.shape[2]
        sinks = case.sink_logits()

        def attend(selection):
            mask = selection.dense_mask(base, h, hkv)  # (B, H, Nq, N)
            grouped = q.reshape(b, hkv, h // hkv * nq, d)
            scores = (grouped.to(acc) @ k.to(acc).transpose(-1, -2)).view(b, h, nq, n) * scale
            probs, lse = masked_lse_softmax(scores, mask)  # lse (B, H, Nq); -inf on rows without a key
            out = (probs.to(v.dtype).view(b, hkv, -1, n) @ v).view(b, h, nq, d)
            return apply_sinks(out, lse, sinks).to(q.dtype), lse

        return attend
