"""Custom score_mods that misbehave, for the bad-input tests (loaded via `plugins:`)."""

import torch

from bench.patterns import register_score_mod


def raising(p):
    def score_mod(score, b, h, q_idx, kv_idx):
        raise RuntimeError("planted failure")

    return score_mod


def late(p):
    def score_mod(score, b, h, q_idx, kv_idx):
        if kv_idx.numel() > 3:  # passes the load-time probe (3 keys), fails on a real case
            raise RuntimeError("planted late failure")
        return score

    return score_mod


def not_a_tensor(p):
    return lambda score, b, h, q_idx, kv_idx: 1.0


register_score_mod("bad_raises", raising)
register_score_mod("bad_late", late)
register_score_mod("bad_not_tensor", not_a_tensor)
register_score_mod("bad_factory", lambda p: torch.zeros(()) // 0 + p.no_such_field)
