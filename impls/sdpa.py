"""`sdpa`: torch.nn.functional.scaled_dot_product_attention with the pattern as a boolean mask."""

from __future__ import annotations

import torch.nn.functional as F

from bench.registry import Impl, register


@register
class Sdpa(Impl):
    name = "sdpa"
    description = "torch scaled_dot_product_attention with a boolean (N, N) mask"
    fwd_bwd = True

    def memory_bytes(self, case):
        return case.seq_len**2  # the (N, N) bool mask; the kernel PyTorch picks may need more, never less

    def prepare(self, case, pattern, q, k, v):
        mask = pattern.dense_mask().to(q.device)  # (N, N), True = attend
        empty_rows = ~mask.any(dim=-1)  # SDPA leaves fully masked rows undefined; the contract says zeros
        if bool(empty_rows.any()):
            keep = (~empty_rows)[:, None].to(q.dtype)  # (N, 1)

            def call_with_empty_rows():
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).nan_to_num(0.0) * keep

            return call_with_empty_rows

        def call():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

        return call
