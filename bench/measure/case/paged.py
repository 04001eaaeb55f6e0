"""The steps of a case with a paged KV cache (`page_size`): the pool, the call through it, the per-sequence check.

The case's logical inputs are made as for any case; the pool and page table (bench.inputs.paged) are made from
them once per case, untimed. An implementation that reads a page table (`Impl.paged_native`) gets the pool; the
others get contiguous K/V gathered back from the pool inside their timed call, as a user of such an
implementation would have to (that copy is part of its cost). Sequences of their own lengths (`kv_lens`) have
their own patterns (each sequence's queries are its last q_len positions); only implementations that read a
page table take them, and the oracle checks each sequence against its own pattern.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from bench import registry
from bench.errors import Unavailable
from bench.inputs.paged import PagedKV, kv_lengths, page_kv
from bench.measure.case import flops as flop_counts
from bench.measure.case.steps import Phase, Prepared, checkpointed, set_up
from bench.measure.oracle.check import nonfinite_only
from bench.measure.oracle.reference import compare, reference_attention, tolerance_for
from bench.patterns import Pattern
from bench.results.records import ErrorInfo
from bench.spec.case import Case

if TYPE_CHECKING:
    from bench.measure.case.case_cache import CaseCache


def case_paged(case: Case, k: Tensor, v: Tensor, cache: CaseCache) -> PagedKV:
    """The case's pool and page table made from its logical k, v (B, Hkv, N, D), once (kept in `cache`)."""
    if cache.paged is None:
        lengths = kv_lengths(case.kv_lens, case.batch, case.seq_len, case.n_queries, case.seed)
        cache.paged = page_kv(k, v, int(case.page_size or 1), lengths, case.seed)
    return cache.paged


def sequence_patterns(case: Case, paged: PagedKV) -> list[Pattern] | None:
    """One pattern per sequence of its own length, or None when every sequence has seq_len keys."""
    if case.kv_lens is None:
        return None
    from dataclasses import replace

    return [replace(case, seq_len=int(n), kv_lens=None, page_size=None).make_pattern() for n in paged.kv_lens]


def paged_kv_rows(case: Case, pattern: Pattern, patterns: list[Pattern] | None) -> int:
    """`min_bytes`' kv_rows over the sequences' own patterns."""
    if patterns is None:
        return flop_counts.pattern_kv_rows(case, pattern)
    one = Case(**{**case.params(), "batch": 1, "kv_lens": None, "page_size": None})
    return sum(flop_counts.pattern_kv_rows(one, p) for p in patterns)


def set_up_paged(impl: registry.Impl, case: Case, pattern: Pattern, q: Tensor, k: Tensor, v: Tensor,
                 paged: PagedKV, patterns: list[Pattern] | None, phase: Phase) -> Prepared:
    """The implementation's call over the paged cache, after its first run. Raises what it raises, and
    Unavailable for sequences of their own lengths on an implementation that takes one pattern."""
    if impl.paged_native(case):
        return set_up(lambda: impl.prepare_paged(case, pattern.fresh(), q, paged, patterns), impl, case, phase)
    if patterns is not None:
        raise Unavailable(f"{impl.name} takes one pattern for the whole batch: sequences of their own lengths "
                          "(kv_lens) need an implementation that reads a page table per sequence")
    k_buf, v_buf = torch.empty_like(k), torch.empty_like(v)

    def make() -> Any:
        paged.gather_(k_buf, v_buf)
        fn = impl.prepare(case, pattern.fresh(), q, k_buf, v_buf)
        fn = checkpointed(fn) if case.checkpoint else fn

        def gathered() -> Tensor:
            paged.gather_(k_buf, v_buf)  # the pages back in order, inside the timed call
            return fn()

        return gathered

    return set_up(make, impl, case, phase)


def check_sequences(case: Case, impl: registry.Impl, patterns: list[Pattern], q: Tensor, k: Tensor, v: Tensor,
                    out: Tensor, full: bool) -> tuple[ErrorInfo, str | None]:
    """(error, problem) of sequences of their own lengths: each sequence against the oracle under its pattern
    over its own keys (every query row: decode and short chunks, the shapes paged caches hold)."""
    tol = tolerance_for(case.dtype, impl.tf32(case))
    if not full:
        return nonfinite_only(out, tol)
    expected = torch.cat([reference_attention(q[b : b + 1].detach(), k[b : b + 1, :, : p.seq_len].detach(),
                                              v[b : b + 1, :, : p.seq_len].detach(), p,
                                              sinks=case.sink_logits())
                          for b, p in enumerate(patterns)])
    stats = compare(out.detach(), expected, tol)
    error = ErrorInfo(max_abs=stats.max_abs, rel_l2=stats.rel_l2, max_rel=stats.max_rel, tolerance=tol,
                      rows_checked=stats.rows_checked,
                      nonfinite=stats.nonfinite)
    problem = None if stats.passed else (f"output has {stats.nonfinite} NaN/Inf values" if stats.nonfinite else
                                         f"output off the float64 oracle (each sequence under its own length): "
                                         f"rel_l2 {stats.rel_l2:.3g} > tolerance {tol:g}")
    return error, problem
