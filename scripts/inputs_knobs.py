"""What each knob of the structured generator does to attention: the figures of docs/inputs.md.

For each knob at a low value, its default and a high value, the generator makes the inputs of one case
(Llama-3-8B's attention shape: 32 query heads on 8 KV heads, D=128; the last 512 queries of a causal prefill
over N keys) and this prints the statistics of dense attention that the knob moves, from the oracle's float64
weights. The generator is deterministic per seed, so these figures are the same on every machine.

    python scripts/inputs_knobs.py [N]        # N = 4096 by default
"""

from __future__ import annotations

import sys

import torch

from bench.inputs import StructuredKnobs
from bench.inputs.structured import StructuredInputs, structured_inputs
from bench.measure.oracle.attention_stats import attention_statistics
from bench.measure.oracle.reference import reference_weights
from bench.patterns import make_pattern

HEADS, KV_HEADS, HEAD_DIM, Q_LEN = 32, 8, 128, 512
SWEEPS = {  # knob: (low, high); the default sits between
    "noise": (0.25, 4.0), "temperature": (0.5, 2.0), "sinks": (0, 16), "sink_logit": (4.0, 12.0),
    "local_logit": (4.0, 12.0), "locality": (0.0, 1.0), "rope_theta": (10_000.0, 5_000_000.0),
    "heavy_hitters": (0.0, 0.01), "heavy_logit": (0.0, 8.0), "needle_logit": (6.0, 16.0),
    "local_heads": (0.0, 1.0),
}


def figures(made: StructuredInputs, n: int) -> dict[str, float]:
    """Means over (head, row): the standard statistics, and the shares of a row's mass within 16 and 256 keys of
    it, on the heavy hitters, and (needle rows) on their needle."""
    pattern = make_pattern("causal", n, q_len=Q_LEN)
    rows = torch.arange(Q_LEN)
    stats = attention_statistics(made.q, made.k, pattern, rows, 64)
    out = {name: stats[name]["mean"] for name in ("top1_mass", "top5_mass", "block_top5_mass", "entropy",
                                                    "sink_mass")}
    near16, near256, heavy, needle_mass, needle_rows = 0.0, 0.0, 0.0, 0.0, 0
    for r, weights in reference_weights(made.q, made.k, pattern, rows):
        positions = r + n - Q_LEN
        distance = positions[:, None] - torch.arange(n)[None, :]
        near16 += float((weights * ((distance >= 0) & (distance < 16))).sum(-1).mean()) * len(r)
        near256 += float((weights * ((distance >= 0) & (distance < 256))).sum(-1).mean()) * len(r)
        if made.heavy_positions:
            heavy += float(weights[..., made.heavy_positions].sum(-1).mean()) * len(r)
        for needle in made.needles:
            for row in needle.rows:
                hit = (r == row).nonzero()
                if hit.numel():
                    needle_mass += float(weights[:, :, int(hit[0, 0]), needle.start : needle.end].sum(-1).mean())
                    needle_rows += 1
    out.update(within_16=near16 / Q_LEN, within_256=near256 / Q_LEN, heavy_mass=heavy / Q_LEN,
               needle_mass=needle_mass / needle_rows if needle_rows else float("nan"))
    return out


def main(n: int) -> None:
    defaults = StructuredKnobs()
    columns = ["top1_mass", "top5_mass", "block_top5_mass", "entropy", "sink_mass", "within_16", "within_256",
               "heavy_mass", "needle_mass"]
    print(f"N={n}, last {Q_LEN} queries of a causal prefill, H={HEADS}/{KV_HEADS}, D={HEAD_DIM}, seed 0; "
          "means over (head, row)")
    print("| knob | value | " + " | ".join(columns) + " |")
    print("|---|---|" + "---|" * len(columns))
    for knob, (low, high) in SWEEPS.items():
        for value in (low, getattr(defaults, knob), high):
            extra = {"global_heads": 0.0} if knob == "local_heads" else {}
            knobs = StructuredKnobs(**{knob: value, **extra})
            made = structured_inputs(batch=1, heads=HEADS, kv_heads=KV_HEADS, seq_len=n, q_len=Q_LEN,
                                     head_dim=HEAD_DIM, block_size=64, seed=0, knobs=knobs)
            row = figures(made, n)
            mark = " (default)" if value == getattr(defaults, knob) and not extra else ""
            print(f"| {knob} | {value:g}{mark} | " + " | ".join(f"{row[c]:.3f}" for c in columns) + " |")
            sys.stdout.flush()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4096)
