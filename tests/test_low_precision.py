"""`blocked` in bfloat16 and float16: the products run in the inputs' dtype (the low-precision GEMMs), the
softmax statistics and the key-gradient sums in float32, within the dtype's tolerance of the float64 oracle
on both plans (band windows, gathered blocks), grouped-query attention at head_dim 128, causal windows wider
than a block, forward with and without autograd and gradients."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.api import attention
from bench.measure.oracle.reference import compare, reference_attention, tolerance_for
from bench.patterns import make_pattern

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
# (pattern, fields, heads, kv_heads, head_dim): band and gather plans, GQA with 4 query heads per KV head
CASES = [
    ("local", dict(window=24, block_size=16), 2, 2, 16),
    ("causal_local", dict(window=70, block_size=16), 4, 1, 128),  # window wider than a block, GQA, D=128
    ("block_random", dict(density=0.3, block_size=16, seed=3), 4, 1, 32),
    ("causal", dict(block_size=16), 2, 2, 16),  # gather steps sharing one run of key blocks
    ("dilated", dict(window=24, dilation=3, block_size=16), 2, 2, 16),
]
PRODUCTS = {"aten.bmm.default", "aten.bmm.out", "aten.baddbmm.default", "aten.baddbmm.out"}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name, fields, heads, kv_heads, head_dim", CASES, ids=[c[0] for c in CASES])
def test_low_precision_blocked_matches_the_oracle(name, fields, heads, kv_heads, head_dim, dtype):
    pattern = make_pattern(name, 150, **fields)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, 150, head_dim, generator=gen).to(DTYPES[dtype]).requires_grad_()
    k, v = (torch.randn(1, kv_heads, 150, head_dim, generator=gen).to(DTYPES[dtype]).requires_grad_()
            for _ in range(2))
    out = attention("blocked", q, k, v, pattern)
    grad_out = torch.randn(out.shape, generator=gen).to(out.dtype)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    with torch.no_grad():
        inference = attention("blocked", q, k, v, pattern)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected = reference_attention(*leaves, pattern)
    expected_grads = torch.autograd.grad(expected, leaves, grad_out.double())
    tol = tolerance_for(dtype)
    checks = {"out": (out, expected), "out (no grad)": (inference, expected)}
    checks.update(zip(("dq", "dk", "dv"), zip(grads, expected_grads, strict=True), strict=True))
    for label, (got, want) in checks.items():
        assert got.dtype == DTYPES[dtype], label
        stats = compare(got, want.detach(), tol)
        assert stats.nonfinite == 0 and stats.passed, f"{name} {dtype} {label}: rel_l2 {stats.rel_l2} > {tol}"


class _Ops(TorchDispatchMode):
    """Records (op name, input dtypes, output dtype) of every op dispatched on this thread."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple[torch.dtype, ...], torch.dtype | None]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = tuple(a.dtype for a in args if isinstance(a, torch.Tensor))
        self.calls.append((str(func), ins, out.dtype if isinstance(out, torch.Tensor) else None))
        return out


@pytest.mark.parametrize("name", ["local", "block_random"])
def test_low_precision_products_run_in_the_inputs_dtype_and_key_gradients_sum_in_float32(name):
    pattern = make_pattern(name, 256, window=64, density=0.3, block_size=32, seed=1)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 256, 64, generator=gen).to(torch.bfloat16).requires_grad_() for _ in range(3))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # steps run on this thread, where the mode records them
    try:
        with _Ops() as ops:
            out = attention("blocked", q, k, v, pattern)
            torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    finally:
        torch.set_num_threads(threads)
    products = [c for c in ops.calls if c[0] in PRODUCTS]
    assert products and all(set(ins) == {torch.bfloat16} for _, ins, _ in products), products[:3]
    sums = [c for c in ops.calls if c[0].startswith("aten.index_add")]
    assert sums and all(ins[0] == torch.float32 for _, ins, _ in sums), sums[:3]
    torch.set_num_threads(1)
    try:
        with torch.no_grad(), _Ops() as forward:
            attention("blocked", q, k, v, pattern)
    finally:
        torch.set_num_threads(threads)
    # the forward never converts bfloat16 to float32 (the old path made float32 copies of K and V)
    assert not [c for c in forward.calls if torch.bfloat16 in c[1] and c[2] == torch.float32]


def test_low_precision_gradients_are_identical_run_to_run():
    if torch.get_num_threads() < 2:
        pytest.skip("needs two torch threads for steps side by side")
    pattern = make_pattern("causal_local", 1024, window=200, block_size=32)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, 1024, 32, generator=gen).to(torch.bfloat16) for _ in range(3))
    first = None
    for _ in range(3):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        grads = torch.autograd.grad(attention("blocked", *leaves, pattern).float().square().sum(), leaves)
        if first is None:
            first = grads
        else:
            assert all(torch.equal(a, b) for a, b in zip(first, grads, strict=True))


@pytest.mark.parametrize("mode, path", [("fwd", "band_fused"), ("fwd_bwd", "band")])
def test_low_precision_inference_on_a_band_takes_the_fused_kernel(mode, path):
    # float16: bfloat16 inference goes to blocked's own CPU kernel (tests/test_blocked_kernel.py)
    from bench import registry
    from bench.api import case_for
    from bench.measure.case.steps import set_up_plain
    from impls.blocked.fused import FUSED_ROWS, fused_available

    pattern = make_pattern("causal_local", 600, window=100, block_size=16)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 600, 32, generator=gen).to(torch.float16) for _ in range(3))
    if not fused_available(q):
        pytest.skip("this torch has no CPU flash kernel")
    if mode == "fwd_bwd":
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    prepared = set_up_plain(registry.get("blocked"), case_for(q, pattern, mode, k), pattern, q, k, v)
    assert prepared.config is not None and prepared.config["path"] == path
    assert prepared.config["query_block_rows"] == (FUSED_ROWS if mode == "fwd" else 16)
    stats = compare(prepared.first_output, reference_attention(*(t.detach().double() for t in (q, k, v)), pattern),
                    tolerance_for("float16"))
    assert stats.passed, stats.rel_l2
