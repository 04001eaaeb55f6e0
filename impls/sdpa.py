"""`sdpa`: torch.nn.functional.scaled_dot_product_attention with the pattern as a boolean mask.

Grouped-query attention through SDPA's own `enable_gqa` (no repeated K/V); fewer query rows than keys
take the (q_len, N) mask as it is, so the bottom-right alignment is the pattern's.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from bench.registry import Impl, register, setup_phase
from bench.selection import TakesSelections
from impls.common import positions


@register
class Sdpa(Impl):
    name = "sdpa"
    description = "torch scaled_dot_product_attention with a boolean (q_len, N) mask; enable_gqa for GQA"
    fwd_bwd = True
    # additive ones through a float mask (the bias, -inf where the pattern disallows); SDPA takes no score function
    score_mods = frozenset({"alibi", "relative_bias"})
    selections: ClassVar[TakesSelections] = {"q_unit": (1, "block"), "kv_unit": ("token", "block", "page")}
    # SDPA returns no log-sum-exp: a sink is one more key instead, of zero key and value, whose logit the float
    # mask sets to the head's sink (`with_sink_key`)
    applies_sinks = True

    def memory_bytes(self, case):
        if case.sinks is not None:  # the float (B or 1, H, Nq, N + 1) mask, K and V one key longer
            extra = 2 * case.batch * case.n_kv_heads * (case.seq_len + 1) * case.head_dim * case.element_bytes
            return case.score_bytes(case.element_bytes) + extra
        if case.selector is not None:  # the effective (B, H, Nq, N) bool mask, and the math path's float scores
            return case.score_bytes(1) + case.score_bytes()
        if case.score_mod != "none":  # and the float (H, Nq, N) bias mask
            return case.n_queries * case.seq_len + case.score_bytes(case.element_bytes)
        return case.n_queries * case.seq_len  # the bool mask; the kernel PyTorch picks may need more, never less

    def unsupported_score_mod(self, case):
        reason = super().unsupported_score_mod(case)
        if reason:
            reason += ("; SDPA takes only an additive mask, and softcap is a function of the score" if
                       case.score_mod == "softcap" else "; SDPA takes only an additive mask, and a custom score_mod "
                       "is a function of the score")
        return reason

    def prepare(self, case, pattern, q, k, v):
        if case.sinks is not None:
            return self._prepare_sinks(case, pattern, q, k, v)
        with setup_phase("mask"):
            mask = pattern.dense_mask().to(q.device)  # (Nq, N), True = attend
            bias = case.make_score_mod()
            if bias is not None:  # the additive modification as a float mask: (1, H, Nq, N), -inf off the pattern
                i, j = positions(case, torch.device("cpu"))
                attn = bias.bias(case.heads, i[:, 0], j[0], q.dtype).to(q.device)
                mask_or_bias = attn.masked_fill_(~mask, float("-inf"))[None]
        if bias is None:
            mask_or_bias = mask
        gqa = k.shape[1] != q.shape[1]
        empty_rows = ~mask.any(dim=-1)  # SDPA leaves fully masked rows undefined; the contract says zeros
        if bool(empty_rows.any()):
            keep = (~empty_rows)[:, None].to(q.dtype)  # (Nq, 1)

            def call_with_empty_rows():
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_or_bias, enable_gqa=gqa)
                return out.nan_to_num(0.0) * keep

            return call_with_empty_rows

        def call():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask_or_bias, enable_gqa=gqa)

        return call

    def _prepare_sinks(self, case, pattern, q, k, v):
        """Sinks as a key: every row's softmax includes the sink key, so no row is empty and none needs zeroing."""
        with setup_phase("mask"):
            mask = with_sink_key(pattern.dense_mask().to(q.device)[None, None], case, q.dtype)  # (1, H, Nq, N+1)
            bias = case.make_score_mod()
            if bias is not None:  # an additive score_mod beside the sinks: on the keys' columns
                i, j = positions(case, torch.device("cpu"))
                mask[0, :, :, :-1] += bias.bias(case.heads, i[:, 0], j[0], q.dtype).to(q.device)

        def call():
            return attend_with_sink_key(q, k, v, mask)

        return call

    def prepare_selected(self, case, pattern, q, k, v):
        """Attention over a selection: SDPA with the effective (B, H, q_len, N) boolean mask."""
        with setup_phase("mask"):
            base = pattern.dense_mask().to(q.device)  # (Nq, N)
        h, hkv = q.shape[1], k.shape[1]
        if case.sinks is not None:
            def attend_with_sinks(selection):
                return attend_with_sink_key(q, k, v, with_sink_key(selection.dense_mask(base, h, hkv), case, q.dtype))

            return attend_with_sinks

        def attend(selection):
            mask = selection.dense_mask(base, h, hkv)  # (B, H, Nq, N)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=h != hkv)
            # rows without a key: SDPA leaves them undefined, the contract says zeros
            return out.nan_to_num(0.0) * mask.any(dim=-1, keepdim=True).to(q.dtype)

        return attend


def attend_with_sink_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SDPA over K and V with the sink's zero key and value appended (inside the timed call: their values change
    between calls), under `with_sink_key`'s float mask."""
    k1, v1 = (F.pad(t, (0, 0, 0, 1)) for t in (k, v))
    return F.scaled_dot_product_attention(q, k1, v1, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])


def with_sink_key(allowed: torch.Tensor, case, dtype: torch.dtype) -> torch.Tensor:
    """The float mask (B or 1, H, Nq, N + 1) of `allowed` (B or 1, H or 1, Nq, N) bool with one more key whose
    additive term is the head's sink logit: 0 where allowed, -inf elsewhere, the sink in the last column."""
    sinks = case.sink_logits().to(device=allowed.device, dtype=dtype)
    b, _, nq, n = allowed.shape
    mask = torch.zeros(b, case.heads, nq, n + 1, dtype=dtype, device=allowed.device)
    mask[..., :n].masked_fill_(~allowed, float("-inf"))
    mask[..., n] = sinks[:, None]
    return mask
