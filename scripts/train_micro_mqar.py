"""Train micro-mqar, the suite's built-in model: a small Llama (GQA, RoPE) that answers MQAR queries.

The model is a transformers.LlamaForCausalLM built from a LlamaConfig, so that code written for users' Llama
models serves it unchanged. It is trained on bench/models/mqar.py's multi-query associative recall, with the
loss on the answers only (the rest of an MQAR sequence is random), a curriculum of lengths and pair counts
(few pairs in short contexts first: the recall circuit forms there, then it is asked across longer ones), AdamW
with linear warmup and cosine decay. Everything is seeded: the initial weights, every batch, the evaluation.

It writes into --out (default bench/models/micro_mqar/): model.safetensors, config.json, card.json (the
settings, the loss curve, dense accuracy per evaluation length in float32 and bfloat16 with a 95% Wilson
interval, the wall time and the machine) and README.md (the same facts for a reader). A model whose accuracy
misses 0.95 at some length does not replace the one in the default directory (--force does).

None of the recipes tried reached the 0.95 target in about an hour on one CPU core: two stayed on MQAR's
plateau; the default, short sequences first, grew the recall circuit on sequences of up to 96 tokens but did
not carry it to 256 and more (the attempts, their loss curves and why: docs/models/micro_mqar.md and
docs/models/micro_mqar_training.json). The shipped weights are scripts/build_micro_mqar.py's analytic circuit
in the same LlamaForCausalLM architecture.

    python scripts/train_micro_mqar.py --out /tmp/m --max-minutes 20   # attempt 3 (--curriculum short)
    python scripts/train_micro_mqar.py --smoke --out /tmp/m      # a few dozen steps on short sequences
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from a checkout: bench/ imports without an install

from bench.models.mqar import MqarBatch, MqarVocab, correct, default_num_pairs, make_batch, wilson_interval  # noqa: E402

DEFAULT_OUT = ROOT / "bench" / "models" / "micro_mqar"
EVAL_LENGTHS = (256, 512, 1024, 2048, 4096)
EVAL_SEED = 20_000_000  # evaluation batches: seed EVAL_SEED + length; training batch seeds are below it
MAX_POSITIONS = 8192


@dataclass(frozen=True)
class Stage:
    """A curriculum stage: from `start` (a fraction of the steps) on, batches of `seq_len` tokens with a pair
    count drawn uniformly from [min_pairs, max_pairs], every pair queried; `tokens` per step in all."""

    start: float
    seq_len: int
    min_pairs: int
    max_pairs: int
    tokens: int


# Few pairs in short contexts first, then longer ones ask the circuit to find one key among more distractors,
# which sharpens its attention (softmax dilution is what breaks recall at long contexts).
CURRICULUM = (
    Stage(0.00, 64, 2, 8, 4096),
    Stage(0.25, 128, 4, 16, 4096),
    Stage(0.50, 256, 8, 32, 8192),
    Stage(0.80, 512, 8, 32, 8192),
)
# Denser: more pairs (and so more answers to learn from) per short sequence from the start.
DENSE_CURRICULUM = (
    Stage(0.00, 64, 8, 16, 4096),
    Stage(0.40, 128, 8, 32, 4096),
    Stage(0.70, 256, 16, 64, 8192),
)
# Shorter first: in a short sequence the key before a value is a larger share of what layer 1 mixes in at first,
# so the signal that grows a previous-token head is stronger.
SHORT_CURRICULUM = (
    Stage(0.00, 24, 3, 5, 4096),
    Stage(0.30, 48, 4, 8, 4096),
    Stage(0.55, 96, 8, 16, 4096),
    Stage(0.80, 192, 8, 32, 8192),
)
CURRICULA = {"gradual": CURRICULUM, "dense": DENSE_CURRICULUM, "short": SHORT_CURRICULUM}
SMOKE_CURRICULUM = (Stage(0.0, 64, 2, 4, 1024),)


def micro_config(vocab: MqarVocab, *, hidden: int = 128, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                 head_dim: int = 32, intermediate: int = 256, rope_theta: float = 100_000.0) -> Any:
    """The LlamaConfig of micro-mqar (grouped-query attention, RoPE, SwiGLU MLP, RMSNorm)."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=vocab.size, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=MAX_POSITIONS, rope_theta=rope_theta, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)


def query_logits(model: Any, batch: MqarBatch) -> torch.Tensor:
    """(S, Q, vocab) float32 logits at the query positions: the head runs on those rows only."""
    hidden = model.model(input_ids=batch.input_ids).last_hidden_state
    index = batch.query_positions[..., None].expand(-1, -1, hidden.shape[-1])
    return model.lm_head(hidden.gather(1, index)).float()


def learning_rate(step: int, steps: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warmup to `peak`, then cosine decay to floor * peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def stage_at(curriculum: tuple[Stage, ...], step: int, steps: int) -> Stage:
    return [s for s in curriculum if s.start * steps <= step][-1]


def training_batch(stage: Stage, vocab: MqarVocab, seed: int, step: int) -> MqarBatch:
    """Step `step`'s batch, from a seed of its own (seed * 100_003 + step; below EVAL_SEED)."""
    batch_seed = (seed * 100_003 + step) % EVAL_SEED
    pairs_rng = torch.Generator().manual_seed(batch_seed)
    pairs = int(torch.randint(stage.min_pairs, stage.max_pairs + 1, (1,), generator=pairs_rng))
    return make_batch(stage.seq_len, max(1, stage.tokens // stage.seq_len), seed=batch_seed, num_pairs=pairs,
                      num_queries=pairs, vocab=vocab)


def train(model: Any, vocab: MqarVocab, *, steps: int, seed: int, lr: float, warmup: int, weight_decay: float,
          curriculum: tuple[Stage, ...], log_every: int, log: bool = True, max_s: float | None = None
          ) -> list[dict[str, float]]:
    """AdamW on the answer loss; returns the loss curve (mean loss and answer accuracy over each `log_every`).
    Stops early after `max_s` seconds (the curve then ends at the last step run)."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    optimiser = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                   {"params": rest, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.98))
    curve: list[dict[str, float]] = []
    losses: list[float] = []
    hits: list[float] = []
    start = time.perf_counter()
    model.train()
    for step in range(steps):
        stage = stage_at(curriculum, step, steps)
        batch = training_batch(stage, vocab, seed, step)
        for group in optimiser.param_groups:
            group["lr"] = learning_rate(step, steps, lr, warmup)
        logits = query_logits(model, batch)
        # The loss on the answers only: nothing else in an MQAR sequence is predictable.
        loss = F.cross_entropy(logits.flatten(0, 1), batch.answers.flatten())
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimiser.step()
        losses.append(loss.item())
        hits.append(float((logits.argmax(-1) == batch.answers).float().mean()))
        out_of_time = max_s is not None and time.perf_counter() - start > max_s
        if (step + 1) % log_every == 0 or step + 1 == steps or out_of_time:
            point = {"step": step + 1, "loss": sum(losses) / len(losses), "accuracy": sum(hits) / len(hits),
                     "seq_len": stage.seq_len, "lr": learning_rate(step, steps, lr, warmup),
                     "elapsed_s": round(time.perf_counter() - start, 1)}
            curve.append(point)
            losses.clear()
            hits.clear()
            if log:
                print(json.dumps(point), flush=True)
        if out_of_time:
            break
    model.eval()
    return curve


def evaluate(model: Any, lengths: tuple[int, ...], samples: int, vocab: MqarVocab,
             dtypes: tuple[str, ...] = ("float32", "bfloat16"), log: bool = True,
             samples_at: dict[int, int] | None = None) -> dict[str, dict[str, Any]]:
    """Dense accuracy over `samples` fresh sequences per length (`samples_at[length]` where given; default pair
    and query counts), per dtype.

    Accuracy counts queries (samples x queries of them); the interval is the Wilson 95% interval over them.
    """
    results: dict[str, dict[str, Any]] = {}
    for dtype in dtypes:
        runner = model.to(getattr(torch, dtype))
        results[dtype] = {}
        for length in lengths:
            count = (samples_at or {}).get(length, samples)
            batch = make_batch(length, count, seed=EVAL_SEED + length, vocab=vocab)
            start = time.perf_counter()
            hits = correct(runner, batch, chunk=max(1, 8192 // length))
            n, k = hits.numel(), int(hits.sum())
            low, high = wilson_interval(k, n)
            results[dtype][str(length)] = {
                "accuracy": k / n, "wilson95": [round(low, 4), round(high, 4)], "correct": k, "queries": n,
                "samples": count, "pairs": batch.num_pairs, "queries_per_sample": batch.answers.shape[1],
                "seed": EVAL_SEED + length, "all_queries_right": float(hits.all(dim=1).float().mean()),
                "eval_s": round(time.perf_counter() - start, 1)}
            if log:
                print(dtype, length, json.dumps(results[dtype][str(length)]), flush=True)
    model.to(torch.float32)
    return results


def retrieval_mass(model: Any, seq_len: int, samples: int, seed: int, vocab: MqarVocab) -> list[list[float]]:
    """Per layer and query head: mean attention mass at the query positions on the answer's pair (key or value
    token), as a multiple of uniform attention (1 / (position + 1)). Eager attention, float32."""
    batch = make_batch(seq_len, samples, seed=seed, vocab=vocab)
    implementation = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            attentions = model(batch.input_ids, output_attentions=True).attentions
    finally:
        model.set_attn_implementation(implementation)
    rows = torch.arange(samples)[:, None]
    out = []
    for layer in attentions:  # (S, H, N, N)
        at_query = layer[rows, :, batch.query_positions]  # (S, Q, H, N)
        pair = at_query.gather(-1, batch.key_positions[:, :, None, None].expand(-1, -1, layer.shape[1], 1))
        pair = pair + at_query.gather(-1, batch.value_positions[:, :, None, None].expand(-1, -1, layer.shape[1], 1))
        ratio = pair[..., 0] * (batch.query_positions[..., None] + 1)
        out.append([round(float(x), 2) for x in ratio.mean(dim=(0, 1))])
    return out


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(threads: int) -> dict[str, Any]:
    import transformers

    return {"cpu": cpu_model(), "threads": threads, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version()}


def task_settings(vocab: MqarVocab) -> dict[str, Any]:
    return {"name": "MQAR (multi-query associative recall), pairs spread over the context, queries at the end",
            "generator": "bench/models/mqar.py make_batch", "reference": "HazyResearch/zoology, MQAR",
            "vocab": asdict(vocab), "vocab_size": vocab.size,
            "pairs": "clamp(seq_len // 64, 4, keys) unless given; queries min(pairs, 16)",
            "default_pairs": {str(n): default_num_pairs(n, vocab) for n in (*EVAL_LENGTHS, 8192)}}


def architecture(model: Any) -> dict[str, Any]:
    c = model.config
    return {"class": "transformers.LlamaForCausalLM", "layers": c.num_hidden_layers, "hidden": c.hidden_size,
            "heads": c.num_attention_heads, "kv_heads": c.num_key_value_heads, "head_dim": c.head_dim,
            "intermediate": c.intermediate_size, "rope_theta": c.rope_parameters["rope_theta"],
            "vocab_size": c.vocab_size, "max_position_embeddings": c.max_position_embeddings,
            "parameters": sum(p.numel() for p in model.parameters())}


def save(model: Any, out: Path, card: dict[str, Any]) -> None:
    """model.safetensors and config.json (save_pretrained, float32), card.json and README.md."""
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.float32).save_pretrained(out, safe_serialization=True)
    card["weights_bytes"] = (out / "model.safetensors").stat().st_size
    (out / "card.json").write_text(json.dumps(card, indent=1) + "\n")
    (out / "README.md").write_text(readme(card))


def readme(card: dict[str, Any]) -> str:
    """The human card: the same facts as card.json."""
    a = card["architecture"]
    lines = [
        "# micro-mqar", "",
        card["summary"], "",
        "## Model", "",
        f"- `{a['class']}`: {a['layers']} layers, hidden {a['hidden']}, {a['heads']} query heads on {a['kv_heads']}"
        f" KV heads (head_dim {a['head_dim']}), SwiGLU MLP {a['intermediate']}, RoPE theta {a['rope_theta']:g},"
        f" vocabulary {a['vocab_size']}, max_position_embeddings {a['max_position_embeddings']}",
        f"- {a['parameters']:,} parameters; model.safetensors {card['weights_bytes']:,} bytes (float32)",
        f"- made by `{card['made_by']}`", "",
        "## Task", "",
        f"- {card['task']['name']}; generator `{card['task']['generator']}` ({card['task']['reference']})",
        f"- vocabulary: {card['task']['vocab']}; {card['task']['pairs']}",
        f"- default pairs per length: {card['task']['default_pairs']}", "",
        "## Dense accuracy", "",
        f"{card['evaluation']['note']}", "",
        "| tokens | pairs | float32 | 95% Wilson | bfloat16 | 95% Wilson |",
        "|---:|---:|---:|---|---:|---|",
    ]
    acc = card["evaluation"]["accuracy"]
    for length in acc["float32"]:
        f32, b16 = acc["float32"][length], acc["bfloat16"][length]
        lines.append(f"| {length} | {f32['pairs']} | {f32['accuracy']:.4f} | {f32['wilson95']} | {b16['accuracy']:.4f}"
                     f" | {b16['wilson95']} |")
    if "retrieval_mass" in card["evaluation"]:
        r = card["evaluation"]["retrieval_mass"]
        lines += ["", f"Attention mass on the answer's pair at the queries, x uniform, per layer and head"
                      f" ({r['seq_len']} tokens, {r['samples']} samples): {r['per_layer_head']}"]
    if "score_margins" in card["evaluation"]:
        lines += ["", f"Attention scores of the circuit (computed from its construction): "
                      f"{card['evaluation']['score_margins']}"]
    lines += ["", "## How it was made", ""]
    lines += [f"- {line}" for line in card["method"]]
    env = card["environment"]
    lines += [f"- wall time {card['wall_time_s']:.0f} s on {env['cpu']} ({env['threads']} thread(s)); torch"
              f" {env['torch']}, transformers {env['transformers']}"]
    for attempt in card.get("training", []):
        lines += ["", f"### Training: {attempt['name']}", "", attempt["outcome"], "",
                  f"seed {attempt['seed']}, {attempt['steps']} steps in {attempt['train_s']:.0f} s on one core,"
                  f" {attempt['optimiser']}, {attempt['schedule']},"
                  f" curriculum {attempt['curriculum']}", "",
                  "| step | seq_len | loss | answer accuracy |", "|---:|---:|---:|---:|"]
        curve = attempt["loss_curve"]
        shown = curve if len(curve) <= 20 else [*curve[4:-1:5], curve[-1]]  # every 5th point here, all in card.json
        lines += [f"| {p['step']} | {p['seq_len']} | {p['loss']:.3f} | {p['accuracy']:.3f} |" for p in shown]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--rope-theta", type=float, default=100_000.0)
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--curriculum", choices=sorted(CURRICULA), default="short")
    parser.add_argument("--max-minutes", type=float, default=None, help="stop training after this long")
    parser.add_argument("--eval-samples", type=int, default=200)
    parser.add_argument("--eval-lengths", type=int, nargs="+", default=list(EVAL_LENGTHS))
    parser.add_argument("--name", default="shipped recipe", help="the attempt's name in the card and the log")
    parser.add_argument("--attempt-log", type=Path, default=None,
                        help="append this attempt (settings, loss curve, accuracy) to a JSON list, e.g. "
                             "docs/models/micro_mqar_training.json (scripts/build_micro_mqar.py keeps it in its card)")
    parser.add_argument("--force", action="store_true",
                        help="write into the shipped model's directory even if the accuracy misses 0.95")
    parser.add_argument("--smoke", action="store_true",
                        help="a few dozen steps on 64-token sequences, a small evaluation: checks that it runs")
    args = parser.parse_args(argv)
    if args.head_dim % 32:
        parser.error("--head-dim must be a multiple of 32")
    torch.set_num_threads(args.threads)
    curriculum = CURRICULA[args.curriculum]
    if args.smoke:
        curriculum = SMOKE_CURRICULUM
        args.steps, args.warmup, args.log_every = min(args.steps, 40), 5, 5
        args.eval_samples, args.eval_lengths = 4, [128]
    import transformers

    vocab = MqarVocab()
    torch.manual_seed(args.seed)
    config = micro_config(vocab, hidden=args.hidden, layers=args.layers, head_dim=args.head_dim,
                          rope_theta=args.rope_theta)
    model = transformers.LlamaForCausalLM(config)
    model.set_attn_implementation("sdpa")
    start = time.perf_counter()
    curve = train(model, vocab, steps=args.steps, seed=args.seed, lr=args.lr, warmup=args.warmup,
                  weight_decay=args.weight_decay, curriculum=curriculum, log_every=args.log_every,
                  max_s=None if args.max_minutes is None else 60 * args.max_minutes)
    train_s = time.perf_counter() - start
    accuracy = evaluate(model, tuple(args.eval_lengths), args.eval_samples, vocab)
    worst = min(r["accuracy"] for by_length in accuracy.values() for r in by_length.values())
    attempt = {
        "name": args.name, "seed": args.seed, "steps": curve[-1]["step"], "planned_steps": args.steps,
        "architecture": architecture(model),
        "outcome": f"lowest dense accuracy over the evaluated lengths and dtypes {worst:.3f} "
                   f"({'meets' if worst >= 0.95 else 'misses'} the 0.95 target)",
        "optimiser": f"AdamW lr {args.lr:g}, betas (0.9, 0.98), weight decay {args.weight_decay:g} "
                     "(matrices), gradient clip 1.0",
        "schedule": f"linear warmup {args.warmup} steps, cosine to 0.1 x", "train_s": round(train_s, 1),
        "curriculum": [asdict(s) for s in curriculum], "loss_curve": curve,
        "accuracy": {d: {n: r["accuracy"] for n, r in by_length.items()} for d, by_length in accuracy.items()},
        "environment": environment(args.threads)}
    if args.attempt_log is not None:
        attempts = json.loads(args.attempt_log.read_text()) if args.attempt_log.exists() else []
        args.attempt_log.parent.mkdir(parents=True, exist_ok=True)
        args.attempt_log.write_text(json.dumps([*attempts, attempt], indent=1) + "\n")
    card = {
        "name": "micro-mqar",
        "summary": "A small Llama trained on multi-query associative recall: its answers depend on retrieving "
                   "one far key, so a sparse attention swapped into it shows whether the model still answers.",
        "made_by": "scripts/train_micro_mqar.py" + (" --smoke" if args.smoke else ""),
        "architecture": architecture(model),
        "task": task_settings(vocab),
        "seed": args.seed,
        "method": [f"trained from the seeded initialisation for {args.steps} steps, loss on the answers only"],
        "training": [attempt],
        "evaluation": {"note": f"{args.eval_samples} fresh samples per length (seed {EVAL_SEED} + length), default "
                               "pairs and queries; accuracy over all queries; sdpa attention, causal.",
                       "accuracy": accuracy},
        "environment": environment(args.threads),
        "wall_time_s": round(time.perf_counter() - start, 1),
    }
    if worst < 0.95 and args.out.resolve() == DEFAULT_OUT.resolve() and not args.force:
        # The shipped model meets the target; one that misses it does not replace it unless asked to.
        print(f"lowest accuracy {worst:.3f} < 0.95: not replacing {args.out} (--force to replace it)",
              file=sys.stderr)
        return 1
    save(model, args.out, card)
    print(json.dumps({"out": str(args.out), "first_loss": curve[0]["loss"], "last_loss": curve[-1]["loss"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
