"""Build micro-mqar analytically: an associative-recall circuit written into a LlamaForCausalLM's weights.

The model is the two-layer induction circuit that a Llama learns for MQAR, set by hand so that it holds at
every length up to max_position_embeddings (training one on this CPU did not get there: see card.json's
"training" and docs/models/micro_mqar.md). Residual stream (hidden 256), by dimension:

    0-31    KEY    the key's code: +-row of a 32x32 Hadamard matrix / sqrt(32) (64 keys, 64 codes)
    32-95   VAL    the value, one-hot
    96-99   FLAGS  is-key, is-value, is-filler (sqrt 2), constant 1: every embedding has squared norm 3
    100-131 PREV   layer 1 writes here the code of the key just before a value
    132-195 RECALL layer 2 writes here the value it found (one-hot); the head reads it

- layer 1, query head 0 (a previous-key head): value tokens query, key tokens answer, through RoPE's 16
  fastest frequency pairs with phases that peak at distance 1: a value attends to the key right before it
  (the next key back is at least 3 tokens away and scores >= 20 lower; filler and values score 0, 152 lower),
  and copies its code into PREV.
- layer 2, query head 0 (the recall head): a key's code queries PREV through RoPE's 16 slowest pairs, which
  turn by at most 0.26 rad over 8192 tokens at rope_theta 1e9, so that the match does not depend on distance:
  the value whose previous key is the query's key scores >= 39.5 at any distance up to 16384, every other
  value position <= 2.7 (two codes are orthogonal or opposite) and every other position about 0 (margins()
  computes these bounds from the construction; the build checks them). The head copies that value's one-hot
  into RECALL.
- the LM head turns RECALL into logits (about +20 for the found value, 0 for other values, -10 for keys and
  filler). The MLPs and the other heads are zero: the model is exactly this circuit.

It writes the same files as scripts/train_micro_mqar.py (model.safetensors, config.json, card.json,
README.md) into --out (default bench/models/micro_mqar/), with the training attempts' loss curves from
--training-log (default docs/models/micro_mqar_training.json) kept in the card.

    python scripts/build_micro_mqar.py
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_micro_mqar as tm  # the config, the evaluation and the card are the training script's

from bench.models.mqar import MqarVocab

HIDDEN = 256
HEAD_DIM = 64
ROPE_THETA = 1e9
KEY, VAL, IS_KEY, IS_VALUE, IS_FILLER, CONST, PREV, RECALL = 0, 32, 96, 97, 98, 99, 100, 132
CODE = 32  # code dimensions: 2 x 32 = 64 keys
FAST = range(0, 16)  # RoPE frequency pairs of layer 1 (previous key): turn by 1 ... 0.02 rad a token
SLOW = range(16, 32)  # RoPE pairs of layer 2 (recall): turn by <= 3.2e-5 rad a token
PREV_SCORE = 9.5  # layer 1: score per fast pair at distance 1 (16 x 9.5 = 152 in all)
RECALL_SCORE = 40.0  # layer 2: score of an exact match at distance 0
LOGIT = 20.0  # the found value's logit
OTHER_LOGIT = -10.0  # keys' and filler's logit


def hadamard(n: int) -> torch.Tensor:
    """The n x n Sylvester Hadamard matrix (n a power of 2): rows orthogonal, entries +-1."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def key_codes(vocab: MqarVocab) -> torch.Tensor:
    """(keys, CODE): key i's code, the rows of a Hadamard matrix and their negatives, norm 1. Two codes are
    orthogonal or opposite, so a query's key scores full against its own code and <= 0 against any other."""
    h = hadamard(CODE) / math.sqrt(CODE)
    codes = torch.cat([h, -h])
    if vocab.keys > codes.shape[0]:
        raise ValueError(f"{vocab.keys} keys need more than {CODE} code dimensions")
    return codes[:vocab.keys]


def slow_dim(t: int) -> int:
    """Head dimension of code dimension t in layer 2: the SLOW pairs (i, i + 32) for i in 16..31 (transformers'
    rotate_half pairs dimension i with i + head_dim / 2)."""
    half = HEAD_DIM // 2
    return SLOW[0] + t if t < len(SLOW) else half + SLOW[0] + (t - len(SLOW))


def embeddings(vocab: MqarVocab) -> torch.Tensor:
    e = torch.zeros(vocab.size, HIDDEN)
    e[:vocab.filler, IS_FILLER] = math.sqrt(2.0)
    keys = range(vocab.key_offset, vocab.key_offset + vocab.keys)
    e[keys, KEY:KEY + CODE] = key_codes(vocab)
    e[keys, IS_KEY] = 1.0
    for u in range(vocab.values):
        e[vocab.value_offset + u, VAL + u] = 1.0
    e[vocab.value_offset:, IS_VALUE] = 1.0
    e[:, CONST] = 1.0
    return e


def build(vocab: MqarVocab) -> Any:
    """The LlamaForCausalLM with the circuit's weights (float32)."""
    import transformers

    config = tm.micro_config(vocab, hidden=HIDDEN, layers=2, heads=4, kv_heads=2, head_dim=HEAD_DIM,
                             intermediate=HIDDEN, rope_theta=ROPE_THETA)
    model = transformers.LlamaForCausalLM(config)
    inv_freq = 1.0 / ROPE_THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    half = HEAD_DIM // 2
    emb = embeddings(vocab)
    # RMSNorm divides by the residual's RMS: 3 / HIDDEN for an embedding, (3 + 1) / HIDDEN where layer 1 wrote a
    # unit code (value tokens). The projections undo the known scale, the norms' weights stay 1.
    at_embedding = math.sqrt(HIDDEN / 3.0)
    at_value = math.sqrt(HIDDEN / 4.0)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for norm in [model.model.norm] + [m for layer in model.model.layers
                                          for m in (layer.input_layernorm, layer.post_attention_layernorm)]:
            norm.weight.fill_(1.0)
        model.model.embed_tokens.weight.copy_(emb)

        # Layer 1, head 0: q = is-value x (a, 0) and k = is-key x b (cos w, sin w) in each fast pair, so the score
        # a b cos(w (d - 1)) / sqrt(head_dim) peaks at distance d = 1 (RoPE turns q by +w p, k by +w j).
        attn = model.model.layers[0].self_attn
        ab = PREV_SCORE * math.sqrt(HEAD_DIM)
        for i in FAST:
            w = float(inv_freq[i])
            attn.q_proj.weight[i, IS_VALUE] = math.sqrt(ab) / at_embedding
            attn.k_proj.weight[i, IS_KEY] = math.sqrt(ab) * math.cos(w) / at_embedding
            attn.k_proj.weight[i + half, IS_KEY] = math.sqrt(ab) * math.sin(w) / at_embedding
        for t in range(CODE):
            attn.v_proj.weight[t, KEY + t] = 1.0 / at_embedding
            attn.o_proj.weight[PREV + t, t] = 1.0

        # Layer 2, head 0: q = the token's key code, k = PREV, in the slow pairs; v = the value's one-hot.
        attn = model.model.layers[1].self_attn
        qk = math.sqrt(RECALL_SCORE * math.sqrt(HEAD_DIM))
        for t in range(CODE):
            attn.q_proj.weight[slow_dim(t), KEY + t] = qk / at_embedding
            attn.k_proj.weight[slow_dim(t), PREV + t] = qk / at_value
        for u in range(vocab.values):
            attn.v_proj.weight[u, VAL + u] = 1.0 / at_value
            attn.o_proj.weight[RECALL + u, u] = 1.0

        # The head: RECALL (unit where the value was found; the residual's RMS there is about (3 + 1) / HIDDEN).
        head = model.lm_head.weight
        for u in range(vocab.values):
            head[vocab.value_offset + u, RECALL + u] = LOGIT / at_value
        head[:vocab.value_offset, CONST] = OTHER_LOGIT / at_value
    return model


def margins(vocab: MqarVocab, max_distance: int = 2 * tm.MAX_POSITIONS) -> dict[str, float]:
    """The circuit's attention scores, computed from the construction over every distance up to `max_distance`
    (float64): layer 1's score for the key right before a value and its lead over any key 3 or more tokens back
    (the nearest another key can be); layer 2's score for the matching code and the highest for any other."""
    inv_freq = 1.0 / ROPE_THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    distance = torch.arange(0, max_distance + 1, dtype=torch.float64)
    fast = inv_freq[list(FAST)]
    # layer 1: sum over the fast pairs of PREV_SCORE cos(w (d - 1)), at d = 1 and d >= 3
    prev = PREV_SCORE * torch.cos((distance[3:, None] - 1) * fast).sum(-1)
    at_one = PREV_SCORE * len(FAST)
    # layer 2: q . R(-d w) k for codes q, k, pair i = code dimensions (i, i + 16); RoPE turns both by w d apart
    codes = key_codes(vocab).double()
    angle = distance[:, None] * inv_freq[list(SLOW)]
    a1, a2 = codes[:, :len(SLOW)], codes[:, len(SLOW):]
    dot = torch.einsum("qi,ki->qki", a1, a1) + torch.einsum("qi,ki->qki", a2, a2)
    cross = torch.einsum("qi,ki->qki", a1, a2) - torch.einsum("qi,ki->qki", a2, a1)
    score = RECALL_SCORE * (torch.einsum("di,qki->dqk", torch.cos(angle), dot)
                            + torch.einsum("di,qki->dqk", torch.sin(angle), cross))
    same = torch.eye(len(codes), dtype=torch.bool)
    return {"max_distance": max_distance, "layer1_previous_key": at_one,
            "layer1_lead_over_other_keys": round(float(at_one - prev.max()), 3),
            "layer2_match_min": round(float(score[:, same].min()), 3),
            "layer2_other_max": round(float(score[:, ~same].max()), 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=tm.DEFAULT_OUT)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--eval-samples", type=int, default=200)
    parser.add_argument("--eval-lengths", type=int, nargs="+", default=[*tm.EVAL_LENGTHS, 8192])
    parser.add_argument("--long-samples", type=int, default=40,
                        help="samples at lengths over 4096 (one 8192-token sample costs ~16x a 2048-token one)")
    parser.add_argument("--training-log", type=Path, default=tm.ROOT / "docs" / "models" / "micro_mqar_training.json",
                        help="the training attempts (scripts/train_micro_mqar.py --log-attempt) kept in the card")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    vocab = MqarVocab()
    model = build(vocab)
    margin = margins(vocab)
    # The circuit holds if each head's right position leads the rest by far more than log(positions) ~ 9.7
    assert margin["layer1_lead_over_other_keys"] > 15 and margin["layer2_match_min"] - margin["layer2_other_max"] > 30
    model.set_attn_implementation("sdpa")
    model.eval()
    accuracy = tm.evaluate(model, tuple(args.eval_lengths), args.eval_samples, vocab,
                           samples_at={n: args.long_samples for n in args.eval_lengths if n > 4096})
    mass = tm.retrieval_mass(model, 1024, 8, seed=tm.EVAL_SEED - 1, vocab=vocab)
    attempts = json.loads(args.training_log.read_text()) if args.training_log.exists() else []
    card = {
        "name": "micro-mqar",
        "summary": "A small Llama whose weights are an associative-recall (induction) circuit for MQAR, set "
                   "analytically: its answers depend on retrieving one far key, so a sparse attention swapped into "
                   "it shows whether the model still answers.",
        "made_by": "scripts/build_micro_mqar.py",
        "architecture": tm.architecture(model),
        "task": tm.task_settings(vocab),
        "seed": None,
        "method": [
            "weights constructed analytically (no training, nothing random): layer 1 head 0 is a previous-key "
            "head through RoPE's fast frequency pairs, layer 2 head 0 a recall head through its slow pairs "
            f"(rope_theta {ROPE_THETA:g}), the LM head reads the recalled value; MLPs and other heads are zero",
            "training from scratch (scripts/train_micro_mqar.py) was tried first: the attempts and their loss "
            "curves are under 'training'",
            f"layer 1 scores {PREV_SCORE * len(FAST):g} at distance 1; layer 2 scores {RECALL_SCORE:g} for a match; "
            f"logits {LOGIT:g} for the found value, {OTHER_LOGIT:g} for keys and filler"],
        "training": attempts,
        "evaluation": {"note": f"{args.eval_samples} fresh samples per length ({args.long_samples} over 4096 "
                               f"tokens; seed {tm.EVAL_SEED} + length), default pairs and queries; accuracy over "
                               "all queries (the Wilson interval treats them as independent); sdpa attention, "
                               "causal.",
                       "accuracy": accuracy,
                       "score_margins": margin,
                       "retrieval_mass": {"seq_len": 1024, "samples": 8, "per_layer_head": mass,
                                          "note": "attention mass at the queries on the answer's key and value "
                                                  "tokens, as a multiple of uniform (1 / (position + 1))"}},
        "environment": tm.environment(args.threads),
        "wall_time_s": round(time.perf_counter() - start, 1),
    }
    tm.save(model, args.out, card)
    print(json.dumps({"out": str(args.out), "accuracy": {d: {n: r["accuracy"] for n, r in v.items()}
                                                         for d, v in accuracy.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
