"""A user's own model ([R4 2/6]): a tiny random Llama built here from a config and saved as a local directory.
With dense, sdpa, blocked under causal and oracle_topk at full budget swapped in, its perplexity is the model's
own (transformers' eager attention) and the KL ~ 0; `bench.api.swap_attention` runs around a plain
`model(input_ids)`; bad model input is named, exit 2."""

from __future__ import annotations

import json
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from bench import api  # noqa: E402
from bench.cli import main  # noqa: E402
from tests.conftest import only_run_dir, read_jsonl, write_suite  # noqa: E402

N = 96


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 2-layer Llama (GQA 4/2, head_dim 16), random weights, saved with a tokens file of 4 sequences."""
    root = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(root / "tiny-llama")
    gen = torch.Generator().manual_seed(1)
    (root / "tokens.json").write_text(json.dumps(torch.randint(0, 97, (4, N), generator=gen).tolist()))
    return root, model


def _own_ppl(model, ids: torch.Tensor) -> float:
    """The model's perplexity with transformers' eager attention: exp(mean next-token NLL over the samples)."""
    model.set_attn_implementation("eager")
    nll = []
    with torch.no_grad():
        for row in ids:
            logits = model(row[None]).logits[0, :-1].double()
            nll.append(float(torch.nn.functional.cross_entropy(logits, row[1:])))
    model.set_attn_implementation("sdpa")
    return math.exp(sum(nll) / len(nll))


def test_exact_attentions_keep_the_models_own_perplexity(tiny, tmp_path):
    root, model = tiny
    suite = write_suite(root, {
        "name": "tiny-quality", "impls": ["dense", "sdpa", "blocked"],
        "defaults": {"model": "tiny-llama", "task": {"tokens": "tokens.json"}, "samples": 4, "seq_len": N,
                     "pattern": "causal", "block_size": 32, "device": "cpu"},
        "sweeps": [{"sweep": {}}, {"defaults": {"selector": "oracle_topk", "budget": 1.0}, "sweep": {}}],
        "measure": {"warmup": 0, "repeat": 2, "max_time_s": 0.01, "memory": "worker"}}, "tiny.yaml")
    assert main(["run", str(suite), "--out", str(tmp_path / "r")]) == 0
    records = read_jsonl(only_run_dir(tmp_path / "r") / "records.jsonl")
    own = _own_ppl(model, torch.tensor(json.loads((root / "tokens.json").read_text())))
    assert len(records) == 6  # 3 implementations x (causal, oracle_topk at full budget)
    for r in records:
        assert r["status"] == "ok" and r["params"]["heads"] == 4 and r["params"]["kv_heads"] == 2, r
        q = r["quality"]
        assert q["metric"] == "ppl" and q["samples"] == 4 and q["tokens"] == N and q["p_value"] is None
        assert q["value"] == pytest.approx(own, rel=1e-4) and q["dense_value"] == pytest.approx(own, rel=1e-4)
        assert abs(q["kl_mean"]) < 1e-6 and q["model_time_s"] > 0, q


def test_swap_attention_runs_around_a_plain_forward(tiny):
    _, model = tiny
    ids = torch.randint(0, 97, (1, 64), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        own = model(ids).logits
        with api.swap_attention(model, "blocked", pattern="causal", block_size=32) as swap:
            swapped = model(ids).logits
        with api.swap_attention(model, "blocked", pattern="causal_local", window=8, layers=[1]) as local:
            windowed = model(ids).logits
    assert swap.calls == 2 and local.calls == 1  # both layers, then layer 1 only
    assert torch.allclose(swapped, own, atol=1e-4)
    assert not torch.allclose(windowed, own, atol=1e-3)  # a window of 8 changes the answer
    assert model.config._attn_implementation == "sdpa"  # restored


@pytest.mark.parametrize(("defaults", "field", "words"), [
    ({"model": "no-such-model"}, "defaults.model", "neither a built-in model"),
    ({"model": "empty"}, "defaults.model", "has no config.json"),
    ({"model": "tiny-llama", "task": "mqar", "heads": 8}, "defaults.heads", "the model tiny-llama has heads 4"),
    ({"model": "tiny-llama", "task": "mqar", "seq_len": 512}, "defaults.seq_len", "has 256 positions"),
    ({"model": "tiny-llama", "task": "mqar", "pattern": "local"}, "defaults.pattern", "later ones"),
    ({"model": "tiny-llama", "task": "nope"}, "defaults.task", "built-in tasks: mqar"),
    ({"model": "tiny-llama"}, "defaults.model", "has no task of its own"),
    ({"task": "mqar"}, "defaults.task", "with no model"),
])
def test_bad_model_input_is_named_and_exits_2(tiny, capsys, defaults, field, words):
    root, _ = tiny
    (root / "empty").mkdir(exist_ok=True)
    suite = write_suite(root, {"name": "bad", "impls": ["sdpa"], "defaults": {"seq_len": 64, **defaults},
                               "sweep": {}}, "bad.yaml")
    assert main(["run", str(suite), "--out", str(root / "r")]) == 2
    err = capsys.readouterr().err
    assert f"{field}:" in err and words in err and "Traceback" not in err, err
