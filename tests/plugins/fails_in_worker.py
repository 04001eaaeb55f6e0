"""A plugin that imports in the runner but fails inside the worker process (a dependency only the worker lacks,
say): the run must give a failed record with this error for each pair, not a traceback."""

import os
import sys

from bench.registry import Impl, register

if sys.argv and sys.argv[0].endswith(os.path.join("run", "worker.py")):
    raise ImportError("planted: this plugin cannot be imported in the worker (libfastattn.so not found)")


@register
class NeedsTheWorker(Impl):
    name = "needs_the_worker"

    def prepare(self, case, pattern, q, k, v):
        return lambda: q
