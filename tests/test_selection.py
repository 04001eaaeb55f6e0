"""Selections: every implementation that takes them against the float64 oracle under the effective mask, the
harness's three timings and fidelity, and the messages of bad selections and bad selection fields."""

from __future__ import annotations

import math

import pytest
import torch

from bench import api
from bench.cli import main
from bench.measure.oracle.fidelity import fidelity
from bench.measure.oracle.reference import reference_attention_lse
from bench.selection import Selection, SelectionError, effective_mask, get_selector, run_selector
from bench.spec.case import Case
from bench.spec.plugins import load_plugin
from tests.conftest import PLUGINS, write_suite

load_plugin(str(PLUGINS / "selectors.py"), base_dir=None, file="test", field="plugins")

IMPLS = ["dense", "sdpa", "naive_loop", "csr", "blocked", "flex"]
SELECTORS = ["test_blocks", "test_rows", "test_tokens", "test_pages", "test_row_heads"]
SHAPES = {  # (pattern, seq_len, q_len, heads, kv_heads)
    "causal-odd": ("causal", 200, None, 4, 2),
    "local-chunk": ("causal_local", 160, 40, 4, 1),
    "decode": ("causal", 130, 1, 4, 4),
}


def _case(shape: str, selector: str, dtype: str = "float32") -> Case:
    pattern, n, q_len, heads, kv_heads = SHAPES[shape]
    return Case(batch=2, heads=heads, kv_heads=kv_heads, head_dim=32, seq_len=n, q_len=q_len, pattern=pattern,
                window=48, block_size=32, dtype=dtype, device="cpu", selector=selector, budget=0.5, seed=3)


def _inputs(case: Case, grad: bool = False):
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(s, generator=gen).to(case.torch_dtype) for s in (case.q_shape(), case.kv_shape(),
                                                                           case.kv_shape()))
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("selector", SELECTORS)
@pytest.mark.parametrize("impl", IMPLS)
def test_attention_over_a_selection_matches_the_oracle(impl, selector, shape):
    case = _case(shape, selector)
    pattern = case.make_pattern()
    q, k, v = _inputs(case)
    chosen = api.select(selector, q, k, case)
    info = get_selector(selector)
    try:
        out = api.attention(impl, q, k, v, pattern, chosen, block_size=case.block_size)
    except api.Unavailable as exc:
        # blocked takes key blocks only; flex on CPU block selections per query block only (Inductor's template)
        assert (impl == "blocked" and info.kv_unit != "block") or (
            impl == "flex" and (info.q_unit, info.kv_unit) != ("block", "block")), exc.reason
        return

    def extra(rows):
        return effective_mask(chosen, pattern, rows, case.heads, case.n_kv_heads)

    expected, _ = reference_attention_lse(q, k, v, pattern, extra_mask=extra)
    err = float((out.double() - expected).norm() / expected.norm().clamp_min(1e-30))
    assert err < 1e-4, f"{impl} {selector} {shape}: rel_l2 {err:.3g}"


@pytest.mark.parametrize("impl", ["dense", "csr", "naive_loop", "blocked", "sdpa"])
def test_gradients_over_a_selection_match_the_oracle(impl):
    case = _case("causal-odd", "test_rows")
    pattern = case.make_pattern()
    q, k, v = _inputs(case, grad=True)
    chosen = api.select("test_rows", q, k, case)
    out = api.attention(impl, q, k, v, pattern, chosen, block_size=case.block_size)
    grad = torch.randn_like(out)
    ours = torch.autograd.grad(out, (q, k, v), grad)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = reference_attention_lse(q64, k64, v64, pattern, extra_mask=lambda r: effective_mask(
        chosen, pattern, r, case.heads, case.n_kv_heads))
    theirs = torch.autograd.grad(ref, (q64, k64, v64), grad.double())
    for name, a, b in zip("qkv", ours, theirs, strict=True):
        assert float((a.double() - b).norm() / b.norm()) < 1e-4, f"d{name}"


@pytest.mark.parametrize("impl", ["dense", "blocked"])  # flex returns no lse on CPU (Inductor's CPU template)
def test_the_log_sum_exp_of_rows_with_and_without_keys(impl):
    case = _case("local-chunk", "test_blocks")
    pattern = case.make_pattern()
    q, k, v = _inputs(case)
    chosen = api.select("test_blocks", q, k, case)
    chosen.indices[0, 0, 0] = -1  # the first query block of one head keeps nothing: its rows have no key
    from bench.registry import get

    attend = get(impl).prepare_selected(case, pattern.fresh(), q, k, v)
    out, lse = attend(chosen)
    _, expected_lse = reference_attention_lse(q, k, v, pattern, extra_mask=lambda r: effective_mask(
        chosen, pattern, r, case.heads, case.n_kv_heads))
    empty = torch.isinf(expected_lse)
    assert bool(empty[0, 0, :32].all()) and torch.equal(torch.isinf(lse), empty)
    assert float((lse.double() - expected_lse)[~empty].abs().max()) < 1e-4
    assert float(out[0, 0, :32].abs().max()) == 0.0


def test_bad_selections_name_the_first_bad_index():
    case = _case("causal-odd", "bad_range")
    q, k, _ = _inputs(case)
    for name, words in [("bad_range", ["index 10000 at [0, 1, 2, 0]", "out of range"]),
                        ("bad_duplicate", ["appears twice"]), ("bad_shape", ["shape", "expected"])]:
        chosen = run_selector(get_selector(name), q, k, case)
        with pytest.raises(SelectionError) as err:
            chosen.validate(case.batch, case.heads, case.n_kv_heads, case.n_queries, case.seq_len)
        assert all(w in str(err.value) for w in words), str(err.value)


def test_fidelity_holds_its_laws():
    case = Case(batch=1, heads=4, kv_heads=2, head_dim=32, seq_len=512, pattern="causal", block_size=32,
                device="cpu", inputs="structured", selector="test_rows", budget=0.25, seed=2)
    from bench.measure.case.steps import make_inputs

    made = make_inputs(case)
    pattern = case.make_pattern()
    chosen = api.select("test_rows", made.q, made.k, case)
    fid = fidelity(chosen, pattern, made, case.seed)
    assert fid.oracle_recall.mean >= fid.recall.mean - 1e-12
    assert fid.needles_found is not None and 0.0 <= fid.needles_found <= 1.0
    # the LSE gap equals -log(recall), row by row
    _, dense_lse = reference_attention_lse(made.q, made.k, made.v, pattern)
    _, chosen_lse = reference_attention_lse(made.q, made.k, made.v, pattern, extra_mask=lambda r: effective_mask(
        chosen, pattern, r, case.heads, case.n_kv_heads))
    from bench.measure.oracle.reference import reference_weights

    weights = torch.cat([w for _, w in reference_weights(made.q, made.k, pattern)], dim=2)
    mask = effective_mask(chosen, pattern, torch.arange(512), case.heads, case.n_kv_heads)
    recall = (weights * mask).sum(-1)
    finite = torch.isfinite(chosen_lse)
    assert torch.allclose(dense_lse[finite] - chosen_lse[finite], -torch.log(recall[finite]), atol=1e-9)
    if bool((recall[finite.expand_as(recall)] == 0).any()) or not bool(finite.all()):
        assert fid.lse_gap.max == float("inf")  # a row whose selection kept none of its mass
    else:
        assert math.isclose(fid.lse_gap.mean, float(-torch.log(recall).mean()), rel_tol=1e-6)
    # everything the base allows: dense attention itself
    full = Selection(torch.arange(16, dtype=torch.int32).expand(1, 2, 512, 16).contiguous(), 1, 32, "kv_group")
    everything = fidelity(full, pattern, made, case.seed)
    assert everything.recall.min == pytest.approx(1.0) and everything.cosine.min == pytest.approx(1.0)
    assert everything.oracle_recall.min == pytest.approx(1.0) and everything.output_rel_l2 < 1e-12


def _suite(tmp_path, **changes):
    suite = {"name": "sel", "impls": ["dense", "blocked", "csr"], "plugins": [str(PLUGINS / "selectors.py")],
             "defaults": {"heads": 4, "kv_heads": 2, "head_dim": 32, "seq_len": 256, "pattern": "causal",
                          "block_size": 32, "inputs": "structured"},
             "sweep": {"selector": ["test_rows", "oracle_topk", "bad_duplicate", "test_tokens"], "budget": [3]},
             "measure": {"repeat": 2, "warmup": 0, "max_time_s": 0.1, "memory": "worker"}}
    for key, value in changes.items():
        suite[key] = value
    return write_suite(tmp_path, suite)


def test_a_selection_suite_records_three_times_fidelity_and_failures(tmp_path):
    records = api.run(_suite(tmp_path), out=tmp_path / "results", quiet=True)
    by = {(r.params["selector"], r.impl): r for r in records}
    assert len(records) == 12
    for (selector, impl), r in by.items():
        if selector == "bad_duplicate":
            assert r.status == "failed" and "appears twice" in r.reason and "bad_duplicate" in r.reason
        else:
            assert r.status == "ok", (selector, impl, r.reason)
            s = r.selection
            assert s.selector == selector and s.time_s.n >= 1 and s.attention_time_s.n >= 1 and r.time_s.n >= 1
            assert s.units_mean <= 3
            # a reference selector's single calls make no share; every other selector's is its median's
            assert (s.share is None and "reference selector" in s.share_note) if s.reference else s.share > 0
            assert r.fidelity.oracle_recall.mean >= r.fidelity.recall.mean - 1e-12
            assert r.error.rel_l2 < 1e-4 and r.fidelity.needles_found is not None
    assert by[("oracle_topk", "dense")].selection.reference and by[("oracle_topk", "dense")].time_s.n == 1
    assert by[("oracle_topk", "dense")].fidelity.recall.mean == pytest.approx(
        by[("oracle_topk", "dense")].fidelity.oracle_recall.mean)
    assert by[("test_rows", "blocked")].config["path"] == "kernel_selected"
    assert by[("test_tokens", "blocked")].config["path"] == "token_rows"  # tokens in inference: impls/blocked/tokens.py
    # which code ran the block kernel's products, said only where the block kernel ran
    assert by[("test_rows", "blocked")].config["products"] in ("dot_tiles", "onednn_brgemm", "onednn_brgemm_widened")
    assert "products" not in by[("test_tokens", "blocked")].config


@pytest.mark.parametrize("change, words", [
    ({"sweep": {"selector": ["moba_typo"], "budget": [2]}}, ["sweep.selector[0]", "known selectors", "oracle_topk"]),
    ({"sweep": {"selector": ["oracle_topk"], "budget": [50]}}, ["sweep.budget[0]", "at most 8", "allowed budget"]),
    ({"sweep": {"budget": [2]}}, ["sweep.budget[0]", "no selector"]),
    ({"sweep": {"selector": ["oracle_topp"]}}, ["threshold"]),
    ({"sweep": {"selector": ["oracle_topk"]}}, ["budget"]),
    ({"sweep": {"selector": ["oracle_topk"], "budget": [1.5]}}, ["sweep.budget[0]"]),
])
def test_bad_selection_fields_exit_2(tmp_path, capsys, change, words):
    assert main(["run", str(_suite(tmp_path, **change)), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err


def test_oracle_topk_is_the_best_block_selection():
    case = Case(batch=1, heads=2, head_dim=32, seq_len=256, pattern="causal", block_size=32, device="cpu",
                inputs="structured", selector="oracle_topk", budget=2)
    from bench.measure.case.steps import make_inputs

    made = make_inputs(case)
    pattern = case.make_pattern()
    best = api.select("oracle_topk", made.q, made.k, case)
    other = api.select("test_blocks", made.q, made.k, Case(**{**case.params(), "selector": "test_blocks"}))
    assert fidelity(best, pattern, made, 0).recall.mean >= fidelity(other, pattern, made, 0).recall.mean


@pytest.mark.parametrize("row_tile", [1, 4, 16])
@pytest.mark.parametrize("selector", ["test_rows", "test_row_heads"])
def test_blocked_row_tables_at_every_tile_height(selector: str, row_tile: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """blocked's kernel over per-row selections, a tile of 1, 4 or 16 rows (the union of the rows' blocks with a
    bit per row, or each row alone), matches the oracle; a block the base pattern does not allow the row (a
    future block under causal, as a user's selection may hold) is dropped, not attended."""
    import impls.blocked.selected as selected

    monkeypatch.setattr(selected, "ROW_TILE", row_tile)
    case = _case("causal-odd", selector)
    pattern = case.make_pattern()
    q, k, v = _inputs(case)
    chosen = api.select(selector, q, k, case)
    last = -(-case.seq_len // case.block_size) - 1
    assert last not in chosen.indices[0, 0, 0].tolist()  # row 0 may see block 0 only
    chosen.indices[0, 0, 0, -1] = last
    out = api.attention("blocked", q, k, v, pattern, chosen, block_size=case.block_size)
    expected, _ = reference_attention_lse(q, k, v, pattern, extra_mask=lambda r: effective_mask(
        chosen, pattern, r, case.heads, case.n_kv_heads))
    assert float((out.double() - expected).norm() / expected.norm()) < 1e-4


@pytest.mark.parametrize("selector", ["test_rows", "test_row_heads"])
def test_blocked_selections_past_the_cache_pack_blocks_as_tasks_need_them(selector: str,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the threads' L2 blocked's kernel packs each block where a task first needs it, and a selection's tasks
    (a table per head, the query heads of a KV head on its packed blocks) must each find every block they read
    packed: one thread, N taken past that core's L2 for the packed copy and the output, against the oracle."""
    import impls.blocked as blocked
    from impls.blocked import kernel

    if kernel.unavailable_reason(torch.zeros(1, 1, 16, 64), 64) is not None:
        pytest.skip("blocked's CPU kernel does not run here")
    calls = []
    monkeypatch.setattr(blocked, "kernel_attention_tables",
                        lambda *args: calls.append(args[-1]) or kernel.kernel_attention_tables(*args))  # heads_per_kv
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cache = kernel.kernel_module().cache_bytes()
        heads, kv_heads, head_dim = 4, 2, 64
        n = (cache // (heads * head_dim * 4) // 64 + 1) * 64 + 24
        assert 2 * kv_heads * n * head_dim * 4 > cache  # the packed K and V of both KV heads
        case = Case(batch=1, heads=heads, kv_heads=kv_heads, head_dim=head_dim, seq_len=n, pattern="causal",
                    block_size=64, dtype="float32", device="cpu", selector=selector, budget=0.25, seed=3)
        pattern = case.make_pattern()
        q, k, v = _inputs(case)
        chosen = api.select(selector, q, k, case)
        out = api.attention("blocked", q, k, v, pattern, chosen, block_size=case.block_size)
    finally:
        torch.set_num_threads(threads)
    assert calls, "the selection did not reach the block kernel"
    expected, _ = reference_attention_lse(q, k, v, pattern, extra_mask=lambda r: effective_mask(
        chosen, pattern, r, case.heads, case.n_kv_heads))
    assert float((out.double() - expected).norm() / expected.norm()) < 1e-4
