"""A case's model fields as the suite writes them, resolved before the case is made ([R4 2/6]): the model (a
built-in name, or a directory relative to the suite file), its task (a built-in's own when unset), a training
run; the attention's shape taken from the model's config where the suite leaves it unset, and refused where the
suite gives another."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from bench.errors import BadInput
from bench.models.spec import (
    BUILTIN_MODELS,
    ModelSpecError,
    TaskSpec,
    TrainSpec,
    attention_shape,
    resolve_model,
    resolve_task,
)


def model_fields(values: dict[str, Any], origin: dict[str, str], file: str, base_dir: Path) -> dict[str, Any]:
    """`values` with model, task and train resolved and heads, kv_heads, head_dim from the model's config."""
    def where(name: str) -> str:
        return origin.get(name, name)

    values = dict(values)
    model = values.get("model")
    if model is not None and importlib.util.find_spec("transformers") is None:
        raise BadInput("a model case needs transformers: pip install 'sparse-attention-bench[models]'", file=file,
                       field=where("model"))
    if model is None:
        extra = [k for k in ("task", "train", "layers") if values.get(k) is not None]
        raise BadInput(f"got {extra[0]} with no model; {extra[0]} belongs to a model case: set `model` too (a "
                       f"built-in: {', '.join(BUILTIN_MODELS)}, or a model directory)", file=file,
                       field=where(extra[0]))
    try:
        values["model"] = resolve_model(model, base_dir)
    except ModelSpecError as exc:
        raise BadInput(exc.message, file=file, field=where("model")) from None
    values["task"] = _task(values, where, file, base_dir)
    if values.get("train") is not None:
        try:
            values["train"] = TrainSpec.model_validate(values["train"])
        except ValidationError as exc:
            err = exc.errors()[0]
            raise BadInput(f"{err['msg']} (train takes steps >= 1 and lr in (0, 1))", file=file,
                           field=f"{where('train')}.{'.'.join(map(str, err['loc']))}") from None
    try:
        heads, kv_heads, head_dim, positions = attention_shape(values["model"])
    except ModelSpecError as exc:
        raise BadInput(exc.message, file=file, field=where("model")) from None
    for name, value in (("heads", heads), ("kv_heads", kv_heads), ("head_dim", head_dim)):
        given = values.get(name)
        if name not in origin:
            values[name] = value
        elif given != value and not (name == "kv_heads" and given is None and value == values.get("heads")):
            raise BadInput(f"got {given}; the model {model} has {name} {value} (its config.json): leave it unset to "
                           "take the model's, or give that", file=file, field=where(name))
    if positions and int(values.get("seq_len", 1024)) > positions:
        raise BadInput(f"got {values.get('seq_len', 1024)}; the model {model} has {positions} positions "
                       "(max_position_embeddings): a sample must fit", file=file, field=where("seq_len"))
    return values


def _task(values: dict[str, Any], where: Any, file: str, base_dir: Path) -> TaskSpec:
    task = values.get("task")
    if task is None:
        builtin = BUILTIN_MODELS.get(values["model"])
        if builtin is None or builtin.task is None:
            what = "a model directory" if builtin is None else f"the model {builtin.name}"
            raise BadInput(f"{what} has no task of its own: set task ({{text: FILE}} or {{tokens: FILE}}, or a "
                           "built-in task: mqar)", file=file, field=where("model"))
        return TaskSpec(kind=builtin.task)
    try:
        return resolve_task(TaskSpec.parse(task), base_dir)
    except ModelSpecError as exc:
        field = where("task") + (f".{exc.field}" if exc.field else "")
        raise BadInput(exc.message, file=file, field=field) from None
