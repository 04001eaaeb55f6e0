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
from bench.measure.check import check_against_oracle
from bench.measure.flops import useful_flops
from bench.measure.pair import CaseCache
from bench.measure.steps import call_inputs, prepare_call, skip_reason, timed_step
from bench.spec.case import Case, resolve_device


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def test_attention(benchmark: Any, pair: tuple[Case, str, Any], request: pytest.FixtureRequest) -> None:
    """The steps of bench.measure.pair (skip, pattern, inputs, prepare and first call, oracle check), then
    pytest-benchmark's timer instead of ours."""
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
    q, k, v, grad_out = call_inputs(case)
    try:
        prepared = prepare_call(impl, case, pattern, q, k, v)
    except Unavailable as exc:
        pytest.skip(exc.reason)
    error, problem = check_against_oracle(case, impl, pattern, q, k, v, prepared.first_output, grad_out,
                                          full=measure.check)
    assert problem is None, f"{impl_name} on {case.case_id}: {problem}"

    step = timed_step(prepared.fn, q, k, v, grad_out)
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
                                 "density": pattern.density, "rel_l2": error.get("rel_l2")})
    benchmark.pedantic(target, setup=setup, rounds=config.getoption("--bench-rounds") or measure.repeat,
                       warmup_rounds=measure.warmup, iterations=1)
