"""Gradient fidelity of a selection ([R4 3/6]): how far training through a selected attention moves q, k, v from
where dense attention would move them. dq, dk, dv of the float64 oracle under the selection's effective mask
against dense attention's under the base pattern, from the same upstream gradient (the case's seeded one, on the
oracle's checked rows): each tensor's relative L2 distance and cosine, computed once per case."""

from __future__ import annotations

import torch
from torch import Tensor

from bench.measure.case.case_cache import CaseCache
from bench.measure.case.prepare import StagedCase
from bench.measure.oracle.check import GRAD_NAMES, Grads, OracleResults, checked_rows, rows_only
from bench.measure.oracle.fidelity import fidelity
from bench.measure.oracle.reference import float64_grads, reference_attention
from bench.patterns import Pattern
from bench.results.records import FidelityInfo, GradFidelity
from bench.spec.case import Case


def dense_grads(case: Case, pattern: Pattern, q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor,
                oracle: OracleResults) -> Grads:
    """Dense attention's float64 dq, dk, dv under the base pattern for the checked rows' upstream gradient
    (kept in `oracle` for the case's next implementations)."""
    if oracle.grads is None:
        rows = checked_rows(case)
        g = rows_only(case, grad_out, rows)
        oracle.grads = float64_grads(q, k, v, g[:, :, rows.to(g.device)], lambda a, b, c: reference_attention(
            a, b, c, pattern, rows, **case.oracle_terms()))
    return oracle.grads


def gradient_fidelity(selected: Grads, dense: Grads) -> dict[str, GradFidelity]:
    """Per tensor: the selection's gradient's relative L2 distance from dense attention's, and their cosine."""
    out = {}
    for name, s, d in zip(GRAD_NAMES, selected, dense, strict=True):
        s64, d64 = s.detach().double().flatten(), d.detach().double().flatten().to(s.device)
        norm = float(torch.linalg.vector_norm(d64))
        rel = float(torch.linalg.vector_norm(s64 - d64)) / norm if norm > 0 else float(torch.linalg.vector_norm(s64))
        cos = float(torch.nn.functional.cosine_similarity(s64, d64, dim=0)) if norm > 0 else None
        out[name] = GradFidelity(rel_l2=rel, cosine=cos)
    return out


def case_fidelity(staged: StagedCase, cache: CaseCache) -> FidelityInfo:
    """A selection case's fidelity to dense attention under its base pattern (bench.measure.oracle.fidelity), with its
    gradients' in fwd_bwd: computed for the case's first implementation, kept in `cache` for the rest."""
    if cache.fidelity is None:
        assert cache.inputs is not None and staged.selection is not None
        cache.fidelity = fidelity(staged.selection, staged.pattern, cache.inputs, staged.case.seed)
        if staged.grad_out is not None and cache.oracle.selected_grads is not None:
            dense = dense_grads(staged.case, staged.pattern, staged.q, staged.k, staged.v, staged.grad_out,
                                cache.oracle)
            grads = gradient_fidelity(cache.oracle.selected_grads, dense)
            cache.fidelity = cache.fidelity.model_copy(update={"grads": grads})
    return cache.fidelity
