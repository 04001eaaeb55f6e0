"""A plugin that benchmarks attention-gym's mask zoo on every implementation (docs/custom-patterns.md).

attention-gym (`pip install 'sparse-attention-bench[attn-gym]'`, or `pip install attn-gym`; it needs only
torch) writes its masks as FlexAttention mask_mods. `register_mask_mod` turns each into a pattern of this
suite, so that the oracle, csr, blocked, our Triton kernel, sdpa and FlexAttention all run it with no other
code. Each factory reads the case's pattern fields (window, prefix, image_width, ...), which also label the
pattern's series. One pattern here is written as a predicate class instead (`register_pattern`).
"""

from __future__ import annotations

try:
    from attn_gym.masks import (
        generate_dilated_sliding_window,
        generate_natten,
        generate_prefix_lm_mask,
        generate_sliding_window,
    )
except ImportError as exc:  # a clear message, which `bench run` prints as a bad plugin (exit 2)
    raise ImportError("this plugin needs attention-gym: pip install 'sparse-attention-bench[attn-gym]' "
                      f"(or pip install attn-gym) ({exc})") from None

from bench.patterns import Pattern, register_mask_mod, register_pattern

# attention-gym's sliding window is q - kv <= window_size and causal: `window` + 1 keys, as our causal_local.
register_mask_mod("agym_sliding_window", lambda p: generate_sliding_window(p.window - 1), fields=("window",),
                  description="attention-gym generate_sliding_window(W - 1): causal, W keys")
register_mask_mod("agym_dilated_sliding_window", lambda p: generate_dilated_sliding_window(p.window, p.dilation),
                  fields=("window", "dilation"),
                  description="attention-gym generate_dilated_sliding_window(W, d)")
register_mask_mod("agym_prefix_lm", lambda p: generate_prefix_lm_mask(p.prefix), fields=("prefix",),
                  description="attention-gym generate_prefix_lm_mask(P)")
# generate_natten(canvas_w, canvas_h, kernel_w, kernel_h): exact on square images only (its rows are clamped
# with the width; tests/test_patterns.py shows the pairs that differ on others); our `neighborhood` is exact.
register_mask_mod("agym_natten", lambda p: generate_natten(p.image_width, p.seq_len // p.image_width, p.window,
                                                           p.window),
                  fields=("window", "image_width"),
                  description="attention-gym generate_natten on a seq_len / image_width image (square images)")


@register_pattern
class Checker(Pattern):
    """A predicate class: alternate blocks of a checkerboard, plus the diagonal."""

    name = "checker"
    fields = ("block_size",)
    description = "alternate blocks, plus the diagonal"
    length_free = True  # reads no seq_len: one instance serves packed documents of every length

    def allowed(self, i, j):
        return ((i // self.block_size + j // self.block_size) % 2 == 0) | (i == j)
