"""Running a definition's callable on a case, and holding its outputs to the float64 oracle.

`bench import` runs each workload's reference `run()` once on the case it became (`cross_check`): where the
reference and our oracle agree, the case measures what the definition specifies; where they do not, the mapping
(causality, scale, layout) or the reference is wrong, and the import says so. Implementations of definitions
(bench.interop.flashinfer.solutions) use `oracle` and `lse_check` for the log-sum-exp the harness does not check.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from pydantic import BaseModel
from torch import Tensor

from bench.inputs import make as make_inputs
from bench.inputs.paged import PagedKV, kv_lengths, page_kv
from bench.interop.flashinfer.compare import ElementCheck, element_check, to_base2
from bench.interop.flashinfer.entries import EntryError, reference_run
from bench.interop.flashinfer.layout import DTYPES, call_inputs, ours
from bench.interop.flashinfer.synth import Target
from bench.measure.oracle.reference import compare, reference_attention_lse, tolerance_for
from bench.spec.case import Case

# Above this many score elements (B * H * q_len * N) the import does not run the reference on the CPU: their
# references materialise every sequence's scores in float32 at once.
CROSS_CHECK_LIMIT = 2**27


class Agreement(BaseModel):
    """A definition's reference against the float64 oracle on one case."""

    output: ElementCheck  # FlashInfer-Bench's element rules (atol = rtol = 1e-2)
    output_rel_l2: float | None  # ours: the L2 norm of the error over the oracle's
    output_tolerance: float  # the case's dtype's rel_l2 tolerance
    lse: ElementCheck | None  # base 2, the rule for infinities of flashinfer-bench#429
    seconds: float  # the reference's one call

    @property
    def agrees(self) -> bool:
        rel_ok = self.output_rel_l2 is not None and self.output_rel_l2 <= self.output_tolerance
        return self.output.passed and rel_ok and (self.lse is None or self.lse.passed)

    def summary(self) -> str:
        lse = "" if self.lse is None else (f", lse max_abs {self.lse.max_absolute_error:.2g} (base 2; "
                                           f"{self.lse.inf_matched} -inf matched)")
        rel = "NaN" if self.output_rel_l2 is None else f"{self.output_rel_l2:.2g}"
        verdict = "agrees" if self.agrees else "DISAGREES"
        return (f"reference run() {verdict} with the float64 oracle: output rel_l2 {rel} (tolerance "
                f"{self.output_tolerance:g}), max_abs {self.output.max_absolute_error:.2g}{lse}; {self.seconds:.2f} s")


def logical_kv(kv: tuple[Tensor, Tensor] | PagedKV, like: Tensor, seq_len: int) -> tuple[Tensor, Tensor]:
    """Contiguous k, v (B, Hkv, N, D) of either form (a pool gathered back in order)."""
    if not isinstance(kv, PagedKV):
        return kv
    b, hkv, d = kv.page_table.shape[0], kv.k_pages.shape[1], kv.k_pages.shape[3]
    k = like.new_zeros(b, hkv, seq_len, d)
    v = like.new_zeros(b, hkv, seq_len, d)
    kv.gather_(k, v)
    return k, v


def oracle(case: Case, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """The float64 output (B, H, q_len, D) and natural LSE (B, H, q_len) of the case, each sequence over its own
    keys (kv_lens)."""
    if case.kv_lens is None:
        return reference_attention_lse(q, k, v, case.make_pattern())
    lengths = kv_lengths(case.kv_lens, case.batch, case.seq_len, case.n_queries, case.seed)
    outs, lses = [], []
    for b, n in enumerate(lengths):
        pattern = replace(case, seq_len=n, kv_lens=None, page_size=None).make_pattern()
        out, lse = reference_attention_lse(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n], pattern)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def normalise(result: Any, names: list[str]) -> list[Tensor]:
    """A callable's return value as the definition's outputs, in order. Raises ValueError."""
    got = list(result) if isinstance(result, tuple | list) else [result]
    if len(got) != len(names):
        raise ValueError(f"returned {len(got)} value(s); the definition's outputs are {names}")
    return got


def check_dtypes(target: Target, outputs: list[Tensor]) -> None:
    """TypeError naming an output in another dtype than the definition's."""
    for (name, spec), out in zip(target.definition.outputs.items(), outputs, strict=True):
        if not isinstance(out, Tensor) or out.dtype != DTYPES[spec.dtype]:
            got = out.dtype if isinstance(out, Tensor) else type(out).__name__
            raise TypeError(f"output {name} has dtype {got}; the definition's is {spec.dtype}")


def lse_check(case: Case, q: Tensor, kv: tuple[Tensor, Tensor] | PagedKV, lse: Tensor) -> ElementCheck:
    """Their LSE (total_q, H), base 2, against the oracle's by their rules."""
    k, v = logical_kv(kv, q, case.seq_len)
    _, expected = oracle(case, q, k, v)
    return element_check(ours(lse, case, "lse", lse=True), to_base2(expected))


def case_tensors(case: Case) -> tuple[Tensor, tuple[Tensor, Tensor] | PagedKV, Tensor, Tensor]:
    """The case's inputs as the harness makes them on the CPU: q, what the implementation reads (k, v or the
    pool), and the logical k, v."""
    made = make_inputs(case.inputs, case.inputs_shape(), case.seed, case.torch_dtype, "cpu")
    if case.page_size is None:
        return made.q, (made.k, made.v), made.k, made.v
    lengths = kv_lengths(case.kv_lens, case.batch, case.seq_len, case.n_queries, case.seed)
    return made.q, page_kv(made.k, made.v, case.page_size, lengths, case.seed), made.k, made.v


def cross_check(case: Case, target: Target, run: Callable[..., Any] | None = None) -> Agreement | str:
    """The definition's reference (or `run`) on the case against the oracle; a string says why it could not run."""
    size = case.batch * case.heads * case.n_queries * case.seq_len
    if size > CROSS_CHECK_LIMIT:
        return f"not run: {size} score elements, more than the {CROSS_CHECK_LIMIT} a CPU cross-check takes"
    try:
        fn = run if run is not None else reference_run(target.definition)
        q, kv, k, v = case_tensors(case)
        names = list(target.definition.outputs)
        started = time.perf_counter()
        outputs = normalise(fn(*call_inputs(target.definition, target.layout, case, q, kv)), names)
        seconds = time.perf_counter() - started
        check_dtypes(target, outputs)
        output = ours(outputs[names.index("output")], case, "output")
    except EntryError as exc:
        return f"{exc.field}: {exc.message}"
    except Exception as exc:  # the reference is the dataset's code: whatever it raises is its answer
        return f"the reference raised {type(exc).__name__}: {exc}"
    expected, expected_lse = oracle(case, q, k, v)
    tol = tolerance_for(case.dtype)
    stats = compare(output, expected, tol)
    lse = None
    if "lse" in names:
        lse = element_check(ours(outputs[names.index("lse")], case, "lse", lse=True), to_base2(expected_lse))
    return Agreement(output=element_check(output, expected), output_rel_l2=stats.rel_l2, output_tolerance=tol,
                     lse=lse, seconds=seconds)
