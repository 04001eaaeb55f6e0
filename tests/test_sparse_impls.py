"""`blocked` and `csr` at the edges the conformance shapes do not reach: block sizes from 1 to larger than
N, windows wider than the sequence, a single token, rows with no allowed key, decode and query chunks, packed
documents, grouped-query attention; forward with and without autograd, and gradients, against the float64
oracle."""

from __future__ import annotations

import itertools

import pytest
import torch

from bench.api import attention
from bench.measure.oracle.reference import compare, reference_attention
from bench.patterns import Local, make_pattern
from tests import pattern_zoo

TOL = 1e-4  # float32


class LocalWithHoles(Local):
    """Local, but every third query row attends to nothing (its output and gradient must be zero)."""

    name = "local_with_holes"

    def allowed(self, i, j):
        return super().allowed(i, j) & (i % 3 != 0)


def _pattern(name: str, n: int, block_size: int, window: int):
    if name == LocalWithHoles.name:
        return LocalWithHoles(n, window=window, block_size=block_size)
    # built-in patterns only (test modules may register custom ones), with fields valid at n (axial's and
    # neighborhood's image shapes)
    return make_pattern(name, n, **pattern_zoo.valid_fields(name, n, window=window, block_size=block_size,
                                                             global_tokens=2, seed=5))


CASES = list(itertools.product([*pattern_zoo.BUILTIN, LocalWithHoles.name], [1, 37], [1, 8, 64], [4, 200]))


def _failures(impl: str, pattern, gen: torch.Generator, heads: int = 2, kv_heads: int = 2) -> list[str]:
    """Forward (with and without autograd) and dq, dk, dv of `impl` against the oracle: what failed."""
    q = torch.randn(1, heads, pattern.q_len, 8, generator=gen).requires_grad_()
    k, v = (torch.randn(1, kv_heads, pattern.seq_len, 8, generator=gen).requires_grad_() for _ in range(2))
    out = attention(impl, q, k, v, pattern)
    grad_out = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad(out, (q, k, v), grad_out, allow_unused=True)
    with torch.no_grad():
        out_inference = attention(impl, q, k, v, pattern)  # the no-autograd path
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected = reference_attention(*leaves, pattern)
    expected_grads = torch.autograd.grad(expected, leaves, grad_out.double(), allow_unused=True)
    checks = {"out": (out, expected), "out (no grad)": (out_inference, expected)}
    for label, got, want, leaf in zip(("dq", "dk", "dv"), grads, expected_grads, leaves, strict=True):
        want = torch.zeros_like(leaf) if want is None else want
        checks[label] = (torch.zeros_like(want) if got is None else got, want)
    failures = []
    for label, (got, want) in checks.items():
        stats = compare(got, want, TOL) if got.shape == want.shape else None
        if stats is None or not stats.passed:
            failures.append(f"{pattern!r} block_size={pattern.block_size} heads={heads}/{kv_heads} {label}: "
                            + (f"rel_l2 {stats.rel_l2}" if stats else f"shape {tuple(got.shape)}"))
    return failures


@pytest.mark.parametrize("impl", ["blocked", "csr"])
def test_edges_against_the_oracle(impl):
    failures = []
    gen = torch.Generator().manual_seed(0)
    for name, n, block_size, window in CASES:
        failures += _failures(impl, _pattern(name, n, block_size, window), gen)
    assert not failures, "\n".join(failures)


def _pattern_with(name: str, n: int, block_size: int, window: int, **structure):
    if name == LocalWithHoles.name:
        return LocalWithHoles(n, window=window, block_size=block_size, **structure)
    fields = pattern_zoo.valid_fields(name, n, window=window, block_size=block_size, global_tokens=2, seed=5)
    return make_pattern(name, n, **structure, **fields)


# Decode, a chunk that is not a multiple of the block, and a chunk over packed documents (one of length 1),
# with grouped-query attention (two query heads per KV head) and one KV head for three query heads.
STRUCTURES = [({"q_len": 1}, 4, 2), ({"q_len": 20}, 3, 1), ({"q_len": 20, "documents": [1, 15, 21]}, 4, 2)]
SHAPED_CASES = list(itertools.product([*pattern_zoo.BUILTIN, LocalWithHoles.name], [1, 8, 64], [4, 200],
                                      range(len(STRUCTURES))))


@pytest.mark.parametrize("impl", ["blocked", "csr"])
def test_edges_with_query_chunks_documents_and_kv_groups(impl):
    failures = []
    gen = torch.Generator().manual_seed(0)
    for name, block_size, window, s in SHAPED_CASES:
        structure, heads, kv_heads = STRUCTURES[s]
        if "documents" in structure and name in ("axial", "neighborhood"):
            continue  # their image shapes do not divide these documents
        pattern = _pattern_with(name, 37, block_size, window, **structure)
        failures += _failures(impl, pattern, gen, heads, kv_heads)
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


def _blocked_extras(pattern, heads: int = 2, kv_heads: int = 1) -> dict:
    """The plan `blocked` reports, in fwd_bwd (in fwd, inference may go to its CPU kernel instead)."""
    from bench import registry
    from bench.api import case_for

    q = torch.zeros(1, heads, pattern.q_len, 8)
    k = v = torch.zeros(1, kv_heads, pattern.seq_len, 8)
    impl = registry.get("blocked")
    impl.prepare(case_for(q, pattern, "fwd_bwd", k=k), pattern, q, k, v)
    return impl.record_extras()


@pytest.mark.parametrize("name, fields, path", [
    ("local", {"window": 256}, "band"),
    ("dilated", {"window": 256, "dilation": 3}, "band"),  # sparse inside, but every block of the band is used
    ("causal_local", {"window": 512, "q_len": 1000}, "band"),
    ("neighborhood", {"window": 7, "image_width": 64}, "gather"),  # band of 13 image rows, keys in 7 of them
    ("causal_local", {"window": 1024, "documents": 8}, "gather"),  # windows cut by the documents
])
def test_blocked_takes_the_band_plan_only_where_the_band_is_not_much_sparser_than_its_blocks(name, fields, path):
    pattern = make_pattern(name, 4096, block_size=64, **fields)
    assert _blocked_extras(pattern)["path"] == path


def test_blocked_reports_computed_pairs_per_query_head_of_the_chunk():
    # causal_local W=4 (band 0..3) over the last 3 of 10 positions, blocks of 2 query rows: 2 blocks of
    # 2 rows (the last padded), each against a window of 2 + 3 = 5 keys -> 20 products per query head for
    # 4 + 4 + 4 allowed pairs
    pattern = make_pattern("causal_local", 10, q_len=3, window=4, block_size=2)
    extras = _blocked_extras(pattern, heads=4, kv_heads=2)
    assert (extras["path"], extras["group_size"], extras["computed_pairs_per_head"]) == ("band", 2, 20)
    assert pattern.nnz == 12 and extras["computed_over_allowed"] == pytest.approx(20 / 12)
