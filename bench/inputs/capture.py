"""`bench capture MODEL TEXT -o FILE`: a language model's q, k, v per layer, saved as a case's inputs.

A Hugging Face causal LM (transformers: the optional extra `capture`, imported only when this runs) is loaded
from a local directory or from the user's cache - never downloaded - and runs TEXT once. Its attention
layers call attention through transformers' attention interface; a capture function registered there saves
each chosen layer's query, key and value as the layer hands them over: rotary embedding applied, K/V at their
KV heads (before any GQA repeat), then lets the model's SDPA attention compute the layer's output as usual.
Where the model scales scores by other than 1/sqrt(D) (Gemma's query_pre_attn_scalar), q is saved
rescaled, so that the suite's attention (scale 1/sqrt(D)) gives the model's scores.

The file (bench.inputs.files): `layers.L.q` (1, H, N, D), `layers.L.k`, `layers.L.v` (1, Hkv, N, D), metadata
`model`, `text_sha256`, `tokens`, `tokenizer`, `model_type`, `layers`, `dtype`.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import Progress

from bench.errors import BadInput
from bench.inputs.files import tensor_name

CAPTURE_NAME = "bench_capture"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise BadInput("bench capture needs transformers: pip install 'sparse-attention-bench[capture]'",
                       field="MODEL") from None
    return transformers


def parse_layers(spec: str | None, count: int) -> list[int]:
    """`0,12,-1` -> layer indices (negative from the end), each once, in order. Raises BadInput."""
    if count == 0:
        raise BadInput("the model has no layers (num_hidden_layers is 0): nothing to capture", field="MODEL")
    if spec is None:
        return list(range(count))
    chosen: list[int] = []
    for part in spec.split(","):
        try:
            index = int(part.strip())
        except ValueError:
            raise BadInput(f"got {part!r}; layers are integers separated by commas (negative counts from the end)",
                           field="--layers") from None
        if not -count <= index < count:
            raise BadInput(f"got {index}; the model has {count} layers: allowed -{count} to {count - 1}",
                           field="--layers")
        index %= count
        if index not in chosen:
            chosen.append(index)
    return chosen


def read_text(text: str) -> str:
    """TEXT is a file's path when such a file exists, else the text itself."""
    path = Path(text)
    try:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except OSError:
        pass
    return text


def _load_model(transformers: Any, model: str, dtype: torch.dtype) -> Any:
    try:
        loaded = transformers.AutoModelForCausalLM.from_pretrained(model, local_files_only=True, dtype=dtype)
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError... for what it cannot load
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise BadInput(f"cannot load {model!r} as a causal LM from a local directory or the Hugging Face cache "
                       f"(bench capture never downloads): {first}", field="MODEL") from None
    return loaded.eval()


def _token_ids(transformers: Any, model: str, text: str, vocab: int, max_tokens: int | None
               ) -> tuple[torch.Tensor, str]:
    """(ids (1, N), how the text was tokenised): the model's tokenizer, or its UTF-8 bytes where it has none."""
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(model, local_files_only=True)
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
        how = type(tokenizer).__name__
    except Exception:  # no tokenizer files next to the model (a model made from a config)
        ids = torch.tensor([list(text.encode("utf-8"))], dtype=torch.int64) % vocab
        how = "utf-8 bytes modulo the vocabulary (the model has no tokenizer)"
    if max_tokens is not None:
        ids = ids[:, :max_tokens]
    if ids.shape[1] == 0:
        raise BadInput("the text gives no tokens", field="TEXT")
    return ids, how


def capture(model: str, text: str, *, layers: str | None = None, max_tokens: int | None = None,
            dtype: str = "float32", name: str | None = None, console: Console | None = None
            ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of MODEL run once on TEXT: q, k, v of the chosen layers (module docstring)."""
    transformers = _transformers()
    torch_dtype = DTYPES[dtype]
    lm = _load_model(transformers, model, torch_dtype)
    config = lm.config
    count = int(getattr(config, "num_hidden_layers", 0) or 0)
    chosen = parse_layers(layers, count)
    body = read_text(text)
    ids, how = _token_ids(transformers, model, body, int(config.vocab_size), max_tokens)
    saved: dict[str, torch.Tensor] = {}
    scales: dict[int, float] = {}
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    progress = Progress(console=console, transient=True, disable=console is None)
    task = progress.add_task(f"capturing {len(chosen)} layer(s) of {model}", total=len(chosen))

    def capture_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: Any, **kwargs: Any) -> Any:
        layer = getattr(module, "layer_idx", None)
        if layer in chosen and tensor_name(layer, "q") not in saved:
            head_dim = query.shape[-1]
            scaling = kwargs.get("scaling") or 1.0 / math.sqrt(head_dim)
            scales[layer] = float(scaling)
            rescale = scaling * math.sqrt(head_dim)  # the suite scores q.k / sqrt(D)
            saved[tensor_name(layer, "q")] = (query * rescale).detach().to(torch_dtype).cpu().contiguous()
            saved[tensor_name(layer, "k")] = key.detach().to(torch_dtype).cpu().contiguous()
            saved[tensor_name(layer, "v")] = value.detach().to(torch_dtype).cpu().contiguous()
            progress.advance(task)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    transformers.AttentionInterface.register(CAPTURE_NAME, capture_attention)
    try:
        lm.set_attn_implementation(CAPTURE_NAME)
    except Exception as exc:
        raise BadInput(f"{model!r} ({config.model_type}) cannot take a registered attention function: {exc}",
                       field="MODEL") from None
    with progress, torch.no_grad():
        lm(ids)
    missing = [layer for layer in chosen if tensor_name(layer, "q") not in saved]
    if len(missing) == len(chosen):
        raise BadInput(f"{model!r} ({config.model_type}) ran without an attention layer calling transformers' "
                       "attention interface: it has no attention layers this command can capture", field="MODEL")
    if missing:
        raise BadInput(f"layers {missing} of {model!r} did not call the attention interface", field="--layers")
    metadata = {"model": name or str(model), "text_sha256": hashlib.sha256(body.encode("utf-8")).hexdigest(),
                "tokens": str(ids.shape[1]), "tokenizer": how, "model_type": str(config.model_type),
                "layers": ",".join(str(layer) for layer in chosen), "dtype": dtype,
                "scaling": ",".join(f"{layer}:{scales[layer]:.8g}" for layer in chosen),
                "format": "bench capture: q rescaled so that q.k/sqrt(D) is the model's score; rotary applied"}
    return saved, metadata


def capture_command(model: str, text: str, out: Path, layers: str | None, max_tokens: int | None, dtype: str,
                    name: str | None, console: Console) -> int:
    """Write the capture to `out` (safetensors); returns the exit code."""
    from safetensors.torch import save_file

    if max_tokens is not None and max_tokens < 1:
        raise BadInput(f"got {max_tokens}; allowed: a positive number of tokens", field="--max-tokens")
    if not out.parent.is_dir():
        raise BadInput("the output's directory does not exist", file=str(out), field="-o")
    tensors, metadata = capture(model, text, layers=layers, max_tokens=max_tokens, dtype=dtype, name=name,
                                console=console)
    save_file(tensors, str(out), metadata=metadata)
    q = tensors[tensor_name(int(metadata["layers"].split(",")[0]), "q")]
    k = tensors[tensor_name(int(metadata["layers"].split(",")[0]), "k")]
    console.print(f"captured layers {metadata['layers']} of {model} ({metadata['model_type']}) on "
                  f"{metadata['tokens']} tokens: q {list(q.shape)}, k and v {list(k.shape)}, {dtype} -> {out}")
    console.print(f"use it in a suite: inputs: {{file: {out}, layer: {metadata['layers'].split(',')[0]}}} with batch "
                  f"{q.shape[0]}, heads {q.shape[1]}, kv_heads {k.shape[1]}, head_dim {q.shape[3]}, "
                  f"seq_len <= {q.shape[2]}")
    return 0
