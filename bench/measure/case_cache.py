"""What a case's implementations share in one process: its pattern, inputs and oracle, built once per case."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bench.inputs import CaseInputs
from bench.measure.attention_stats import attention_statistics
from bench.measure.check import checked_rows
from bench.patterns import Pattern
from bench.spec.case import Case


@dataclass
class CaseCache:
    """Pattern, inputs and oracle of the case measured last, shared by its implementations."""

    key: str | None = None
    pattern: Pattern | None = None
    inputs: CaseInputs | None = None
    oracle: dict[str, Any] = field(default_factory=dict)

    def input_bytes(self, case: Case) -> int:
        """Bytes of this case's inputs already allocated (0 when another case's are cached)."""
        if self.key != f"{case.case_id}@{case.device}" or self.inputs is None:
            return 0
        return sum(t.numel() * t.element_size() for t in self.inputs.tensors)

    def for_case(self, case: Case) -> Pattern:
        key = f"{case.case_id}@{case.device}"
        if key != self.key or self.pattern is None:
            self.key, self.pattern, self.inputs, self.oracle = None, None, None, {}
            self.pattern = case.make_pattern()
            self.key = key
        return self.pattern


def case_attention_stats(case: Case, pattern: Pattern, cache: CaseCache) -> dict[str, Any]:
    """The attention statistics of the case's inputs on the oracle's rows, computed once per case."""
    if "attention_stats" not in cache.oracle:
        assert cache.inputs is not None
        stats = attention_statistics(cache.inputs.q, cache.inputs.k, pattern, checked_rows(case), case.block_size)
        cache.oracle["attention_stats"] = {k: v for k, v in stats.items() if k != "by_head"}
    return cache.oracle["attention_stats"]
