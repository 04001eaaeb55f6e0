"""Score modifications (docs/DESIGN.md "Score modifications"): the built-ins against literal statements of their
papers' code, the oracle against a direct formula, every implementation against the oracle (output and
gradients) or a skip with its reason, the plugin path with attention-gym's score_mods, and bad input."""

from __future__ import annotations

import math
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton kernel on CPU tensors (before impls is imported)

import impls  # noqa: F401 - registers the implementations
from bench import registry
from bench.api import attention
from bench.cli import main
from bench.errors import Unavailable
from bench.measure.oracle.reference import compare, reference_attention, tolerance_for
from bench.patterns import alibi_slopes, make_pattern, make_score_mod, t5_bucket
from bench.spec.case import Case
from bench.spec.plugins import load_plugin
from tests.conftest import PLUGINS, ROOT, only_run_dir, read_jsonl, run_bench, write_suite

MODS = [("softcap", {"softcap": 2.0}), ("alibi", {}), ("relative_bias", {})]
# a shape with everything that moves positions: GQA, fewer query rows than keys, a partial last block
SHAPE = dict(heads=4, kv_heads=2, seq_len=96, q_len=80, head_dim=16, pattern="causal_local", window=40,
             block_size=32)


def press_get_slopes(n):
    """ofirpress/attention_with_linear_biases, models/transformer.py, as written there."""
    def get_slopes_power_of_2(n):
        start = (2 ** (-2 ** -(math.log2(n) - 3)))
        ratio = start
        return [start * ratio**i for i in range(n)]

    if math.log2(n).is_integer():
        return get_slopes_power_of_2(n)
    closest_power_of_2 = 2 ** math.floor(math.log2(n))
    return get_slopes_power_of_2(closest_power_of_2) + press_get_slopes(2 * closest_power_of_2)[0::2][
        : n - closest_power_of_2]


def hf_t5_bucket(relative_position, bidirectional=True, num_buckets=32, max_distance=128):
    """transformers' T5Attention._relative_position_bucket, as written there."""
    relative_buckets = 0
    if bidirectional:
        num_buckets //= 2
        relative_buckets += (relative_position > 0).to(torch.long) * num_buckets
        relative_position = torch.abs(relative_position)
    else:
        relative_position = -torch.min(relative_position, torch.zeros_like(relative_position))
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    relative_position_if_large = max_exact + (
        torch.log(relative_position.float() / max_exact) / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)).to(torch.long)
    relative_position_if_large = torch.min(relative_position_if_large,
                                           torch.full_like(relative_position_if_large, num_buckets - 1))
    relative_buckets += torch.where(is_small, relative_position, relative_position_if_large)
    return relative_buckets


@pytest.mark.parametrize("heads", [1, 6, 8, 12, 32, 40])
def test_alibi_slopes_are_press_et_al(heads):
    assert alibi_slopes(heads) == pytest.approx(press_get_slopes(heads), rel=1e-15)


def test_t5_buckets_are_t5s():
    rel = torch.arange(-600, 601)
    assert torch.equal(t5_bucket(rel), hf_t5_bucket(rel))


def load_agym_plugin() -> None:
    """suites/plugins/attn_gym_score_mods.py, as a suite loads it (agym_alibi, agym_softcap30)."""
    load_plugin("plugins/attn_gym_score_mods.py", base_dir=ROOT / "suites", file="test", field="plugins")


def _inputs(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    b, h, hkv, n, nq, d = 1, SHAPE["heads"], SHAPE["kv_heads"], SHAPE["seq_len"], SHAPE["q_len"], SHAPE["head_dim"]
    q = torch.randn(b, h, nq, d, generator=gen) * 2  # large logits: the modifications matter
    k = torch.randn(b, hkv, n, d, generator=gen) * 2
    v = torch.randn(b, hkv, n, d, generator=gen)
    return [t.to(dtype) for t in (q, k, v)]


def _pattern():
    return make_pattern(SHAPE["pattern"], SHAPE["seq_len"], q_len=SHAPE["q_len"], window=SHAPE["window"])


def _case(mod, **fields):
    return Case(**SHAPE, score_mod=mod, **fields)


@pytest.mark.parametrize("mod, fields", MODS)
def test_oracle_applies_the_formula_before_the_mask(mod, fields):
    q, k, v = (t.double() for t in _inputs())
    pattern, case = _pattern(), _case(mod, **fields)
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(2, dim=1)) / math.sqrt(SHAPE["head_dim"])
    i = torch.arange(SHAPE["seq_len"] - SHAPE["q_len"], SHAPE["seq_len"])[:, None]
    j = torch.arange(SHAPE["seq_len"])[None, :]
    h = torch.arange(SHAPE["heads"])[:, None, None]
    if mod == "softcap":
        scores = 2.0 * torch.tanh(scores / 2.0)
    elif mod == "alibi":
        slopes = torch.tensor(press_get_slopes(SHAPE["heads"]), dtype=torch.float32).double()
        scores = scores - slopes[h] * (i - j).abs()
    else:
        table = torch.randn(SHAPE["heads"], 32, generator=torch.Generator().manual_seed(case.seed)).double()
        scores = scores + table[h, hf_t5_bucket(j - i)]
    weights = torch.softmax(scores.masked_fill(~pattern.dense_mask(), -math.inf), dim=-1)
    expected = weights @ v.repeat_interleave(2, dim=1)
    got = reference_attention(q, k, v, pattern, score_mod=case.make_score_mod())
    assert torch.allclose(got, expected, atol=1e-12)
    assert not torch.allclose(got, reference_attention(q, k, v, pattern), atol=1e-3)  # it changed something


# (impl, mod) pairs that run on this machine; flex compiles once per modification (seconds each): one of each kind
RUNS = [(impl, mod) for impl in ("naive_loop", "dense", "sdpa", "csr", "blocked", "triton_block_sparse")
        for mod, _ in MODS if not (impl == "sdpa" and mod == "softcap")] + [("flex", "softcap"), ("flex", "alibi")]


@pytest.mark.parametrize("impl, mod", RUNS)
def test_forward_matches_the_oracle(impl, mod):
    fields = dict(MODS)[mod]
    q, k, v = _inputs()
    pattern = _pattern()
    out = attention(impl, q, k, v, pattern, score_mod=mod, block_size=SHAPE["block_size"], **fields)
    ref = reference_attention(q, k, v, pattern, score_mod=_case(mod, **fields).make_score_mod())
    stats = compare(out, ref, tolerance_for("float32"))
    assert stats.passed, (impl, mod, stats)


GRAD_RUNS = [(impl, mod) for impl in ("naive_loop", "dense", "sdpa", "csr", "triton_block_sparse")
             for mod, _ in MODS if not (impl == "sdpa" and mod == "softcap")]


@pytest.mark.parametrize("impl, mod", GRAD_RUNS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_match_the_oracle(impl, mod, dtype):
    if dtype == torch.bfloat16 and impl == "naive_loop":
        pytest.skip("the same torch ops as dense, slower")
    fields = dict(MODS)[mod]
    q, k, v = (t.requires_grad_() for t in _inputs(dtype))
    pattern = _pattern()
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*leaves, pattern, score_mod=_case(mod, **fields).make_score_mod())
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    expected = torch.autograd.grad(ref, leaves, g)
    out = attention(impl, q, k, v, pattern, score_mod=mod, block_size=SHAPE["block_size"], **fields)
    grads = torch.autograd.grad(out, (q, k, v), g.to(dtype))
    tol = tolerance_for(_case(mod).dtype if dtype == torch.float32 else "bfloat16")
    for name, got, want in zip(("dq", "dk", "dv"), grads, expected, strict=True):
        stats = compare(got, want, tol * (2 if dtype == torch.bfloat16 else 1))  # bf16 grads: 2x, as elsewhere
        assert stats.passed, (impl, mod, name, stats)


@pytest.mark.parametrize("impl, case, fragment", [
    ("sdpa", dict(score_mod="softcap", softcap=50.0), "softcap is a function of the score"),
    ("sdpa", dict(score_mod="agym_softcap30"), "custom score_mod"),
    ("csr", dict(score_mod="agym_alibi"), "does not apply custom score_mods"),
    ("blocked", dict(score_mod="alibi", mode="fwd_bwd"), "in its CPU kernel (inference in float32 and bfloat16)"),
    ("blocked", dict(score_mod="softcap", softcap=30.0, dtype="float16"), "torch-op steps"),
    ("cp_ring", dict(score_mod="alibi"), "cp_ring does not apply score_mod alibi"),
])
def test_implementations_that_do_not_apply_a_modification_say_why(impl, case, fragment):
    load_agym_plugin()

    reason = registry.get(impl).unsupported(Case(device="cpu", **case))
    assert reason is not None and fragment in reason, reason


def test_attention_gyms_alibi_through_the_plugin_equals_the_builtin():
    """attention-gym's ALiBi score_mod, registered by the plugin, on a causal square: the built-in's output."""
    load_agym_plugin()

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 8, 64, 16, generator=gen) * 2 for _ in range(3))
    pattern = make_pattern("causal", 64)
    builtin = reference_attention(q, k, v, pattern, score_mod=make_score_mod("alibi", heads=8, seq_len=64))
    custom_mod = Case(heads=8, seq_len=64, head_dim=16, pattern="causal", score_mod="agym_alibi").make_score_mod()
    assert torch.allclose(reference_attention(q, k, v, pattern, score_mod=custom_mod), builtin, atol=1e-6)
    for impl in ("dense", "naive_loop"):
        out = attention(impl, q, k, v, pattern, score_mod="agym_alibi")
        assert compare(out, builtin, 1e-4).passed, impl


def test_case_ids_without_a_modification_are_unchanged():
    # ids written before the field existed (computed by the previous Case)
    assert Case().case_id == "local_w64-n1024-b1h4d64-fp32-fwd-5e3d306d"
    assert Case(pattern="causal", seq_len=4096, heads=16, kv_heads=8, head_dim=256,
                dtype="bfloat16").case_id == "causal-n4096-b1h16kv8d256-bf16-fwd-4d513dea"
    assert Case(score_mod="softcap", softcap=50).case_id == Case(score_mod="softcap", softcap=50.0).case_id
    assert "-softcap50-" in Case(score_mod="softcap", softcap=50).case_id
    assert Case(score_mod="alibi").case_id != Case().case_id


def test_api_refuses_bad_modifications():
    q, k, v = _inputs()
    pattern = _pattern()
    for kwargs, fragment in [(dict(score_mod="softcap"), "needs `softcap`"),
                             (dict(score_mod="softcap", softcap=-1.0), "must be a finite number > 0"),
                             (dict(score_mod="alibi", softcap=5.0), "softcap is the cap of score_mod softcap"),
                             (dict(score_mod="nope"), "known score_mods: none, softcap"),
                             (dict(score_mod="alibi", windo=3), "unknown keyword(s) ['windo']")]:
        with pytest.raises(ValueError, match=None) as info:
            attention("dense", q, k, v, pattern, **kwargs)
        assert fragment in str(info.value), (kwargs, str(info.value))
    with pytest.raises(Unavailable, match="softcap is a function of the score"):
        attention("sdpa", q, k, v, pattern, score_mod="softcap", softcap=50.0)


BASE = {"name": "mods", "impls": ["dense"], "defaults": {"heads": 2, "head_dim": 16, "seq_len": 64},
        "measure": {"repeat": 3, "memory": "worker"}}


@pytest.mark.parametrize("defaults, field, fragment", [
    ({"score_mod": "softcap", "softcap": 0.0}, "defaults.softcap", "must be a finite number > 0"),
    ({"score_mod": "softcap"}, "softcap", "score_mod softcap needs `softcap`"),
    ({"softcap": 50.0}, "defaults.softcap", "set `score_mod: softcap` or drop `softcap`"),
    ({"score_mod": "tanh"}, "defaults.score_mod", "got 'tanh'; known score_mods: none, softcap, alibi"),
    ({"score_mod": "bad_raises"}, "defaults.score_mod",
     "score_mod bad_raises (plugin bad_score_mods.py) raised RuntimeError: planted failure"),
    ({"score_mod": "bad_not_tensor"}, "defaults.score_mod", "returned float"),
    ({"score_mod": "bad_factory"}, "defaults.score_mod", "its factory (plugin bad_score_mods.py) raised"),
    ({"score_mod": "alibi", "selector": "moba", "budget": 1}, "defaults.score_mod", "with selector 'moba'"),
])
def test_bad_modifications_exit_2_at_load(defaults, field, fragment, tmp_path, capsys):
    (tmp_path / "bad_score_mods.py").write_text((PLUGINS / "bad_score_mods.py").read_text())
    suite = {**BASE, "plugins": ["bad_score_mods.py"], "defaults": {**BASE["defaults"], **defaults}}
    path = write_suite(tmp_path, suite)
    code = main(["run", str(path), "--dry-run"])  # in this process: the command line's own handling
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and str(path) in err and field in err and fragment in err, err


def test_suite_run_with_plugin_and_a_late_failure(tmp_path):
    """A run over attention-gym's score_mods and a score_mod failing mid-run: the plugin's modification checked
    against the oracle on dense, a skip with the reason on csr, the failing one a failed record naming it, the
    built-in softcap case after it still measured, exit 1."""
    (tmp_path / "bad_score_mods.py").write_text((PLUGINS / "bad_score_mods.py").read_text())
    suite = {**BASE, "impls": ["dense", "csr"],
             "plugins": [str(ROOT / "suites" / "plugins" / "attn_gym_score_mods.py"), "bad_score_mods.py"],
             "defaults": {**BASE["defaults"], "pattern": "causal"},
             "sweeps": [{"sweep": {"score_mod": ["agym_softcap30", "bad_late"]}},
                        {"defaults": {"score_mod": "softcap", "softcap": 5.0}}]}
    path = write_suite(tmp_path, suite)
    proc = run_bench("run", str(path), "--out", str(tmp_path / "results"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    records = {(r["params"]["score_mod"], r["impl"]): r for r in
               read_jsonl(only_run_dir(tmp_path / "results") / "records.jsonl")}
    assert len(records) == 6
    assert records["agym_softcap30", "dense"]["status"] == "ok"
    assert records["agym_softcap30", "dense"]["error"]["rel_l2"] < 1e-4
    assert records["agym_softcap30", "csr"]["status"] == "skipped"
    assert "custom score_mods" in records["agym_softcap30", "csr"]["reason"]
    assert records["bad_late", "dense"]["status"] == "failed"
    assert "score_mod bad_late (plugin bad_score_mods.py) raised RuntimeError: planted late failure" in \
        records["bad_late", "dense"]["reason"]
    assert records["softcap", "dense"]["status"] == records["softcap", "csr"]["status"] == "ok"
    assert records["softcap", "csr"]["params"]["softcap"] == 5.0
    assert records["softcap", "csr"]["flops"] == records["agym_softcap30", "dense"]["flops"]  # useful FLOPs


def test_distributed_implementations_apply_them_at_each_ranks_positions(tmp_path):
    """Two gloo ranks, zigzag chunks (each rank's positions are two separate ranges) and contiguous ones (tp_heads:
    each rank its own heads), ALiBi (which depends on i - j and the head): outputs and gradients against the
    single-process oracle; cp_ring says why not."""
    suite = {"name": "dist", "impls": ["tp_heads", "cp_allgather", "cp_sparse", "cp_ulysses", "cp_ring"],
             "defaults": {"heads": 4, "kv_heads": 2, "head_dim": 16, "seq_len": 64, "pattern": "causal_local",
                          "window": 24, "block_size": 16, "world_size": 2, "mode": "fwd_bwd", "score_mod": "alibi",
                          "device": "cpu"},
             "sweep": {"cp_layout": ["zigzag", "contiguous"]},
             "measure": {"repeat": 2, "warmup": 0, "memory": "worker"}}
    proc = run_bench("run", str(write_suite(tmp_path, suite)), "--out", str(tmp_path / "results"))
    records = {(r["impl"], r["params"]["cp_layout"]): r
               for r in read_jsonl(only_run_dir(tmp_path / "results") / "records.jsonl")}
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    ran = [("tp_heads", "contiguous")] + [(impl, layout) for impl in ("cp_allgather", "cp_sparse", "cp_ulysses")
                                          for layout in ("zigzag", "contiguous")]
    for key in ran:
        assert records[key]["status"] == "ok", (key, records[key]["reason"])
        assert set(records[key]["error"]["grads"]) == {"dq", "dk", "dv"}
    assert records["cp_ring", "zigzag"]["status"] == "skipped"
    assert "cp_ring does not apply score_mod alibi" in records["cp_ring", "zigzag"]["reason"]
