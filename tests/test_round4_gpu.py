"""Round 4's paths on a CUDA GPU: the field's numerics rule (each of out, dq, dk, dv within 2x the error of a
same-dtype PyTorch reference, both against float64) for the compiled kernels at a GPU-sized grouped-query case,
and the model swap (bench.api.swap_attention) with micro-mqar moved to the GPU. Their CPU counterparts are
tests/test_numerics.py and tests/test_quality_swap.py. Run with `pytest -m gpu`."""

from __future__ import annotations

import pytest
import torch

from bench.measure.case.case_cache import CaseCache
from bench.measure.pair import Task, measure_task
from bench.spec.case import Case

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

QUICK = {"warmup": 0, "repeat": 1, "max_time_s": 0.001, "memory": "worker"}
SHAPES = {  # GQA 4:1, a length that is a multiple of no tile side; a chunk of query rows over a window
    "gqa_causal_n1000": {"pattern": "causal", "seq_len": 1000, "heads": 8, "kv_heads": 2},
    "local_rows333_n1000": {"pattern": "local", "window": 200, "seq_len": 1000, "q_len": 333, "heads": 8},
}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("impl", ["triton_block_sparse", "sdpa", "flex"])
def test_gradients_within_twice_the_same_dtype_reference_on_the_gpu(impl, shape):
    if impl == "flex" and shape != "gqa_causal_n1000":
        pytest.skip("flex compiles per shape: one shape is enough for the GPU check's budget")
    case = Case(head_dim=128, block_size=128, dtype="bfloat16", mode="fwd_bwd", device="cuda", **SHAPES[shape])
    record = measure_task(Task.of(case, impl, QUICK), CaseCache())
    assert record.status == "ok", record.reason
    error = record.error
    assert error is not None and error.grads is not None and error.reference_rel_l2 is not None
    ratios = {"out": error.ratio, **{name: g.ratio for name, g in error.grads.items()}}
    assert all(r is not None and r <= 2.0 for r in ratios.values()), ratios
    assert record.time_fwd_s is not None and record.time_bwd_s is not None


def test_micro_mqar_answers_through_the_compiled_kernel_as_through_its_own_attention():
    pytest.importorskip("transformers")
    from bench import api
    from bench.measure.quality.evaluate import load_model
    from bench.models.mqar import correct, make_batch

    model = load_model("micro-mqar", "float32", "cuda")
    batch = make_batch(1024, 4, seed=11)
    with torch.no_grad():
        own = correct(model, batch)
        with api.swap_attention(model, "triton_block_sparse", pattern="causal", block_size=64) as swap:
            swapped = correct(model, batch)
        with api.swap_attention(model, "triton_block_sparse", pattern="causal_local", window=64) as local:
            windowed = correct(model, batch)
    assert swap.calls > 0 and local.calls > 0
    assert own.float().mean() > 0.9  # the card's dense accuracy at 1024 is 1.0
    # the whole causal context: the same answers, give or take one (the kernel multiplies float32 as TF32)
    assert int((swapped != own).sum()) <= 1
    assert windowed.float().mean() < own.float().mean()  # a 64-token window cannot reach the far keys
