"""Correctness of one call: its output (and in fwd_bwd dq, dk, dv) against the float64 oracle (bench.measure.reference),
on the rows the oracle checks; in one process (`check_against_oracle`) or on rank 0 after gathering (`oracle_errors`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from bench import registry
from bench.measure.reference import compare, reference_attention, rows_to_check, tolerance_for
from bench.patterns import Pattern
from bench.spec.case import Case


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


def nonfinite_only(out: Tensor, tol: float) -> tuple[dict[str, Any], str | None]:
    """With `check: false`: only NaN and Inf are looked for."""
    nonfinite = int((~torch.isfinite(out.detach())).sum())
    error = {"max_abs": None, "rel_l2": None, "tolerance": tol, "rows_checked": 0, "nonfinite": nonfinite}
    return error, (f"output has {nonfinite} NaN/Inf values" if nonfinite else None)


def oracle_errors(case: Case, pattern: Pattern, q: Tensor, k: Tensor, v: Tensor, out: Tensor, tol: float,
                  grads: tuple[Tensor | None, ...] | None = None, g: Tensor | None = None,
                  oracle: dict[str, Any] | None = None) -> tuple[dict[str, Any], str | None]:
    """(error, problem or None) of the full output `out` (and of `grads` = dq, dk, dv for upstream gradient g on
    the checked rows) against the float64 oracle. `oracle` caches its results for the case's next impls."""
    oracle = {} if oracle is None else oracle
    rows = checked_rows(case)
    if "out" not in oracle:
        with torch.no_grad():
            oracle["out"] = reference_attention(q.detach(), k.detach(), v.detach(), pattern, rows,
                                                score_mod=case.make_score_mod())
    stats = compare(out.detach()[:, :, rows.to(out.device)], oracle["out"], tol)
    error: dict[str, Any] = {"max_abs": stats.max_abs, "rel_l2": stats.rel_l2, "tolerance": tol,
                             "rows_checked": stats.rows_checked, "nonfinite": stats.nonfinite}
    problem = None if stats.passed else _problem("output", stats.rel_l2, tol, stats.nonfinite)
    if grads is not None and g is not None:
        if "grads" not in oracle:
            q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
            ref = reference_attention(q64, k64, v64, pattern, rows, score_mod=case.make_score_mod())
            leaves = [q64, k64, v64]
            oracle["grads"] = torch.autograd.grad(ref, leaves, g[:, :, rows.to(g.device)].double())
        error["grads"] = {}
        for name, actual, expected in zip(("dq", "dk", "dv"), grads, oracle["grads"], strict=True):
            s = compare(torch.zeros_like(expected) if actual is None else actual, expected, tol)
            error["grads"][name] = {"max_abs": s.max_abs, "rel_l2": s.rel_l2, "tolerance": tol,
                                    "nonfinite": s.nonfinite}
            if problem is None and not s.passed:
                problem = _problem(name, s.rel_l2, tol, s.nonfinite)
    return error, problem


def check_against_oracle(case: Case, impl: registry.Impl, pattern: Pattern, q: Tensor, k: Tensor, v: Tensor,
                         out: Tensor, grad_out: Tensor | None, full: bool, oracle: dict[str, Any] | None = None
                         ) -> tuple[dict[str, Any], str | None]:
    """(error, problem or None) of one process's output (and gradients) against the float64 oracle."""
    tol = tolerance_for(case.dtype, impl.tf32(case))
    if not full:
        return nonfinite_only(out, tol)
    grads, g = None, None
    if grad_out is not None:
        g = rows_only(case, grad_out, checked_rows(case))
        grads = torch.autograd.grad(out, (q, k, v), g, allow_unused=True)
    return oracle_errors(case, pattern, q, k, v, out, tol, grads, g, oracle)
