"""Every registered implementation against the float64 oracle, through `bench.api.attention`.

Parametrised from the registry at collection time, so a new implementation is covered without editing this
file: every pattern x odd shapes (seq_len 97, 130, 257; 3 heads; head_dim 24) x float32 and bfloat16 (flex:
bfloat16 on a few patterns, see FLEX_BFLOAT16_PATTERNS), forward, and gradients for implementations that
support fwd_bwd. An implementation that cannot run a case here raises `Unavailable`, which is reported as a
skip with its reason, never as a pass.
"""

from __future__ import annotations

import math

import pytest
import torch

from bench import registry
from bench.api import attention
from bench.errors import Unavailable
from bench.measure.oracle.reference import compare, reference_attention, tolerance_for
from bench.patterns import PATTERNS, make_pattern

SEQ_LENS = [97, 130, 257]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
HEADS, HEAD_DIM = 3, 24


def pattern_for(name: str, n: int):
    fields = dict(window=16, density=0.3, block_size=16, dilation=3, global_tokens=3, seed=11)
    if name in ("axial", "neighborhood"):  # seq_len = R*C: C the smallest divisor of n at least sqrt(n)
        width = next(c for c in range(math.isqrt(n), n + 1) if c > 0 and n % c == 0)
        if name == "axial":
            fields["window"] = width
        else:  # the largest odd kernel up to 5 that fits the image
            fields["image_width"] = width
            fields["window"] = max(k for k in (1, 3, 5) if k <= min(width, n // width))
    fields["prefix"] = 20
    return make_pattern(name, n, **fields)


def inputs(n: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, HEADS, n, HEAD_DIM, generator=gen).to(dtype) for _ in range(3)]


IMPLS = registry.names()
BUILTIN_PATTERNS = sorted(name for name, cls in PATTERNS.items() if cls.source == "built-in")


def _run_or_skip(impl, q, k, v, pattern):
    try:
        return attention(impl, q, k, v, pattern)
    except Unavailable as exc:
        pytest.skip(f"{impl}: {exc.reason}")


# FlexAttention compiles once per (pattern, dtype), about 10 s each on a 2-core CPU. Its mask_mod and BlockMask,
# which are ours, do not depend on the dtype: bfloat16 runs on these patterns only, float32 on every pattern.
FLEX_BFLOAT16_PATTERNS = {"causal_local", "block_random", "neighborhood", "sink"}


def forward_params():
    for impl in IMPLS:
        for pattern_name in BUILTIN_PATTERNS:
            for n in SEQ_LENS:
                for dtype in DTYPES:
                    if impl == "flex" and dtype != "float32" and pattern_name not in FLEX_BFLOAT16_PATTERNS:
                        continue
                    yield pytest.param(impl, pattern_name, n, dtype, id=f"{impl}-{pattern_name}-{n}-{dtype}")


@pytest.mark.parametrize("impl, pattern_name, n, dtype", list(forward_params()))
def test_forward_matches_oracle(impl, pattern_name, n, dtype):
    pattern = pattern_for(pattern_name, n)
    q, k, v = inputs(n, DTYPES[dtype])
    out = _run_or_skip(impl, q, k, v, pattern)
    assert out.shape == q.shape
    stats = compare(out, reference_attention(q, k, v, pattern), tolerance_for(dtype, registry.get(impl).tf32(
        _case(q, pattern))))
    assert stats.nonfinite == 0
    assert stats.passed, f"{impl} {pattern.label} N={n} {dtype}: rel_l2 {stats.rel_l2} > {stats.tolerance}"


def _case(q, pattern):
    from bench.api import case_for

    return case_for(q, pattern)


GRAD_IMPLS = [name for name in IMPLS if registry.get(name).fwd_bwd]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("n", SEQ_LENS)
@pytest.mark.parametrize("pattern_name", BUILTIN_PATTERNS)
@pytest.mark.parametrize("impl", GRAD_IMPLS)
def test_gradients_match_oracle(impl, pattern_name, n, dtype):
    pattern = pattern_for(pattern_name, n)
    q, k, v = (t.requires_grad_() for t in inputs(n, DTYPES[dtype]))
    out = _run_or_skip(impl, q, k, v, pattern)
    grad_out = inputs(n, DTYPES[dtype], seed=1)[0]
    got = torch.autograd.grad(out, (q, k, v), grad_out)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected = torch.autograd.grad(reference_attention(*leaves, pattern), leaves, grad_out.double())
    tol = tolerance_for(dtype, registry.get(impl).tf32(_case(q, pattern)))
    for name, g, e in zip(("dq", "dk", "dv"), got, expected, strict=True):
        stats = compare(g, e, tol)
        assert stats.passed, f"{impl} {pattern.label} N={n} {dtype} {name}: rel_l2 {stats.rel_l2} > {tol}"


def test_every_builtin_family_is_registered():
    assert {"naive_loop", "dense", "sdpa"} <= set(IMPLS)


def test_unknown_impl_is_a_clear_error():
    pattern = pattern_for("local", 97)
    q, k, v = inputs(97, torch.float32)
    with pytest.raises(ValueError, match="unknown implementation 'nope'; known: "):
        attention("nope", q, k, v, pattern)


@pytest.mark.parametrize("shapes, message", [
    (((2, 3, 97, 24), (2, 3, 97, 24), (2, 3, 96, 24)), "same shape"),
    (((3, 97, 24),) * 3, "must be 4-D"),
    (((2, 3, 64, 24),) * 3, "pattern was made for seq_len=97"),
])
def test_bad_tensor_shapes_are_named(shapes, message):
    pattern = pattern_for("local", 97)
    q, k, v = (torch.randn(s) for s in shapes)
    with pytest.raises(ValueError, match=message):
        attention("dense", q, k, v, pattern)
