"""`bench.api.attention`: the one entry point tests and users call to run any implementation once."""

from __future__ import annotations

import torch
from torch import Tensor

from bench import registry
from bench.case import DTYPES, Case
from bench.errors import Unavailable
from bench.patterns import Pattern

_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def case_for(q: Tensor, pattern: Pattern, mode: str = "fwd") -> Case:
    """The case describing inputs q (B, H, N, D) under `pattern`."""
    b, h, n, d = q.shape
    return Case(batch=b, heads=h, head_dim=d, seq_len=n, dtype=_DTYPE_NAMES[q.dtype], pattern=pattern.name,
                window=pattern.window, density=pattern.p, block_size=pattern.block_size,
                dilation=pattern.dilation, global_tokens=pattern.global_tokens, seed=pattern.seed,
                mode=mode, device=q.device.type)


def check_inputs(q: Tensor, k: Tensor, v: Tensor, pattern: Pattern) -> None:
    """ValueError naming what is wrong with the inputs and what is allowed."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (B, H, N, D), got shape {tuple(t.shape)}")
        if t.dtype not in _DTYPE_NAMES:
            raise ValueError(f"{name} has dtype {t.dtype}; allowed: {', '.join(DTYPES)}")
    if not (q.shape == k.shape == v.shape):
        raise ValueError(f"q, k, v must have the same shape (B, H, N, D), got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError("q, k, v must share dtype and device")
    if q.shape[2] != pattern.seq_len:
        raise ValueError(f"inputs have N={q.shape[2]} but the pattern was made for seq_len={pattern.seq_len}")


def attention(impl_name: str, q: Tensor, k: Tensor, v: Tensor, pattern: Pattern) -> Tensor:
    """Attention of q, k, v (B, H, N, D) with scale 1/sqrt(D) under `pattern`, by implementation `impl_name`.

    Differentiable when q, k or v require grad and the implementation supports fwd_bwd. Raises
    `bench.errors.Unavailable` with the reason when the implementation cannot run here or this case.
    """
    check_inputs(q, k, v, pattern)
    try:
        impl = registry.get(impl_name)
    except KeyError as exc:
        raise ValueError(exc.args[0]) from None
    wants_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    case = case_for(q, pattern, "fwd_bwd" if wants_grad else "fwd")
    reason = impl.unavailable() or impl.unsupported(case)
    if reason:
        raise Unavailable(reason)
    return impl.prepare(case, pattern, q, k, v)()
