"""A model case's quality: the model scored on its task's samples with the case's attention in the chosen layers
and with the reference arm (sdpa under a selection's base pattern, or the model's own causal attention where the
case is a static pattern; the same layers), sample by sample, both arms on the
same sample one after the other (so that their forward times see the same machine), then compared
(bench.measure.quality.metrics). The model runs in the case's dtype on its device, loaded once per process."""

from __future__ import annotations

import time
from dataclasses import replace
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from torch import Tensor

from bench.errors import Unavailable
from bench.measure.quality.metrics import kl_divergence, min_detectable_loss, summary_of
from bench.measure.quality.swap import swapping
from bench.models.spec import TaskSpec, model_sha256, pretrained_source
from bench.models.tasks import Samples, make_samples
from bench.results.quality_records import QualityInfo
from bench.spec.case import Case

REFERENCE = "sdpa"  # the reference arm's implementation, under the case's base pattern


@lru_cache(maxsize=4)
def load_model(model: str, dtype: str, device: str) -> Any:
    """A Hugging Face causal LM from its local directory (never downloaded), in eval mode."""
    from transformers import AutoModelForCausalLM

    source, extra = pretrained_source(model)  # a GGUF file's quantized weights are dequantized to `dtype`
    loaded: Any = AutoModelForCausalLM.from_pretrained(source, local_files_only=True, dtype=getattr(torch, dtype),
                                                       attn_implementation="sdpa", **extra)
    return loaded.to(device).eval()


def _template(case: Case) -> Case:
    """The case without its model fields: what each swapped layer call is, but for its shape."""
    return replace(case, model=None, task=None, train=None, layers=None, samples=100, mode="fwd")


def reference_template(template: Case) -> Case:
    """The reference arm: sdpa under the base pattern of a selection; for a static pattern, the model's own causal
    attention (the pattern is what is judged: a sliding window against the whole causal context)."""
    if template.selector is not None:
        return replace(template, selector=None, budget=None, threshold=None)
    return replace(template, pattern="causal", documents=None, score_mod=template.score_mod)


def _forward(model: Any, ids: Tensor, positions: Tensor | None) -> tuple[Tensor, float]:
    """(logits at the scored positions (P, V), seconds): the query positions, or every position but the last."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        if positions is None:
            logits = model(ids.to(device)).logits[0, :-1]
        else:
            keep = ids.shape[1] - int(positions.min())  # only the tail holds the queries
            tail = model(ids.to(device), logits_to_keep=keep).logits[0]
            logits = tail[(positions - (ids.shape[1] - keep)).to(tail.device)]
    if device.type == "cuda":
        torch.cuda.synchronize()
    return logits.float().cpu(), time.perf_counter() - start


def _score(logits: Tensor, samples: Samples, s: int) -> float:
    """A sample's score: its share of queries answered, or its mean next-token NLL."""
    if samples.answers is not None:
        return float((logits.argmax(-1) == samples.answers[s]).double().mean())
    targets = samples.input_ids[s, 1:]
    return float(torch.nn.functional.cross_entropy(logits.double(), targets, reduction="mean"))


def quality_failure(case: Case, reason: str) -> QualityInfo:
    """The record's `quality` of a step that failed: what was asked, and why there is no score."""
    assert case.model is not None and case.task is not None
    try:
        sha = model_sha256(case.model)
    except Exception:  # the model itself may be what failed
        sha = ""
    return QualityInfo(model=case.model, model_sha256=sha, task=case.task.to_param(), samples=case.samples,
                       tokens=case.seq_len, layers=list(case.layers) if case.layers else None,
                       metric=case.task.metric, error=reason)


def evaluate_quality(case: Case, impl_name: str) -> QualityInfo:
    """The case's QualityInfo; one with `error` when the implementation cannot run inside the model here."""
    assert case.model is not None and case.task is not None
    task: TaskSpec = case.task
    base = QualityInfo(model=case.model, model_sha256=model_sha256(case.model), task=task.to_param(),
                       samples=case.samples, tokens=case.seq_len, layers=list(case.layers) if case.layers else None,
                       metric=task.metric)
    model = load_model(case.model, case.dtype, case.device)
    samples = make_samples(case.model, task, case.seq_len, case.samples, case.seed)
    base = base.model_copy(update={"samples": samples.count})
    template, layers = _template(case), list(case.layers) if case.layers else None
    reference = reference_template(template)
    swapped_scores, dense_scores, kls, times, dense_times = [], [], [], [], []
    try:
        for s in range(samples.count):
            ids = samples.input_ids[s : s + 1]
            positions = samples.positions[s] if samples.positions is not None else None
            with swapping(model, REFERENCE, reference, layers):
                dense_logits, dense_s = _forward(model, ids, positions)
            with swapping(model, impl_name, template, layers):
                logits, seconds = _forward(model, ids, positions)
            dense_scores.append(_score(dense_logits, samples, s))
            swapped_scores.append(_score(logits, samples, s))
            kls.append(kl_divergence(dense_logits, logits).numpy())
            times.append(seconds)
            dense_times.append(dense_s)
    except Unavailable as exc:
        return base.model_copy(update={"error": f"{impl_name} in the model: {exc.reason}"})
    summary = summary_of(task.metric, np.array(swapped_scores), np.array(dense_scores), np.concatenate(kls))
    mde = min_detectable_loss(samples.count, samples.scored) if task.metric == "accuracy" else None
    return base.model_copy(update={
        "value": summary.value, "dense_value": summary.dense_value, "delta": summary.delta,
        "ci95": list(summary.ci95), "dense_ci95": list(summary.dense_ci95), "p_value": summary.p_value,
        "kl_mean": summary.kl_mean, "kl_p95": summary.kl_p95, "model_time_s": float(np.median(times)),
        "model_time_dense_s": float(np.median(dense_times)), "scored": samples.scored,
        "min_detectable_loss": mde, "values": swapped_scores, "dense_values": dense_scores})
