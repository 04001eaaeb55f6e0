"""Numerics against a same-dtype reference ([R4 3/6], bench.measure.oracle.numerics): every implementation that takes
fwd_bwd keeps out, dq, dk, dv within 2x the same-dtype PyTorch reference's error in float32 and bfloat16, with
grouped-query heads, odd lengths and fewer query rows; a planted kernel inside the fixed tolerance is flagged,
the reference's own math is not, and `measure: {numerics: strict}` makes the flag an incorrect record."""

from __future__ import annotations

import pytest

from bench import registry
from bench.measure.case.case_cache import CaseCache
from bench.measure.oracle.numerics import ROUNDING_FLOOR, ratio
from bench.measure.pair import Task, measure_task
from bench.spec.case import Case
from bench.spec.plugins import load_plugin
from tests.conftest import PLUGINS

QUICK = {"warmup": 0, "repeat": 1, "max_time_s": 0.001, "memory": "worker"}
SHAPES = {"gqa_causal_n77": {"pattern": "causal", "seq_len": 77, "heads": 4, "kv_heads": 2},
          "local_rows33_n77": {"pattern": "local", "window": 24, "seq_len": 77, "q_len": 33, "heads": 2}}
FWD_BWD = sorted(i.name for i in registry.all_impls() if i.fwd_bwd)


def _record(impl: str, dtype: str, shape: str, mode: str = "fwd_bwd", **measure):
    case = Case(head_dim=32, block_size=16, dtype=dtype, mode=mode, device="cpu", **SHAPES[shape])
    return measure_task(Task.of(case, impl, {**QUICK, **measure}), CaseCache())


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("impl", FWD_BWD)
def test_gradients_within_twice_the_same_dtype_reference(impl, dtype, shape):
    record = _record(impl, dtype, shape)
    if record.status == "skipped":
        assert impl == "flex" or (impl.startswith(("cp_", "tp_")) and "q_len" in str(record.reason)), record.reason
        return
    assert record.status == "ok", record.reason
    error = record.error
    assert error is not None and error.grads is not None and error.reference_rel_l2 is not None
    ratios = {"out": error.ratio, **{name: g.ratio for name, g in error.grads.items()}}
    assert all(r is not None and r <= 2.0 for r in ratios.values()), ratios
    assert error.numerics == "ok"
    for name, g in error.grads.items():  # the ratio is what it says: our error over the reference's (floored)
        assert g.ratio == pytest.approx(g.rel_l2 / max(g.reference_rel_l2, ROUNDING_FLOOR[dtype])), name


def test_a_kernel_rounding_twice_is_flagged_inside_the_tolerance_and_the_reference_math_is_not():
    load_plugin(str(PLUGINS / "planted_rounding.py"), base_dir=None, file="test", field="plugins")
    planted = _record("test_rounds_twice", "bfloat16", "gqa_causal_n77", mode="fwd")
    assert planted.status == "ok" and planted.error is not None  # the fixed tolerance passes it
    assert planted.error.rel_l2 < planted.error.tolerance
    assert planted.error.ratio > 2.0 and planted.error.numerics == "worse_than_reference"
    dense = _record("dense", "bfloat16", "gqa_causal_n77", mode="fwd")
    assert dense.error is not None and dense.error.numerics == "ok" and dense.error.ratio <= 1.0
    strict = _record("test_rounds_twice", "bfloat16", "gqa_causal_n77", mode="fwd", numerics="strict")
    assert strict.status == "incorrect" and "the same-dtype reference's error" in str(strict.reason)


def test_the_rounding_floor_keeps_an_exact_reference_from_failing_everyone():
    assert ratio(3e-8, 1e-12, "float32") == pytest.approx(3e-8 / 2**-24)  # below the floor: judged against u
    assert ratio(0.01, 0.004, "bfloat16") == pytest.approx(2.5)
    assert ratio(None, 0.004, "bfloat16") is None


def test_compare_says_when_a_commit_makes_a_kernels_ratio_worse():
    from bench.analysis.figures import figure_changes
    from tests.synthetic import record

    base = record("c", "blocked", [1e-3] * 5)
    assert base.error is not None
    ok = base.model_copy(update={"error": base.error.model_copy(update={"ratio": 1.1, "numerics": "ok"})})
    worse = base.model_copy(update={"error": base.error.model_copy(update={"ratio": 1.6, "numerics": "ok"})})
    flagged = base.model_copy(update={"error": base.error.model_copy(update={"ratio": 2.6,
                                                                             "numerics": "worse_than_reference"})})
    assert {c.figure: c.kind for c in figure_changes([ok], [worse])} == {"error.ratio": "worse"}
    kinds = {c.figure: c.kind for c in figure_changes([ok], [flagged])}
    assert kinds == {"error.ratio": "worse", "error.numerics": "regression"}
    assert {c.figure: c.kind for c in figure_changes([flagged], [ok])}["error.numerics"] == "improvement"
