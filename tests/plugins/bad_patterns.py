"""Custom patterns that misbehave, for the bad-input tests (loaded via `plugins:`); which ones register is
chosen by the BENCH_TEST_BAD_PATTERN environment variable, so one file serves every test."""

import os

import torch

from bench.patterns import Pattern, register_mask_mod, register_pattern

WHICH = os.environ.get("BENCH_TEST_BAD_PATTERN", "")

if WHICH == "clash":

    @register_pattern
    class MyCausal(Pattern):
        name = "causal"  # a built-in's name

        def allowed(self, i, j):
            return j <= i

if WHICH == "raises":

    def raising(p):
        def mask_mod(b, h, q_idx, kv_idx):
            return (q_idx // 0) > kv_idx  # integer division by zero raises

        return mask_mod

    register_mask_mod("bad_raises", raising)

if WHICH == "not_bool":
    register_mask_mod("bad_not_bool", lambda p: (lambda b, h, q_idx, kv_idx: q_idx - kv_idx))

if WHICH == "late":  # fine on a handful of pairs, raises once asked about a whole block row

    def late(p):
        def mask_mod(b, h, q_idx, kv_idx):
            if torch.broadcast_shapes(q_idx.shape, kv_idx.shape).numel() > 64:
                raise RuntimeError("planted failure on large blocks")
            return kv_idx <= q_idx

        return mask_mod

    register_mask_mod("bad_late", late)
