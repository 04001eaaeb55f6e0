"""A model case's samples: S sequences of N tokens and where each is scored.

- mqar: `bench.models.mqar.make_batch` with the vocabulary the model was trained on (its card's `task.vocab`, else
  MQAR's default), seeded by the case's seed; scored at the query positions against the answers.
- text: the file tokenized by the model directory's tokenizer, cut into S windows of N tokens from the start (as
  many as the text holds, at least one); every next token scored (perplexity).
- tokens: a JSON list of token-id lists, or a safetensors file with `input_ids` (S', N'): each sequence's first N
  tokens, the first S sequences that have N tokens; every next token scored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from bench.models import mqar
from bench.models.spec import ModelSpecError, TaskSpec, card, pretrained_source


@dataclass(frozen=True)
class Samples:
    """input_ids (S, N) int64; for accuracy, the scored positions (S, Q) and the answers there (S, Q); for
    perplexity both None (every next token is scored)."""

    input_ids: Tensor
    positions: Tensor | None = None
    answers: Tensor | None = None

    @property
    def count(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def scored(self) -> int:
        """Positions scored per sample."""
        return int(self.positions.shape[1]) if self.positions is not None else int(self.input_ids.shape[1]) - 1


def mqar_vocab(model: str) -> mqar.MqarVocab:
    """The MQAR vocabulary a model was trained on (its card), else the generator's default."""
    vocab = (card(model).get("task") or {}).get("vocab")
    return mqar.MqarVocab(**vocab) if isinstance(vocab, dict) else mqar.MqarVocab()


def make_samples(model: str, task: TaskSpec, seq_len: int, samples: int, seed: int) -> Samples:
    """The case's samples; ModelSpecError when the file holds none of seq_len tokens or the model cannot read it."""
    if task.kind == "mqar":
        batch = mqar.make_batch(seq_len, samples, seed=seed, vocab=mqar_vocab(model))
        return Samples(batch.input_ids, batch.query_positions, batch.answers)
    assert task.file is not None
    rows = _text_tokens(model, Path(task.file), seq_len) if task.kind == "text" else _file_tokens(Path(task.file))
    kept = [r[:seq_len] for r in rows if len(r) >= seq_len][:samples]
    if not kept:
        raise ModelSpecError(f"{task.file} holds no sequence of {seq_len} tokens: give a longer file or a shorter "
                             "seq_len", field=task.kind)
    return Samples(torch.tensor(kept, dtype=torch.int64))


def _text_tokens(model: str, path: Path, seq_len: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    source, extra = pretrained_source(model)  # ModelSpecError naming the install line where weights are missing
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True, **extra)
    except Exception as exc:  # transformers raises OSError, ValueError... for a directory without a tokenizer
        first = str(exc).splitlines()[0][:200] if str(exc) else ""
        raise ModelSpecError(f"the model directory has no tokenizer for a text task ({type(exc).__name__}: "
                             f"{first}); give {{tokens: FILE}} instead", field="text") from None
    ids = list(tokenizer(path.read_text(encoding="utf-8"))["input_ids"])
    return [ids[i:i + seq_len] for i in range(0, max(len(ids) - seq_len + 1, 1), seq_len)]


def _file_tokens(path: Path) -> list[list[int]]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        tensors: dict[str, Any] = load_file(str(path))
        if "input_ids" not in tensors or tensors["input_ids"].dim() != 2:
            raise ModelSpecError(f"{path} has no input_ids (S, N) tensor", field="tokens")
        return [list(map(int, row)) for row in tensors["input_ids"].tolist()]
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelSpecError(f"cannot read {path} as JSON: {exc}", field="tokens") from None
    if not isinstance(data, list) or not all(isinstance(r, list) and all(isinstance(x, int) for x in r) for r in data):
        raise ModelSpecError(f"{path}: a tokens file is a JSON list of lists of token ids", field="tokens")
    return data
