"""`blocked` and `csr` at the edges the conformance shapes do not reach: block sizes from 1 to larger than
N, windows wider than the sequence, a single token, rows with no allowed key; forward with and without
autograd, and gradients, against the float64 oracle."""

from __future__ import annotations

import itertools

import pytest
import torch

from bench.api import attention
from bench.patterns import PATTERNS, Local, make_pattern
from bench.reference import compare, reference_attention

TOL = 1e-4  # float32


class LocalWithHoles(Local):
    """Local, but every third query row attends to nothing (its output and gradient must be zero)."""

    name = "local_with_holes"

    def allowed(self, i, j):
        return super().allowed(i, j) & (i % 3 != 0)


def _pattern(name: str, n: int, block_size: int, window: int):
    if name == LocalWithHoles.name:
        return LocalWithHoles(n, window=window, block_size=block_size)
    if name == "axial":
        window = next(c for c in (window, 5, 1) if n % c == 0)
    return make_pattern(name, n, window=window, density=0.3, block_size=block_size, dilation=3,
                        global_tokens=2, seed=5)


CASES = list(itertools.product([*sorted(PATTERNS), LocalWithHoles.name], [1, 37], [1, 8, 64], [4, 200]))


@pytest.mark.parametrize("impl", ["blocked", "csr"])
def test_edges_against_the_oracle(impl):
    failures = []
    gen = torch.Generator().manual_seed(0)
    for name, n, block_size, window in CASES:
        pattern = _pattern(name, n, block_size, window)
        q, k, v = (torch.randn(1, 2, n, 8, generator=gen).requires_grad_() for _ in range(3))
        out = attention(impl, q, k, v, pattern)
        grad_out = torch.randn(out.shape, generator=gen)
        grads = torch.autograd.grad(out, (q, k, v), grad_out, allow_unused=True)
        with torch.no_grad():
            out_inference = attention(impl, q, k, v, pattern)  # the no-autograd path
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        expected = reference_attention(*leaves, pattern)
        expected_grads = torch.autograd.grad(expected, leaves, grad_out.double(), allow_unused=True)
        checks = {"out": (out, expected), "out (no grad)": (out_inference, expected)}
        for label, got, want in zip(("dq", "dk", "dv"), grads, expected_grads, strict=True):
            want = torch.zeros_like(leaves[0]) if want is None else want
            checks[label] = (torch.zeros_like(want) if got is None else got, want)
        for label, (got, want) in checks.items():
            stats = compare(got, want, TOL)
            if not stats.passed:
                failures.append(f"{pattern.label} N={n} block_size={block_size} {label}: rel_l2 {stats.rel_l2}")
    assert not failures, "\n".join(failures)


def test_rows_without_keys_are_zero_with_zero_gradient():
    pattern = LocalWithHoles(40, window=6, block_size=8)
    for impl in ("blocked", "csr"):
        q, k, v = (torch.randn(1, 2, 40, 8).requires_grad_() for _ in range(3))
        out = attention(impl, q, k, v, pattern)
        assert torch.equal(out[:, :, ::3], torch.zeros_like(out[:, :, ::3]))
        (dq,) = torch.autograd.grad(out.sum(), (q,))
        assert torch.equal(dq[:, :, ::3], torch.zeros_like(dq[:, :, ::3]))


def test_run_steps_keeps_order_modes_and_single_threaded_steps():
    from impls.common import run_steps

    threads = torch.get_num_threads()
    cpu = torch.device("cpu")

    def probe(i: int):
        return i, torch.get_num_threads(), torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    steps = [lambda i=i: probe(i) for i in range(6)]
    with torch.no_grad():
        results = run_steps(steps, cpu)
    assert [r[0] for r in results] == list(range(6))
    assert all(r[2] is False for r in results)  # the caller's no_grad reached the threads
    if threads > 1:
        assert {r[1] for r in results} == {1}  # side by side, each single-threaded
    with torch.inference_mode():
        assert all(r[3] for r in run_steps(steps, cpu))
    assert all(r[2] for r in run_steps(steps, cpu))
    assert torch.get_num_threads() == threads


@pytest.mark.parametrize("pattern_name", ["local", "block_random"])  # blocked's band and gather backward
def test_blocked_gradients_are_identical_run_to_run(pattern_name):
    """Threads finishing in another order must not change the sums: the gradients repeat bit for bit."""
    if torch.get_num_threads() < 2:
        pytest.skip("needs two torch threads for steps side by side")
    pattern = make_pattern(pattern_name, 1024, window=96, density=0.3, block_size=32, seed=1)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, 1024, 32, generator=gen) for _ in range(3))
    first = None
    for _ in range(4):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        grads = torch.autograd.grad(attention("blocked", *leaves, pattern).square().sum(), leaves)
        if first is None:
            first = grads
        else:
            assert all(torch.equal(a, b) for a, b in zip(first, grads, strict=True))


def test_in_order_admits_steps_in_index_order_and_passes_failed_turns_on():
    import threading
    import time

    from impls.common import InOrder

    in_order, seen = InOrder(), []

    def step(i: int) -> None:
        time.sleep(0.01 * (5 - i))  # later steps are ready first
        if i == 2:
            with in_order.turn(i):
                raise ValueError("planted")
        with in_order.turn(i):
            seen.append(i)

    errors = []

    def run(i: int) -> None:
        try:
            step(i)
        except ValueError as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads)
    assert seen == [0, 1, 3, 4] and len(errors) == 1
