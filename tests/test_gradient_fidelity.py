"""Selection cases in fwd_bwd ([R4 3/6]): the gradients' fidelity to dense attention (dq, dk, dv: relative L2 and
cosine against dense attention's under the base pattern, the same upstream gradient), equal to dense attention's
at full budget and further at a small one; and every fwd_bwd record's phases timed apart, with the backward's
FLOPs labelled by their convention."""

from __future__ import annotations

import pytest

from bench.measure.case.case_cache import CaseCache
from bench.measure.case.flops import BWD_FACTOR
from bench.measure.pair import Task, measure_task
from bench.spec.case import Case

QUICK = {"warmup": 0, "repeat": 2, "max_time_s": 0.001, "memory": "worker"}
SHAPE = {"pattern": "causal", "seq_len": 192, "heads": 4, "kv_heads": 2, "head_dim": 32, "block_size": 32,
         "mode": "fwd_bwd", "device": "cpu"}


def _record(impl: str, **fields):
    return measure_task(Task.of(Case(**{**SHAPE, **fields}), impl, QUICK), CaseCache())


@pytest.mark.parametrize("impl", ["sdpa", "blocked"])
def test_full_budget_gradients_are_dense_attentions_and_a_small_budget_moves_them(impl):
    full = _record(impl, selector="oracle_topk", budget=1.0)
    assert full.status == "ok" and full.fidelity is not None and full.fidelity.grads is not None, full.reason
    for name, g in full.fidelity.grads.items():
        assert g.rel_l2 < 1e-12 and g.cosine == pytest.approx(1.0), (name, g)
    small = _record(impl, selector="moba", budget=1)  # its own block only
    assert small.fidelity is not None and small.fidelity.grads is not None
    assert all(g.rel_l2 > 1e-3 for g in small.fidelity.grads.values()), small.fidelity.grads
    assert small.error is not None and small.error.grads is not None  # against the oracle under the selection


def test_fwd_bwd_records_time_each_phase_and_label_the_backward_flops():
    record = _record("dense")
    assert record.status == "ok" and record.time_s is not None
    assert record.time_fwd_s is not None and record.time_bwd_s is not None
    assert record.time_fwd_s > 0 and record.time_bwd_s > 0
    forward = 4.0 * 1 * 4 * (192 * 193 // 2) * 32
    assert record.flops_bwd == pytest.approx(BWD_FACTOR * forward) and record.flops == pytest.approx(2.5 * forward)
    assert _record("dense", mode="fwd").time_bwd_s is None
