"""Valid fields for every built-in pattern at any length: the tests' one place for pattern parameters.

Axial and neighborhood need seq_len = R*C; for them the row length C is the smallest divisor of n that is
at least sqrt(n), and neighborhood's kernel the largest odd size up to 5 that fits the image.
"""

from __future__ import annotations

import math
from typing import Any

from bench.patterns import PATTERNS, Pattern, make_pattern

BUILTIN = sorted(name for name, cls in PATTERNS.items() if cls.source == "built-in")
DEFAULTS: dict[str, Any] = dict(window=16, density=0.3, block_size=16, dilation=3, global_tokens=3, seed=11, prefix=20)


def row_length(n: int) -> int:
    return next(c for c in range(max(1, math.isqrt(n)), n + 1) if n % c == 0)


def valid_fields(name: str, n: int, **overrides: Any) -> dict[str, Any]:
    """DEFAULTS with `overrides`, adjusted so that pattern `name` is valid over n tokens."""
    fields = {**DEFAULTS, **overrides}
    fields["prefix"] = min(fields["prefix"], n)
    if name == "axial":
        fields["window"] = row_length(n) if n % fields["window"] else fields["window"]
    if name == "neighborhood":
        width = fields.get("image_width") or row_length(n)
        fields["image_width"] = width
        fits = [k for k in (1, 3, 5, 7) if k <= min(width, n // width)]
        fields["window"] = fields["window"] if fields["window"] in fits else max(fits)
    return fields


def zoo_pattern(name: str, n: int, **overrides: Any) -> Pattern:
    return make_pattern(name, n, **valid_fields(name, n, **overrides))
