"""A planted kernel that is correct by the fixed tolerance but worse than the same-dtype reference: dense
attention in float32, its output rounded to bfloat16, perturbed by a few units in the last place and rounded
again (tests/test_numerics.py expects the ratio rule to flag it)."""

from __future__ import annotations

import math

import torch

from bench.registry import Impl, register


@register
class RoundsTwice(Impl):
    name = "test_rounds_twice"
    description = "dense attention, its output rounded through bfloat16 twice with 1.5 ulps of seeded noise"
    dtypes = frozenset({"bfloat16"})

    def prepare(self, case, pattern, q, k, v):
        mask = pattern.dense_mask()
        group = q.shape[1] // k.shape[1]
        gen = torch.Generator().manual_seed(5)
        noise = torch.randn(q.shape, generator=gen)

        def call():
            kf, vf = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
            s = (q.float() @ kf.transpose(-1, -2)) / math.sqrt(q.shape[-1])
            out = torch.softmax(s.masked_fill(~mask, -math.inf), -1).nan_to_num(0.0) @ vf
            once = out.to(torch.bfloat16).float()
            ulp = once.abs().clamp_min(1e-3) * 2.0**-7  # bfloat16's spacing near each value
            return (once + 1.5 * ulp * noise).to(torch.bfloat16)

        return call
