"""`bench.api.attention`: the one entry point tests and users call to run any implementation once."""

from __future__ import annotations

import torch
from torch import Tensor

from bench import registry
from bench.case import DTYPES, Case
from bench.errors import Unavailable
from bench.patterns import Pattern
from bench.reference import check_shapes

_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def case_for(q: Tensor, pattern: Pattern, mode: str = "fwd", k: Tensor | None = None) -> Case:
    """The case describing inputs q (B, H, q_len, D) and k (B, Hkv, seq_len, D) under `pattern`."""
    b, h, _, d = q.shape
    kv_heads = None if k is None or k.shape[1] == h else int(k.shape[1])
    return Case(batch=b, heads=h, head_dim=d, seq_len=pattern.seq_len, dtype=_DTYPE_NAMES[q.dtype],
                pattern=pattern.name, mode=mode, device=q.device.type, kv_heads=kv_heads,
                q_len=None if pattern.q_len == pattern.seq_len else pattern.q_len,
                documents=pattern.documents, **pattern.field_values())


def check_inputs(q: Tensor, k: Tensor, v: Tensor, pattern: Pattern) -> None:
    """ValueError naming what is wrong with the inputs and what is allowed."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _DTYPE_NAMES:
            raise ValueError(f"{name} has dtype {t.dtype}; allowed: {', '.join(DTYPES)}")
    check_shapes(q, k, v, pattern)
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError("q, k, v must share dtype and device")


def attention(impl_name: str, q: Tensor, k: Tensor, v: Tensor, pattern: Pattern) -> Tensor:
    """Attention under `pattern` with scale 1/sqrt(D), by implementation `impl_name`: (B, H, q_len, D).

    q (B, H, q_len, D); k, v (B, Hkv, seq_len, D) with H % Hkv == 0, query head h reading KV head
    h // (H / Hkv). Differentiable when q, k or v require grad and the implementation supports fwd_bwd.
    Raises `bench.errors.Unavailable` with the reason when the implementation cannot run here or this case.
    """
    check_inputs(q, k, v, pattern)
    try:
        impl = registry.get(impl_name)
    except KeyError as exc:
        raise ValueError(exc.args[0]) from None
    wants_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    case = case_for(q, pattern, "fwd_bwd" if wants_grad else "fwd", k)
    reason = impl.unavailable() or impl.unsupported(case)
    if reason:
        raise Unavailable(reason)
    return impl.prepare(case, pattern, q, k, v)()
