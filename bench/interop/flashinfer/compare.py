"""FlashInfer-Bench's correctness rules, applied to their outputs against our float64 oracle.

Their evaluator (flashinfer_bench.bench.utils.compute_error_stats) counts an element as off when both its
absolute error exceeds atol and its relative error (|x - y| / (|y| + 1e-8)) exceeds rtol (1e-2 each by
default), and passes when the share of matched elements reaches required_matched_ratio (1.0 by default;
flashinfer-bench#178 made it configurable). flashinfer-bench#429's rule for infinities, which bottom-right
causal attention produces as the LSE of a row with no key (and zeros as its output): the same infinity on both
sides matches; finite against infinite, opposite infinities, and NaN anywhere do not, whatever the ratio.
"""

from __future__ import annotations

import math

import torch
from pydantic import BaseModel
from torch import Tensor

ATOL = RTOL = 1e-2
EPS = 1e-8


class ElementCheck(BaseModel):
    """Their statistics of one output against ours: errors over the finite pairs, the matched share, the
    infinities matched and the non-finite mismatches."""

    max_absolute_error: float
    max_relative_error: float
    matched_ratio: float
    inf_matched: int  # same-sign infinities on both sides (rows with no key: LSE -inf)
    nonfinite_mismatched: int  # finite vs infinite, opposite infinities, NaN
    elements: int
    passed: bool


def element_check(actual: Tensor, expected: Tensor, required_matched_ratio: float = 1.0) -> ElementCheck:
    """`actual` against `expected` (same shape) by their rules (module docstring)."""
    x, y = actual.detach().to(torch.float64).cpu(), expected.detach().to(torch.float64).cpu()
    both_inf = torch.isinf(x) & torch.isinf(y) & (torch.sign(x) == torch.sign(y))
    finite = torch.isfinite(x) & torch.isfinite(y)
    mismatched = int((~(both_inf | finite)).sum())
    abs_err = (x - y).abs()[finite]
    rel_err = abs_err / (y.abs()[finite] + EPS)
    off = int(((abs_err > ATOL) & (rel_err > RTOL)).sum()) + mismatched
    total = x.numel()
    ratio = 1.0 - off / total if total else 1.0
    return ElementCheck(max_absolute_error=float(abs_err.max()) if abs_err.numel() else 0.0,
                        max_relative_error=float(rel_err.max()) if rel_err.numel() else 0.0,
                        matched_ratio=ratio, inf_matched=int(both_inf.sum()), nonfinite_mismatched=mismatched,
                        elements=total, passed=mismatched == 0 and ratio >= required_matched_ratio)


def to_base2(lse_natural: Tensor) -> Tensor:
    """Our oracle's natural log-sum-exp in FlashInfer's base 2 (-inf stays -inf)."""
    return lse_natural / math.log(2.0)
