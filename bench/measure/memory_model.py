"""A memory model: skip a case that cannot fit before running it, with the reason and the modelled bytes.

Modelled bytes = the inputs q (B, H, q_len, D) and k, v (B, Hkv, N, D), the output, in mode fwd_bwd the
upstream gradient and dq, dk, dv, plus the implementation's own lower bound (`Impl.memory_bytes`, e.g. the
(B, H, q_len, N) scores of dense attention). It is a lower bound, so a skipped case certainly would not have
fit; a case the model lets through can still run out of memory, which bench.measure.pair records as `failed`
"out of memory" and the sweep goes on.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.console.format import format_gib
from bench.registry import Impl
from bench.spec.case import Case


def tensor_bytes(case: Case) -> int:
    """Bytes of one (B, H, q_len, D) tensor of the case's dtype: q, the output, their gradients."""
    return case.batch * case.heads * case.n_queries * case.head_dim * case.element_bytes


def kv_tensor_bytes(case: Case) -> int:
    """Bytes of one (B, Hkv, N, D) tensor of the case's dtype: k or v (grouped-query attention: fewer heads)."""
    return case.batch * case.n_kv_heads * case.seq_len * case.head_dim * case.element_bytes


def io_bytes(case: Case) -> int:
    """Inputs and output of one call; in fwd_bwd also the upstream gradient and dq, dk, dv."""
    per_side = 2 * tensor_bytes(case) + 2 * kv_tensor_bytes(case)  # q, out, k, v (or dout, dq, dk, dv)
    return per_side * (2 if case.mode == "fwd_bwd" else 1)


@dataclass(frozen=True)
class Modelled:
    total_bytes: int  # io + the implementation's working set
    impl_bytes: int

    def describe(self) -> str:
        return f"{format_gib(self.total_bytes)} (inputs/outputs {format_gib(self.total_bytes - self.impl_bytes)}" \
               f" + implementation {format_gib(self.impl_bytes)})"


def modelled_bytes(impl: Impl, case: Case) -> Modelled | None:
    """The model for this (case, impl), or None when the implementation has none."""
    working = impl.memory_bytes(case)
    if working is None:
        return None
    return Modelled(io_bytes(case) + int(working), int(working))


def host_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping), or None."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def device_available_bytes(device: str, torch_module: Any = None) -> tuple[int | None, str]:
    """(bytes this process can still allocate on `device`, where that figure comes from)."""
    if device.startswith("cuda"):
        if torch_module is None:
            import torch as torch_module
        cuda = torch_module.cuda
        free, total = cuda.mem_get_info()
        cached = cuda.memory_reserved() - cuda.memory_allocated()  # held by the caching allocator, reusable
        return free + cached, f"free of {format_gib(total)} on the GPU"
    return host_available_bytes(), "available host memory (MemAvailable)"


def does_not_fit(impl: Impl, case: Case, already_held: int = 0, available: tuple[int | None, str] | None = None
                 ) -> tuple[str, Modelled] | None:
    """(skip reason, model) when the model says the case cannot fit; None when it may fit or is unmodelled.

    `already_held`: bytes of this case's inputs already allocated (shared by the case's implementations).
    """
    model = modelled_bytes(impl, case)
    if model is None:
        return None
    free, where = available if available is not None else device_available_bytes(case.device)
    if free is None:
        return None
    needed = model.total_bytes - already_held
    if needed <= free:
        return None
    return (f"memory model: {impl.name} needs at least {model.describe()}; {format_gib(free + already_held)} "
            f"{where}", model)
