"""One pytest-benchmark test per (case, impl) of a suite, timed with device synchronisation.

Each test builds the case's seeded inputs, runs the implementation's untimed `prepare`, checks the output
(and gradients in mode fwd_bwd) against the float64 oracle - a wrong kernel fails instead of being timed -
and then lets pytest-benchmark time the call with `pedantic`: on CUDA every round starts after an L2 flush and
a synchronize (untimed setup) and ends with a synchronize, so the host timer spans the device work.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from bench import registry
from bench.errors import Unavailable
from bench.measure.case.case_cache import CaseCache
from bench.measure.case.flops import useful_flops
from bench.measure.case.prepare import prepare
from bench.measure.case.steps import call_inputs, make_inputs, skip_reason
from bench.spec.case import Case, resolve_device


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def test_attention(benchmark: Any, pair: tuple[Case, str, Any], request: pytest.FixtureRequest) -> None:
    """The steps of bench.measure.pair (skip, pattern, inputs, the case prepared by its kind, the first call's
    oracle check), then pytest-benchmark's timer instead of ours."""
    case, impl_name, measure = pair
    config = request.config
    case = case.with_device(resolve_device(config.getoption("--bench-device") or case.device))
    if case.world_size > 1:
        pytest.skip("world_size > 1 runs under `bench run` (one process per rank)")
    impl = registry.get(impl_name)
    reason = skip_reason(impl, case)
    if reason:
        pytest.skip(reason)

    cache = CaseCache()
    pattern = cache.for_case(case)
    cache.inputs = make_inputs(case)
    q, k, v, grad_out = call_inputs(case, cache.inputs)
    try:  # the selection case with its selector, the paged case through its page table (bench.measure.case.prepare)
        prepared = prepare(impl, case, pattern, q, k, v, grad_out, cache)
    except Unavailable as exc:
        pytest.skip(exc.reason)
    error, problem = prepared.check(measure.check, cache.oracle)
    assert problem is None, f"{impl_name} on {case.case_id}: {problem}"

    step = prepared.step
    flush = None
    if case.device == "cuda":
        from bench.measure.timing import CudaTimer

        flush = CudaTimer().flush_l2

    def setup() -> None:  # untimed, before every round
        if flush is not None:
            flush()
        _synchronize(case.device)

    def target() -> None:
        step()
        _synchronize(case.device)

    benchmark.extra_info.update({"case_id": case.case_id, "impl": impl_name, "device": case.device,
                                 "flops": useful_flops(case, pattern.nnz),
                                 "density": pattern.density, "rel_l2": error.rel_l2,
                                 "kind": prepared.kind})
    benchmark.pedantic(target, setup=setup, rounds=config.getoption("--bench-rounds") or measure.repeat,
                       warmup_rounds=measure.warmup, iterations=1)
