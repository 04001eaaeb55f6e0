"""A plugin (`plugins: [bench.interop.flashinfer.plugin]`): registers `flashinfer_reference`, and the solutions of
every dataset named in BENCH_FLASHINFER_SOLUTIONS (os.pathsep-separated roots).

`bench run SUITE --solutions ROOT` sets that variable, which every child process inherits, and adds this module
to the suite's plugins, so that the workers (and the fresh processes that read memory) register the same
solutions as the command did. A suite written by `bench import` names this module and a plugin file of its own
that registers the dataset's solutions by path.
"""

from __future__ import annotations

import os

from bench.interop.flashinfer import solutions

SOLUTIONS_ENV = "BENCH_FLASHINFER_SOLUTIONS"
REGISTERED = [name for root in os.environ.get(SOLUTIONS_ENV, "").split(os.pathsep) if root
              for name in solutions.register_solutions(root)]
