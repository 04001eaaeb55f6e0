"""Learned attention sinks (docs/DESIGN.md "Round 5", sinks): one logit per query head joins every row's softmax
with a zero value vector. The oracle against a literal softmax over the keys plus one sink column; dense and sdpa
against the oracle, forward and backward, with GQA, odd lengths, q_len 1, packed documents and a selection; an
implementation without a log-sum-exp skips with that reason; bad sinks are refused naming the field."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from bench import api, registry
from bench.errors import BadInput, Unavailable
from bench.measure.oracle.reference import reference_attention, reference_attention_lse
from bench.patterns import make_pattern
from bench.selection import Selection, effective_mask
from bench.spec.case import Case
from bench.spec.suite import parse_suite

# (id, pattern, seq_len, q_len, heads, kv_heads, documents)
SHAPES = [
    ("gqa_causal_odd", "causal", 37, 37, 4, 2, None),
    ("decode_q1", "causal", 45, 1, 6, 3, None),
    ("local_q_shorter", "causal_local", 50, 19, 2, 1, None),
    ("documents", "causal", 40, 40, 4, 4, (15, 25)),
]


def inputs(heads: int, kv_heads: int, seq_len: int, q_len: int, d: int = 16, seed: int = 0, grad: bool = False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, q_len, d, generator=gen)
    k = torch.randn(2, kv_heads, seq_len, d, generator=gen)
    v = torch.randn(2, kv_heads, seq_len, d, generator=gen)
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


def graded_sinks(heads: int) -> list[float]:
    """One sink logit per head, from below to above the scores' typical log-sum-exp."""
    return [0.3 * i - 1.0 for i in range(heads)]


def literal(q, k, v, pattern, sinks):
    """Row by row in float64: softmax over the allowed keys' scaled scores and one more logit, the head's sink,
    whose value vector is zero."""
    b, h, nq, d = q.shape
    group = h // k.shape[1]
    mask = pattern.dense_mask()
    out = torch.zeros(b, h, nq, d, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            for r in range(nq):
                keys = mask[r].nonzero().flatten()
                logits = (k[bi, hi // group, keys].double() @ q[bi, hi, r].double()) / math.sqrt(d)
                weights = torch.softmax(torch.cat([logits, sinks[hi : hi + 1].double()]), dim=0)
                out[bi, hi, r] = weights[:-1] @ v[bi, hi // group, keys].double()
    return out


@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_oracle_is_a_softmax_with_one_more_logit(shape) -> None:
    _, name, n, nq, h, hkv, docs = shape
    q, k, v = inputs(h, hkv, n, nq)
    pattern = make_pattern(name, n, q_len=nq, documents=docs, window=8)
    sinks = torch.linspace(-2.0, 3.0, h, dtype=torch.float64)
    expected = literal(q, k, v, pattern, sinks)
    torch.testing.assert_close(reference_attention(q, k, v, pattern, sinks=sinks), expected, rtol=1e-12, atol=1e-12)
    # the log-sum-exp stays the row's own: sinks change only the output
    _, lse = reference_attention_lse(q, k, v, pattern, sinks=sinks)
    _, lse_plain = reference_attention_lse(q, k, v, pattern)
    assert torch.equal(lse, lse_plain)


def test_learned_sinks_are_seeded_per_head() -> None:
    a, b = Case(heads=6, sinks="learned", seed=3), Case(heads=6, sinks="learned", seed=4)
    assert a.sink_logits().shape == (6,) and torch.equal(a.sink_logits(), a.sink_logits())
    assert not torch.equal(a.sink_logits(), b.sink_logits())
    assert Case(heads=2, sinks=[0.5, -1]).sink_logits().tolist() == [0.5, -1.0]
    assert "sinks" in Case(sinks="learned").case_id and "sinks" not in Case().case_id


@pytest.mark.parametrize("impl", ["dense", "sdpa"])
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_implementations_apply_sinks_forward_and_backward(impl: str, shape) -> None:
    _, name, n, nq, h, hkv, docs = shape
    q, k, v = inputs(h, hkv, n, nq, grad=True)
    pattern = make_pattern(name, n, q_len=nq, documents=docs, window=8)
    sinks = graded_sinks(h)
    out = api.attention(impl, q, k, v, pattern, sinks=sinks)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    expected = reference_attention(q64, k64, v64, pattern, sinks=torch.tensor(sinks, dtype=torch.float64))
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-5)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    want = torch.autograd.grad(expected, (q64, k64, v64), g.double())
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), e, rtol=1e-4, atol=1e-5)
    # the sinks matter: without them the output is another one
    assert not torch.allclose(api.attention(impl, q, k, v, pattern).detach(), out.detach(), atol=1e-3)


# Inference only, through a kernel's log-sum-exp: blocked's block kernel (its decode kernel at q_len 1), whose torch-op
# steps keep none, and the Triton forward kernel's base-2 one (on CPU in the Triton interpreter), whose backward
# kernels take no gradient of it; each refuses a backward with that reason.
INFERENCE_ONLY = {"blocked": "torch-op steps for a static pattern keep none", "triton_block_sparse": "inference only"}


@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("impl", INFERENCE_ONLY)
def test_kernels_apply_sinks_in_inference_and_refuse_a_backward(impl: str, shape) -> None:
    if impl == "triton_block_sparse" and importlib.util.find_spec("triton") is None:  # not imported here: the
        pytest.skip("triton is not installed")  # implementation sets its interpreter up before triton loads
    _, name, n, nq, h, hkv, docs = shape
    q, k, v = inputs(h, hkv, n, nq)
    pattern = make_pattern(name, n, q_len=nq, documents=docs, window=8)
    sinks = graded_sinks(h)
    out = api.attention(impl, q, k, v, pattern, sinks=sinks, block_size=16)
    expected = reference_attention(q, k, v, pattern, sinks=torch.tensor(sinks, dtype=torch.float64))
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-5)
    with pytest.raises(Unavailable, match=INFERENCE_ONLY[impl]):
        api.attention(impl, *(t.requires_grad_() for t in (q, k, v)), pattern, sinks=sinks, block_size=16)


@pytest.mark.parametrize("impl", ["dense", "sdpa", "blocked"])
def test_sinks_over_a_selection(impl: str) -> None:
    h, hkv, n = 4, 2, 48
    q, k, v = inputs(h, hkv, n, n)
    pattern = make_pattern("causal", n)
    gen = torch.Generator().manual_seed(1)
    indices = torch.stack([torch.randperm(3, generator=gen)[:2] for _ in range(n)]).to(torch.int32)
    indices = indices[None, None].expand(2, hkv, n, 2).contiguous()  # per row and KV group, 2 of 3 blocks of 16
    selection = Selection(indices, 1, 16, "kv_group")
    sinks = torch.tensor([1.0, -0.5, 0.0, 2.0], dtype=torch.float64)
    out = api.attention(impl, q, k, v, pattern, selection, sinks=sinks.tolist(), block_size=16)

    def chosen(rows):
        return effective_mask(selection, pattern, rows, h, hkv)

    expected, _ = reference_attention_lse(q, k, v, pattern, extra_mask=chosen, sinks=sinks)
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-5)
    # and backward (blocked: its gathered steps, whose log-sum-exp is differentiable)
    leaves = tuple(t.clone().requires_grad_() for t in (q, k, v))
    out = api.attention(impl, *leaves, pattern, selection, sinks=sinks.tolist(), block_size=16)
    g = torch.randn_like(out)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in leaves)
    expected, _ = reference_attention_lse(q64, k64, v64, pattern, extra_mask=chosen, sinks=sinks)
    got = torch.autograd.grad(out, leaves, g)
    want = torch.autograd.grad(expected, (q64, k64, v64), g.double())
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), e, rtol=1e-4, atol=1e-5)


def test_an_implementation_without_a_log_sum_exp_skips_with_the_reason() -> None:
    q, k, v = inputs(2, 2, 32, 32)
    with pytest.raises(Unavailable, match=r"does not apply learned sinks.*log-sum-exp"):
        api.attention("csr", q, k, v, make_pattern("causal", 32), sinks="learned")
    case = Case(heads=2, seq_len=32, pattern="causal", sinks="learned", device="cpu")
    assert registry.get("dense").unsupported(case) is None
    assert "log-sum-exp" in (registry.get("naive_loop").unsupported(case) or "")


def test_bad_sinks_are_refused_naming_the_field() -> None:
    q, k, v = inputs(4, 2, 16, 16)
    with pytest.raises(ValueError, match="3 sink logits with heads 4"):
        api.attention("dense", q, k, v, make_pattern("causal", 16), sinks=[0.0, 1.0, 2.0])
    suite = {"name": "s", "impls": ["dense"], "defaults": {"heads": 4, "seq_len": 64, "sinks": [1.0, 2.0]},
             "sweeps": [{"sweep": {"pattern": ["causal"]}}]}
    with pytest.raises(BadInput, match="sinks"):
        parse_suite(suite, file="<dict>")
    suite["defaults"]["sinks"] = "yes"
    with pytest.raises(BadInput, match="sinks"):
        parse_suite(suite, file="<dict>")


def test_a_suite_with_sinks_checks_every_timed_call_and_skips_the_others(tmp_path) -> None:
    """Through the harness: the first call's and the timed calls' outputs against the oracle with the sinks (a
    harness that forgot them would find dense `incorrect`), csr skipped with the reason."""
    suite = {"name": "sinks", "impls": ["dense", "sdpa", "csr"],
             "defaults": {"heads": 4, "kv_heads": 2, "head_dim": 16, "seq_len": 96, "pattern": "causal",
                          "sinks": "learned", "device": "cpu"},
             "sweep": {"mode": ["fwd", "fwd_bwd"]},
             "measure": {"warmup": 0, "repeat": 3, "max_time_s": 0.01, "memory": "worker"}}
    records = {(r.impl, r.params["mode"]): r for r in api.run(suite, tmp_path / "results", quiet=True)}
    for impl in ("dense", "sdpa"):
        for mode in ("fwd", "fwd_bwd"):
            r = records[impl, mode]
            assert r.status == "ok", (impl, mode, r.reason)
            assert r.timing is not None and r.timing.checked_calls >= 2 and r.params["sinks"] == "learned"
            assert "-sinks-" in r.case_id
    assert records["csr", "fwd"].status == "skipped" and "log-sum-exp" in (records["csr", "fwd"].reason or "")


def test_attention_takes_a_selector_by_name_with_its_budget_and_sinks() -> None:
    """`bench.api.attention(impl, q, k, v, pattern, "msa", budget=2, sinks=...)`: the selector runs on the caller's
    tensors; the output equals the oracle under that selection with the sinks; a missing budget names it."""
    h, hkv, n = 4, 2, 64
    q, k, v = inputs(h, hkv, n, n)
    pattern = make_pattern("causal", n)
    out = api.attention("sdpa", q, k, v, pattern, "msa", budget=2, block_size=16, sinks="learned")
    case = Case(batch=2, heads=h, kv_heads=hkv, head_dim=16, seq_len=n, pattern="causal", block_size=16,
                selector="msa", budget=2, sinks="learned")
    chosen = api.select("msa", q, k, case)

    def rows_mask(rows):
        return effective_mask(chosen, pattern, rows, h, hkv)

    expected, _ = reference_attention_lse(q, k, v, pattern, extra_mask=rows_mask, sinks=case.sink_logits())
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="selector 'msa' keeps a budget: give budget="):
        api.attention("sdpa", q, k, v, pattern, "msa", block_size=16)
    with pytest.raises(ValueError, match="unknown selector 'nosuch'"):
        api.attention("sdpa", q, k, v, pattern, "nosuch", budget=2)
