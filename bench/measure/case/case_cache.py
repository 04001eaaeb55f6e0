"""What a case's implementations share in one process: its pattern, inputs, selection or paged cache, and the
float64 oracle's answers, each built once per case and kept for the case's next implementation."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from bench.inputs import CaseInputs
from bench.inputs.paged import PagedKV
from bench.measure.oracle.attention_stats import attention_statistics
from bench.measure.oracle.check import OracleResults, checked_rows
from bench.patterns import Pattern
from bench.results.records import AttentionStats, FidelityInfo, TimeStats
from bench.selection import Selection
from bench.spec.case import Case


@dataclass
class CaseCache:
    """Everything the case measured last shares with its next implementation (one case at a time)."""

    key: str | None = None
    pattern: Pattern | None = None
    inputs: CaseInputs | None = None
    oracle: OracleResults = field(default_factory=OracleResults)
    selection: Selection | None = None  # a selection case's selection, made once and validated
    paged: PagedKV | None = None  # a paged case's pool and page table
    fidelity: FidelityInfo | None = None
    attention_stats: AttentionStats | None = None
    reference_selector_time: TimeStats | None = None  # a reference selector is timed once per case
    # the values timed calls cycle through (bench.measure.timed_check): set 0 the case's own, then the others
    input_sets: list[tuple[Tensor, ...]] | None = None
    set_oracles: dict[tuple[str, int], OracleResults] = field(default_factory=dict)  # (step, set) -> answers
    set_selections: dict[int, Selection] = field(default_factory=dict)  # the selector's choice of each set

    def input_bytes(self, case: Case) -> int:
        """Bytes of this case's inputs already allocated (0 when another case's are cached)."""
        if self.key != _key(case) or self.inputs is None:
            return 0
        return sum(t.numel() * t.element_size() for t in self.inputs.tensors)

    def for_case(self, case: Case) -> Pattern:
        """The case's pattern (made here when the case changes, which forgets everything of the last one)."""
        if self.key != _key(case) or self.pattern is None:
            self.forget()
            self.pattern = case.make_pattern()
            self.key = _key(case)
        return self.pattern

    def forget(self) -> None:
        """Drop everything (a pattern that failed half-way is not kept for the next implementation)."""
        fresh = CaseCache()
        self.__dict__.update(fresh.__dict__)


def _key(case: Case) -> str:
    return f"{case.case_id}@{case.device}"


def case_attention_stats(case: Case, pattern: Pattern, cache: CaseCache) -> AttentionStats:
    """The attention statistics of the case's inputs on the oracle's rows, computed once per case."""
    if cache.attention_stats is None:
        assert cache.inputs is not None
        stats = attention_statistics(cache.inputs.q, cache.inputs.k, pattern, checked_rows(case), case.block_size)
        cache.attention_stats = AttentionStats.model_validate({k: v for k, v in stats.items() if k != "by_head"})
    return cache.attention_stats
