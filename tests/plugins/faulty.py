"""Planted implementations that misbehave in every way the runner must survive (loaded via `plugins:`)."""

import os
import signal
import time

import torch

from bench.registry import Impl, register


class _Planted(Impl):
    description = "planted fault for tests"

    def unsupported(self, case):
        return None  # every case, so the fault is what the test sees


@register
class Raises(_Planted):
    name = "fault_raise"

    def prepare(self, case, pattern, q, k, v):
        def call():
            raise RuntimeError("planted failure in the call")

        return call


@register
class ReturnsNan(_Planted):
    name = "fault_nan"

    def prepare(self, case, pattern, q, k, v):
        return lambda: torch.full_like(q, float("nan"))


@register
class WrongShape(_Planted):
    name = "fault_shape"

    def prepare(self, case, pattern, q, k, v):
        return lambda: q[:, :, :-1]


@register
class Hangs(_Planted):
    name = "fault_hang"

    def prepare(self, case, pattern, q, k, v):
        time.sleep(3600)
        return lambda: q


@register
class Aborts(_Planted):
    name = "fault_abort"

    def prepare(self, case, pattern, q, k, v):
        def call():
            os.abort()

        return call


@register
class KillsItsWorker(_Planted):
    name = "fault_sigkill"

    def prepare(self, case, pattern, q, k, v):
        os.kill(os.getpid(), signal.SIGKILL)
        return lambda: q


@register
class CudaStyleOom(_Planted):
    name = "fault_oom"

    def prepare(self, case, pattern, q, k, v):
        def call():
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB (planted)")

        return call


@register
class Wrong(_Planted):
    name = "fault_wrong"

    def prepare(self, case, pattern, q, k, v):
        return lambda: v * 1.5


@register
class StickyDeviceError(_Planted):
    name = "fault_sticky"

    def prepare(self, case, pattern, q, k, v):
        def call():
            raise RuntimeError("CUDA error: an illegal memory access was encountered (planted)")

        return call


@register
class SaysItsProcess(_Planted):
    """Correct dense attention whose record names the worker process that measured it."""

    name = "fault_pid"

    def prepare(self, case, pattern, q, k, v):
        from bench.registry import get

        self._pid = os.getpid()
        return get("dense").prepare(case, pattern, q, k, v)

    def record_extras(self):
        return {"pid": self._pid}
