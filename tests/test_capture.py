"""`bench capture` on a tiny randomly initialised Llama-style model (GQA, RoPE) made from a config here: no hub."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402

from bench.api import run as api_run  # noqa: E402
from bench.cli import main  # noqa: E402
from bench.measure.oracle.reference import reference_attention  # noqa: E402
from bench.patterns import make_pattern  # noqa: E402
from tests.conftest import write_suite  # noqa: E402

TEXT = "Sparse attention chooses its keys from the inputs. " * 12  # 624 UTF-8 bytes


def tiny_llama(directory, layers: int = 3, seed: int = 0):
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=16, max_position_embeddings=1024, rope_theta=10000.0)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(directory)
    return model


def test_capture_saves_what_the_models_attention_computed(tmp_path):
    model = tiny_llama(tmp_path / "model")
    out = tmp_path / "cap.safetensors"
    assert main(["capture", str(tmp_path / "model"), TEXT, "-o", str(out), "--layers", "0,-1",
                 "--max-tokens", "500"]) == 0
    with safe_open(str(out), framework="pt") as f:
        meta = f.metadata()
        saved = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    assert sorted(saved) == [f"layers.{layer}.{t}" for layer in (0, 2) for t in "kqv"]
    assert meta["model"] == str(tmp_path / "model") and meta["tokens"] == "500" and len(meta["text_sha256"]) == 64
    assert saved["layers.2.q"].shape == (1, 4, 500, 16) and saved["layers.2.k"].shape == (1, 2, 500, 16)

    # What the model computed, read independently: each layer's k (k_proj, then the model's rotary embedding)
    # and the attention output that its o_proj receives.
    seen: dict[str, torch.Tensor] = {}
    for index in (0, 2):
        attn = model.model.layers[index].self_attn
        attn.k_proj.register_forward_hook(lambda m, i, o, index=index: seen.__setitem__(f"k{index}", o))
        attn.o_proj.register_forward_pre_hook(lambda m, i, index=index: seen.__setitem__(f"o{index}", i[0]))
    ids = torch.tensor([list(TEXT.encode())[:500]])
    with torch.no_grad():
        model(ids)
        cos, sin = model.model.rotary_emb(torch.zeros(1), torch.arange(500)[None])
    pattern = make_pattern("causal", 500)
    for index in (0, 2):
        k = seen[f"k{index}"].view(1, 500, 2, 16).transpose(1, 2)
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        _, k_rope = apply_rotary_pos_emb(k, k, cos, sin)
        assert torch.allclose(saved[f"layers.{index}.k"], k_rope, atol=1e-5)
        ours = reference_attention(saved[f"layers.{index}.q"], saved[f"layers.{index}.k"],
                                   saved[f"layers.{index}.v"], pattern)
        theirs = seen[f"o{index}"].view(1, 500, 4, 16).transpose(1, 2).double()
        assert torch.allclose(ours, theirs, atol=1e-5), float((ours - theirs).abs().max())


def test_a_captured_file_runs_as_a_suites_inputs(tmp_path):
    tiny_llama(tmp_path / "model", layers=2)
    assert main(["capture", str(tmp_path / "model"), TEXT, "-o", str(tmp_path / "cap.safetensors")]) == 0
    suite = {"name": "captured", "impls": ["dense", "sdpa"],
             "defaults": {"heads": 4, "kv_heads": 2, "head_dim": 16, "pattern": "causal",
                          "inputs": {"file": "cap.safetensors", "layer": 1}},
             "sweep": {"seq_len": [256, 600], "q_len": [None, 1]},
             "measure": {"repeat": 2, "warmup": 0, "max_time_s": 0.2, "memory": "worker"}}
    records = api_run(write_suite(tmp_path, suite), out=tmp_path / "results", quiet=True)
    assert len(records) == 8 and all(r.status == "ok" for r in records), [r.reason for r in records]
    assert {r.inputs.kind for r in records} == {"file"} and {r.inputs.layer for r in records} == {1}


def test_capture_of_a_model_without_attention_layers_exits_2(tmp_path, capsys):
    tiny_llama(tmp_path / "model", layers=0)
    code = main(["capture", str(tmp_path / "model"), TEXT, "-o", str(tmp_path / "x.safetensors")])
    assert code == 2
    assert "no layers" in capsys.readouterr().err
    assert not (tmp_path / "x.safetensors").exists()


@pytest.mark.parametrize("args, words", [
    (["--layers", "5"], ["--layers", "allowed -3 to 2"]),
    (["--layers", "one"], ["--layers", "integers"]),
    (["--max-tokens", "0"], ["--max-tokens"]),
])
def test_bad_capture_flags_exit_2(tmp_path, capsys, args, words):
    tiny_llama(tmp_path / "model")
    assert main(["capture", str(tmp_path / "model"), TEXT, "-o", str(tmp_path / "x.safetensors"), *args]) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err


def test_capture_never_downloads(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert main(["capture", "no-such-org/no-such-model", TEXT, "-o", str(tmp_path / "x.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "never downloads" in err and "no-such-org/no-such-model" in err
