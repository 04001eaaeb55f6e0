"""The swap applies what a model asks of its attention, or refuses it by name ([R5 1/6]): a left-padded batch, a
Mistral layer's sliding window, a Gemma-2 layer's logit softcap give the model's own eager logits on the real
tokens; a keyword the swap cannot apply (gpt-oss's sinks), a non-causal pattern in a causal model and a scale that
is not 1/sqrt(D) are Unavailable naming what is wrong; a failed quality step keeps the kernel's record."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from bench import api  # noqa: E402
from bench.errors import Unavailable  # noqa: E402
from bench.measure.quality.swap import layer_asks  # noqa: E402
from bench.spec.case import Case  # noqa: E402

SMALL = {"vocab_size": 101, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256}


def _model(kind: str) -> object:
    torch.manual_seed(0)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)).eval()
    if kind == "mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(**SMALL, sliding_window=12)).eval()
    config = transformers.Gemma2Config(**SMALL, sliding_window=12, attn_logit_softcapping=3.0,
                                       final_logit_softcapping=None, query_pre_attn_scalar=16)
    model = transformers.Gemma2ForCausalLM(config).eval()
    with torch.no_grad():  # larger q, k weights: scores past the cap, where the tanh matters
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(6)
            layer.self_attn.k_proj.weight.mul_(6)
    return model


def _batch(pad: str) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 101, (2, 40), generator=gen)
    mask = torch.ones(2, 40, dtype=torch.long)
    if pad == "left":
        mask[0, :11] = 0
    elif pad == "right":
        mask[1, 29:] = 0
    return ids, mask


def _logits(model, impl: str | None, ids, mask) -> torch.Tensor:
    with torch.no_grad():
        if impl is None:
            model.set_attn_implementation("eager")
            return model(ids, attention_mask=mask).logits
        with api.swap_attention(model, impl, block_size=16):
            return model(ids, attention_mask=mask).logits


@pytest.mark.parametrize("kind, pad", [("llama", "left"), ("llama", "right"), ("mistral", "left"),
                                       ("gemma2", "none")])
@pytest.mark.parametrize("impl", ["dense", "sdpa", "blocked"])
def test_the_swapped_model_gives_its_own_eager_logits_on_the_real_tokens(kind, pad, impl):
    model = _model(kind)
    ids, mask = _batch(pad)
    expected = _logits(model, None, ids, mask)
    if kind == "gemma2" and impl == "sdpa":  # SDPA takes an additive mask only: the cap is refused, not dropped
        with pytest.raises(Unavailable, match="softcap"):
            _logits(model, impl, ids, mask)
        return
    got = _logits(model, impl, ids, mask)
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind, pad", [("llama", "left"), ("mistral", "none"), ("gemma2", "none")])
def test_a_swap_that_dropped_what_the_model_asks_would_be_caught(kind, pad, monkeypatch):
    """The cases above test something: with the padding, the window or the cap dropped (what the swap asks of the
    layer's keywords, and the check of its pattern against the model's mask), the logits move."""
    from bench.measure.quality import swap

    monkeypatch.setattr(swap, "layer_asks", lambda *args, **kwargs: swap.LayerAsks())
    monkeypatch.setattr(swap, "sequences_of", lambda *args, **kwargs: None)
    model = _model(kind)
    ids, mask = _batch(pad)
    expected = _logits(model, None, ids, mask)
    got = _logits(model, "dense", ids, mask)
    assert (got[mask.bool()] - expected[mask.bool()]).abs().max() > 1e-2


def test_what_the_swap_cannot_apply_is_refused_by_name():
    template = Case(pattern="causal")
    with pytest.raises(Unavailable, match="s_aux"):
        layer_asks(template, 0, 0.25, 16, 0.0, {"s_aux": torch.zeros(4)})
    with pytest.raises(Unavailable, match=r"scaling=0\.1"):
        layer_asks(template, 0, 0.1, 16, 0.0, {})
    with pytest.raises(Unavailable, match="sliding_window=8"):
        layer_asks(Case(pattern="local", window=16), 0, 0.25, 16, 0.0, {"sliding_window": 8})
    asked = layer_asks(template, 0, 0.25, 16, 0.0, {"sliding_window": 8, "softcap": 30.0, "position_ids": 1})
    applied = asked.apply(template)
    assert (applied.pattern, applied.window, applied.score_mod, applied.softcap) == ("causal_local", 8, "softcap", 30.0)
    model = _model("llama")
    ids, mask = _batch("left")
    with pytest.raises(Unavailable, match="lets a query of sequence 0 see keys the model masks"), \
            api.swap_attention(model, "dense", pattern="local", window=8), torch.no_grad():
        model(ids, attention_mask=mask)


def test_a_failed_quality_step_keeps_the_kernels_measurement(tmp_path, monkeypatch):
    from bench.measure import pair
    from bench.measure.case.case_cache import CaseCache
    from bench.measure.task import Task

    def broken(case, impl_name):
        raise RuntimeError("the model ran out of tokens")

    monkeypatch.setattr("bench.measure.quality.model_step.evaluate_quality", broken)
    case = Case(model="micro-mqar", task="mqar", samples=2, pattern="causal", device="cpu")
    record = pair.measure_task(Task.of(case, "dense", {"warmup": 0, "repeat": 2, "max_time_s": 0.01,
                                                        "memory": "worker"}), CaseCache())
    assert record.status == "ok" and record.time_s is not None and record.error is not None
    assert record.quality is not None and "the model ran out of tokens" in record.quality.error
