"""Plant a slowdown in an implementation for scripts/ab_validation.sh: `python ab_plant.py impls/NAME PCT`.

Every call returned by the implementation's `prepare` then spins for PCT% of the CPU time the call itself used
(and, when the output is differentiable, 2 x PCT% of it during backward, since backward costs about twice the
forward): extra work proportional to the implementation's own, whatever the case's size. CPU time of the
thread (time.thread_time), not wall time: on a loaded machine a call's wall time includes the time slices of
other processes, and PCT% of that would plant more than PCT% of work.
"""

from __future__ import annotations

import sys
from pathlib import Path

HOOK = '''

# --- planted by scripts/ab_plant.py: {pct}% slower (a throwaway branch, never merged) ---
import functools as _functools  # noqa: E402
import time as _time  # noqa: E402

_PLANTED = {pct} / 100


def _planted_spin(seconds):
    end = _time.thread_time() + seconds
    while _time.thread_time() < end:
        pass


def _planted(prepare):
    @_functools.wraps(prepare)
    def wrapper(self, *args, **kwargs):
        call = prepare(self, *args, **kwargs)

        def slowed():
            start = _time.thread_time()
            out = call()
            spent = _time.thread_time() - start
            _planted_spin(_PLANTED * spent)
            if getattr(out, "requires_grad", False):
                out.register_hook(lambda grad: (_planted_spin(2 * _PLANTED * spent), grad)[1])
            return out

        return slowed

    return wrapper


for _cls in [c for c in list(globals().values()) if isinstance(c, type) and "prepare" in vars(c)]:
    _cls.prepare = _planted(_cls.prepare)
'''


def main() -> int:
    target, pct = Path(sys.argv[1]), float(sys.argv[2])
    module = target / "__init__.py" if target.is_dir() else target.with_suffix(".py")
    module.write_text(module.read_text() + HOOK.format(pct=pct))
    return 0


if __name__ == "__main__":
    sys.exit(main())
