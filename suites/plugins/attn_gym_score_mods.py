"""A plugin that benchmarks attention-gym's score_mods on every implementation that takes custom ones.

attention-gym writes score modifications as FlexAttention score_mods, `(score, b, h, q_idx, kv_idx) -> score`.
`register_score_mod` turns each into a value of the case field `score_mod`: the oracle, dense, naive_loop and
FlexAttention then apply it with no other code (the implementations whose kernels apply only the built-ins skip
it with the reason). q_idx is the row of the q_len x seq_len matrix, as FlexAttention passes it.
"""

from __future__ import annotations

try:
    from attn_gym.mods import generate_alibi_bias, generate_tanh_softcap
except ImportError as exc:  # a clear message, which `bench run` prints as a bad plugin (exit 2)
    raise ImportError("this plugin needs attention-gym: pip install 'sparse-attention-bench[attn-gym]' "
                      f"(or pip install attn-gym) ({exc})") from None

from bench.patterns import register_score_mod

# attention-gym's ALiBi adds (kv_idx - q_idx) * 2^(-8 (h + 1) / H): under a causal mask with q_len = seq_len it is
# the built-in `alibi` for a power-of-two head count (tests check that they agree).
register_score_mod("agym_alibi", lambda p: generate_alibi_bias(p.heads), fields=("heads",),
                   description="attention-gym generate_alibi_bias(H): + (kv_idx - q_idx) * 2^(-8 (h + 1) / H)")
# Grok-1's cap; `softcap` is the built-in's own field, so this one names its cap
register_score_mod("agym_softcap30", lambda p: generate_tanh_softcap(30.0, approx=False),
                   description="attention-gym generate_tanh_softcap(30): 30 * tanh(s / 30) (Grok-1)")
