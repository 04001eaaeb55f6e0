"""Training against dense ([R4 3/6]): does training with a sparse attention reach dense attention's loss?

The model trains `train.steps` AdamW steps at `train.lr` twice from the same weights on the same seeded batches:
once with the case's attention in the chosen layers, once with the reference (sdpa under the base pattern). The
loss is the task's: cross-entropy of the answers at the query positions (mqar), or of every next token (text,
tokens). Each step's loss is kept; the figure is the mean of the last ten, and the delta the sparse run's minus
the dense run's. The model trains in float32 whatever the case's dtype (a low-precision optimiser step would
measure the optimiser) and its attention with it; the case's dtype is its kernel measurement's. Batches: fresh
seeded MQAR batches per step; for a file, its sequences in turn. An implementation without a backward here (flex
on CPU) gives the reason instead of a run.
"""

from __future__ import annotations

import copy
import time
from dataclasses import replace
from typing import Any

import torch

from bench.errors import Unavailable
from bench.measure.quality.evaluate import REFERENCE, load_model, reference_template
from bench.measure.quality.swap import swapping
from bench.models.spec import TaskSpec
from bench.models.tasks import Samples, make_samples
from bench.results.quality_records import TrainingInfo
from bench.spec.case import Case

BATCH = 4  # sequences per step
LAST = 10  # steps the final loss averages


def _loss(model: Any, ids: torch.Tensor, positions: torch.Tensor | None, answers: torch.Tensor | None
          ) -> torch.Tensor:
    device = next(model.parameters()).device  # the samples are made on the CPU
    ids = ids.to(device)
    positions = None if positions is None else positions.to(device)
    answers = None if answers is None else answers.to(device)
    logits = model(ids).logits
    if positions is None or answers is None:
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    at = logits.gather(1, positions[..., None].expand(-1, -1, logits.shape[-1]))  # (B, Q, V)
    return torch.nn.functional.cross_entropy(at.flatten(0, 1).float(), answers.flatten())


def _run(model: Any, impl_name: str, template: Case, layers: list[int] | None, case: Case, task: TaskSpec
         ) -> tuple[list[float], float]:
    """(every step's loss, wall seconds) of one arm."""
    optimiser = torch.optim.AdamW(model.parameters(), lr=case.train.lr if case.train else 1e-3)
    assert case.train is not None and case.model is not None
    curve = []
    start = time.perf_counter()
    model.train()
    pool = None if task.kind == "mqar" else make_samples(case.model, task, case.seq_len, case.samples, case.seed)
    for step in range(case.train.steps):
        if pool is None:
            batch = make_samples(case.model, task, case.seq_len, BATCH, seed=case.seed * 1_000_003 + step)
        else:  # the file's sequences in turn
            index = torch.arange(step * BATCH, (step + 1) * BATCH) % pool.count
            batch = Samples(pool.input_ids[index])
        optimiser.zero_grad(set_to_none=True)
        with swapping(model, impl_name, template, layers):
            loss = _loss(model, batch.input_ids, batch.positions, batch.answers)
        loss.backward()
        optimiser.step()
        curve.append(float(loss.detach()))
    model.eval()
    return curve, time.perf_counter() - start


def train_against_dense(case: Case, impl_name: str) -> TrainingInfo:
    """The case's TrainingInfo: both arms' loss curves from the same weights and batches."""
    assert case.model is not None and case.task is not None and case.train is not None
    base = TrainingInfo(steps=case.train.steps, lr=case.train.lr, batch=BATCH)
    weights = load_model(case.model, "float32", case.device)
    template = replace(case, model=None, task=None, train=None, layers=None, samples=100, mode="fwd_bwd")
    reference = reference_template(template)
    layers = list(case.layers) if case.layers else None
    torch.manual_seed(case.seed)
    try:
        curve, seconds = _run(copy.deepcopy(weights), impl_name, template, layers, case, case.task)
    except Unavailable as exc:
        return base.model_copy(update={"error": f"{impl_name} cannot train here: {exc.reason}"})
    torch.manual_seed(case.seed)
    dense, dense_s = _run(copy.deepcopy(weights), REFERENCE, reference, layers, case, case.task)
    loss, loss_dense = sum(curve[-LAST:]) / len(curve[-LAST:]), sum(dense[-LAST:]) / len(dense[-LAST:])
    return base.model_copy(update={"loss": loss, "loss_dense": loss_dense, "delta": loss - loss_dense,
                                   "curve": curve, "curve_dense": dense, "time_s": seconds,
                                   "time_dense_s": dense_s})
