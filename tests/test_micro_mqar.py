"""micro-mqar: the MQAR generator (bench/models/mqar.py), the shipped model in bench/models/micro_mqar/ (it
answers, through a real retrieval head), its card, and the training script's smoke mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.models.mqar import MqarVocab, correct, default_num_pairs, make_batch, wilson_interval

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / "bench" / "models" / "micro_mqar"
FRESH_SEED = 7_654_321  # neither a training seed nor one of the card's evaluation seeds


@pytest.fixture(scope="module")
def model():
    transformers = pytest.importorskip("transformers")
    torch.set_num_threads(1)
    loaded = transformers.LlamaForCausalLM.from_pretrained(MODEL_DIR, local_files_only=True,
                                                           attn_implementation="sdpa")
    return loaded.eval()


def test_generator_is_deterministic_by_seed() -> None:
    a, b, c = make_batch(512, 6, seed=3), make_batch(512, 6, seed=3), make_batch(512, 6, seed=4)
    for name in ("input_ids", "query_positions", "answers", "key_positions"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert not torch.equal(a.input_ids, c.input_ids)
    assert a.input_ids.shape == (6, 512) and a.input_ids.dtype == torch.int64
    q = a.answers.shape[1]
    assert a.query_positions.shape == a.key_positions.shape == (6, q)
    assert a.num_pairs == default_num_pairs(512)


@pytest.mark.parametrize("seq_len", [64, 256, 1024, 8192])
def test_every_answer_is_the_value_after_its_key(seq_len: int) -> None:
    vocab = MqarVocab()
    batch = make_batch(seq_len, 4, seed=seq_len)
    ids, rows = batch.input_ids, torch.arange(4)[:, None]
    q = batch.answers.shape[1]
    context = seq_len - 2 * q
    # The queries fill the last 2Q tokens, each followed by its answer; the queried key sits in the context.
    assert torch.equal(batch.query_positions, (context + 2 * torch.arange(q)).expand(4, q))
    assert torch.equal(ids[rows, batch.query_positions + 1], batch.answers)
    assert torch.equal(ids[rows, batch.key_positions], ids[rows, batch.query_positions])
    assert torch.equal(ids[rows, batch.value_positions], batch.answers)
    assert bool((batch.key_positions + 1 < context).all())
    for s in range(4):
        ctx = ids[s, :context]
        keys = ctx[(ctx >= vocab.key_offset) & (ctx < vocab.value_offset)]
        values = ctx[ctx >= vocab.value_offset]
        assert len(keys) == len(values) == batch.num_pairs
        assert len(set(keys.tolist())) == batch.num_pairs  # each key once: the answer is unambiguous
        is_key = (ctx >= vocab.key_offset) & (ctx < vocab.value_offset)
        # every key is followed by a value, every value preceded by a key
        assert bool((ctx[1:][is_key[:-1]] >= vocab.value_offset).all())
        assert bool(is_key[:-1][ctx[1:] >= vocab.value_offset].all())
        assert len(set(batch.query_positions[s].tolist())) == q and len(set(batch.answers[s].tolist())) == q


def test_pairs_are_spread_over_the_context() -> None:
    seq_len = 4096
    batch = make_batch(seq_len, 64, seed=11)
    context = seq_len - 2 * batch.answers.shape[1]
    where = batch.key_positions.flatten().float() / context
    quarters = torch.histc(where, bins=4, min=0.0, max=1.0) / where.numel()
    assert bool((quarters > 0.15).all()), quarters  # keys asked for come from all over the context
    distance = batch.query_positions - batch.key_positions
    assert float((distance > 256).float().mean()) > 0.9  # far from the query: several 64-key blocks away
    assert float((distance > 64).float().mean()) > 0.95


def test_wilson_interval() -> None:
    low, high = wilson_interval(95, 100)
    assert low < 0.95 < high and round(low, 3) == 0.888 and round(high, 3) == 0.978
    assert wilson_interval(10, 10)[1] == 1.0


def test_shipped_model_answers_at_1024_tokens(model) -> None:
    batch = make_batch(1024, 32, seed=FRESH_SEED)
    hits = correct(model, batch)
    assert float(hits.float().mean()) >= 0.95


def test_a_retrieval_head_attends_to_the_answer_pair(model) -> None:
    seq_len, samples = 1024, 4
    batch = make_batch(seq_len, samples, seed=FRESH_SEED + 1)
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            attentions = model(batch.input_ids, output_attentions=True).attentions
    finally:
        model.set_attn_implementation("sdpa")
    rows = torch.arange(samples)[:, None]
    best = 0.0
    for layer in attentions:  # (S, H, N, N)
        at_query = layer[rows, :, batch.query_positions]  # (S, Q, H, N)
        on_pair = sum(at_query.gather(-1, p[:, :, None, None].expand(-1, -1, layer.shape[1], 1))[..., 0]
                      for p in (batch.key_positions, batch.value_positions))
        # as a multiple of uniform causal attention at that query (1 / (position + 1)), averaged over queries
        ratio = (on_pair * (batch.query_positions[..., None] + 1)).mean(dim=(0, 1))
        best = max(best, float(ratio.max()))
    assert best > 20.0


def test_weights_and_card_agree_with_the_files(model) -> None:
    weights = MODEL_DIR / "model.safetensors"
    assert weights.stat().st_size <= 8 * 1024 * 1024
    card = json.loads((MODEL_DIR / "card.json").read_text())
    config = json.loads((MODEL_DIR / "config.json").read_text())
    a = card["architecture"]
    assert (a["layers"], a["hidden"], a["heads"], a["kv_heads"], a["head_dim"], a["intermediate"], a["vocab_size"]) \
        == (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["head_dim"], config["intermediate_size"], config["vocab_size"])
    assert a["rope_theta"] == config["rope_parameters"]["rope_theta"]
    assert config["max_position_embeddings"] >= 8192 and config["head_dim"] % 32 == 0
    assert config["num_key_value_heads"] < config["num_attention_heads"]  # grouped-query attention
    assert a["parameters"] == sum(p.numel() for p in model.parameters())
    assert card["weights_bytes"] == weights.stat().st_size
    assert card["task"]["vocab_size"] == config["vocab_size"] == MqarVocab(**card["task"]["vocab"]).size
    for dtype in ("float32", "bfloat16"):
        results = card["evaluation"]["accuracy"][dtype]
        for length in (256, 512, 1024, 2048, 4096):
            r = results[str(length)]
            assert r["samples"] >= 200 and r["correct"] / r["queries"] == r["accuracy"]
            assert r["wilson95"][0] <= r["accuracy"] <= r["wilson95"][1]
            assert r["pairs"] == default_num_pairs(length)
    # The card's figure at 256 tokens is the model's: the same seed gives the same batch and the same count.
    r = card["evaluation"]["accuracy"]["float32"]["256"]
    batch = make_batch(256, r["samples"], seed=r["seed"])
    assert int(correct(model, batch).sum()) == r["correct"]
    readme = (MODEL_DIR / "README.md").read_text()
    assert f"{a['parameters']:,} parameters" in readme and f"{r['accuracy']:.4f}" in readme


def test_training_smoke_run_lowers_the_loss(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    out = tmp_path / "micro"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "train_micro_mqar.py"), "--smoke", "--out", str(out),
                          "--threads", "1"], capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    card = json.loads((out / "card.json").read_text())
    curve = card["training"][0]["loss_curve"]
    assert len(curve) >= 3 and curve[-1]["loss"] < curve[0]["loss"]
    assert {"model.safetensors", "config.json", "card.json", "README.md"} <= {p.name for p in out.iterdir()}
