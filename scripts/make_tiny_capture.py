"""Write suites/data/tiny_llama.safetensors: `bench capture` of a tiny randomly initialised Llama-style model.

The model (2 layers, 4 query heads on 2 KV heads, head_dim 64, RoPE theta 10000, vocabulary of 256 byte values)
is made from a config with a fixed seed, so no weights are downloaded or shipped; it runs once over
suites/data/capture_text.txt (its UTF-8 bytes are the token ids: the model has no tokenizer) and layer 1's
post-RoPE q, k, v of the first 2048 tokens are saved in float16 (2 MiB). suites/inputs.yaml reads the file.

    python scripts/make_tiny_capture.py            # needs the `capture` extra (transformers)
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
import transformers

from bench.cli import main

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT / "suites" / "data" / "capture_text.txt"
OUT = ROOT / "suites" / "data" / "tiny_llama.safetensors"


def tiny_model(directory: Path) -> None:
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                      max_position_embeddings=4096, rope_theta=10000.0)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "tiny-llama"
        tiny_model(model)
        name = "tiny-llama (random init, seed 0, scripts/make_tiny_capture.py)"
        sys.exit(main(["capture", str(model), str(TEXT), "-o", str(OUT), "--layers", "1", "--max-tokens", "2048",
                       "--dtype", "float16", "--name", name]))
