"""Notes each gather of a paged cache back into contiguous K/V (what an implementation that cannot read a page
table gets inside its timed call), in the file named by BENCH_TEST_TRACE (`<event> <pid>` lines, as traced.py):
loaded as a plugin, it is imported in every worker and rank process, so tests/test_prepare_case.py sees which
processes read through the table. Standalone: a plugin file importing another is registered twice."""

from __future__ import annotations

import os

from bench.inputs.paged import PagedKV

_gather = PagedKV.gather_


def _traced_gather(self, k_out, v_out):
    path = os.environ.get("BENCH_TEST_TRACE")
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.write(f"gather {os.getpid()}\n")
    return _gather(self, k_out, v_out)


PagedKV.gather_ = _traced_gather  # type: ignore[method-assign]
