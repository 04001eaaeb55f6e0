"""Correctness of one call: its output (and in fwd_bwd dq, dk, dv) against the float64 oracle
(bench.measure.oracle.reference), on the rows the oracle checks; in one process (`check_against_oracle`) or on
rank 0 after gathering (`oracle_errors`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from bench import registry
from bench.measure.oracle.numerics import ReferenceErrors, ratio, reference_errors, verdict
from bench.measure.oracle.reference import compare, float64_grads, reference_attention, rows_to_check, tolerance_for
from bench.patterns import Pattern
from bench.results.records import ErrorInfo, GradError
from bench.spec.case import Case

Grads = tuple[Tensor, Tensor, Tensor]  # dq, dk, dv
GRAD_NAMES = ("dq", "dk", "dv")


@dataclass
class OracleResults:
    """The float64 oracle's answers on the checked rows: computed for a case's first implementation, compared with
    by the rest (bench.measure.case.case_cache keeps them)."""

    out: Tensor | None = None  # (B, H, rows, D) under the case's pattern
    grads: Grads | None = None  # of the checked rows' upstream gradient
    selected_out: tuple[Tensor, Tensor] | None = None  # (output, lse) under a selection's effective mask
    selected_grads: Grads | None = None
    reference: ReferenceErrors | None = None  # the same-dtype reference's errors (bench.measure.oracle.numerics)
    selected_reference: ReferenceErrors | None = None


def _problem(what: str, rel_l2: float | None, tol: float, nonfinite: int) -> str:
    if nonfinite:
        return f"{what} has {nonfinite} NaN/Inf values"
    return f"{what} off the float64 oracle: rel_l2 {rel_l2:.3g} > tolerance {tol:g}"


def checked_rows(case: Case) -> Tensor:
    return rows_to_check(case.batch, case.heads, case.seq_len, seed=case.seed, q_len=case.n_queries)


def rows_only(case: Case, grad_out: Tensor, rows: Tensor) -> Tensor:
    """The upstream gradient on the checked rows only: the full problem's dq, dk, dv then equal the oracle's."""
    row_mask = torch.zeros(case.n_queries, dtype=torch.bool, device=grad_out.device)
    row_mask[rows.to(grad_out.device)] = True
    return grad_out * row_mask[:, None].to(grad_out.dtype)


def nonfinite_only(out: Tensor, tol: float) -> tuple[ErrorInfo, str | None]:
    """With `check: false`: only NaN and Inf are looked for."""
    nonfinite = int((~torch.isfinite(out.detach())).sum())
    error = ErrorInfo(max_abs=None, rel_l2=None, tolerance=tol, rows_checked=0, nonfinite=nonfinite)
    return error, (f"output has {nonfinite} NaN/Inf values" if nonfinite else None)


def grad_errors(grads: tuple[Tensor | None, ...], expected: Grads, tol: float, what: str = "the float64 oracle",
                reference: ReferenceErrors | None = None, dtype: str = "float32"
                ) -> tuple[dict[str, GradError], str | None]:
    """Each of dq, dk, dv against the oracle's (a missing gradient counts as zeros), beside the same-dtype
    reference's error where known; the first problem."""
    errors: dict[str, GradError] = {}
    problem = None
    refs = reference.grads if reference is not None and reference.grads is not None else (None, None, None)
    for name, actual, exp, ref in zip(GRAD_NAMES, grads, expected, refs, strict=True):
        s = compare(torch.zeros_like(exp) if actual is None else actual, exp, tol)
        errors[name] = GradError(max_abs=s.max_abs, rel_l2=s.rel_l2, tolerance=tol, nonfinite=s.nonfinite,
                                 reference_rel_l2=ref, ratio=ratio(s.rel_l2, ref, dtype))
        if problem is None and not s.passed:
            problem = _problem(name, s.rel_l2, tol, s.nonfinite).replace("the float64 oracle", what)
    return errors, problem


def oracle_errors(case: Case, pattern: Pattern, q: Tensor, k: Tensor, v: Tensor, out: Tensor, tol: float,
                  grads: tuple[Tensor | None, ...] | None = None, g: Tensor | None = None,
                  oracle: OracleResults | None = None) -> tuple[ErrorInfo, str | None]:
    """(error, problem or None) of the full output `out` (and of `grads` = dq, dk, dv for upstream gradient g on
    the checked rows) against the float64 oracle. `oracle` caches its results for the case's next impls."""
    oracle = OracleResults() if oracle is None else oracle
    rows = checked_rows(case)
    if oracle.out is None:
        with torch.no_grad():
            oracle.out = reference_attention(q.detach(), k.detach(), v.detach(), pattern, rows,
                                             **case.oracle_terms())
    stats = compare(out.detach()[:, :, rows.to(out.device)], oracle.out, tol)
    problem = None if stats.passed else _problem("output", stats.rel_l2, tol, stats.nonfinite)
    grad_info = None
    backward = grads is not None and g is not None
    if backward and oracle.grads is None:
        assert g is not None
        oracle.grads = float64_grads(q, k, v, g[:, :, rows.to(g.device)], lambda a, b, c: reference_attention(
            a, b, c, pattern, rows, **case.oracle_terms()))
    if oracle.reference is None or (backward and oracle.reference.grads is None):
        oracle.reference = reference_errors(q, k, v, pattern, rows, oracle.out, None, g if backward else None,
                                            oracle.grads if backward else None, **case.oracle_terms())
    if backward:
        assert grads is not None and oracle.grads is not None
        grad_info, grad_problem = grad_errors(grads, oracle.grads, tol, reference=oracle.reference,
                                              dtype=case.dtype)
        problem = problem or grad_problem
    error = with_numerics(ErrorInfo(max_abs=stats.max_abs, rel_l2=stats.rel_l2, max_rel=stats.max_rel,
                                    tolerance=tol,
                                    rows_checked=stats.rows_checked, nonfinite=stats.nonfinite, grads=grad_info),
                          oracle.reference, case.dtype)
    return error, problem


def with_numerics(error: ErrorInfo, reference: ReferenceErrors | None, dtype: str) -> ErrorInfo:
    """`error` with the output's (and the lse's, where it has one) ratio to the same-dtype reference and the
    verdict over every tensor (bench.measure.oracle.numerics)."""
    if reference is None:
        return error
    out_ratio = ratio(error.rel_l2, reference.out, dtype)
    lse_ratio = ratio(error.lse_rel_l2, reference.lse, dtype) if error.lse_rel_l2 is not None else None
    ratios = [out_ratio, lse_ratio, *(g.ratio for g in (error.grads or {}).values())]
    return error.model_copy(update={"reference_rel_l2": reference.out, "ratio": out_ratio,
                                    "lse_reference_rel_l2": reference.lse if lse_ratio is not None else None,
                                    "lse_ratio": lse_ratio, "numerics": verdict(ratios)})


def check_against_oracle(case: Case, impl: registry.Impl, pattern: Pattern, q: Tensor, k: Tensor, v: Tensor,
                         out: Tensor, grad_out: Tensor | None, full: bool, oracle: OracleResults | None = None
                         ) -> tuple[ErrorInfo, str | None]:
    """(error, problem or None) of one process's output (and gradients) against the float64 oracle."""
    tol = tolerance_for(case.dtype, impl.tf32(case))
    if not full:
        return nonfinite_only(out, tol)
    grads, g = None, None
    if grad_out is not None:
        g = rows_only(case, grad_out, checked_rows(case))
        grads = torch.autograd.grad(out, (q, k, v), g, allow_unused=True)
    return oracle_errors(case, pattern, q, k, v, out, tol, grads, g, oracle)
