"""Any registered implementation in a Hugging Face causal LM's attention, through transformers' attention interface.

`swap_attention(model, impl, selector=..., budget=..., pattern="causal", layers=None, **fields)` is a context
manager: inside it, every chosen attention layer of `model` computes its attention with `impl` (and the selector
over the base pattern) as `bench run` would, by `bench.measure.prepare` on each call's q, k, v (the
implementation's untimed setup and its first call: every layer call brings new tensors). The other layers keep
the model's own implementation. GQA is the model's: query heads (B, H, N, D), keys and values (B, Hkv, N, D) as
the layer hands them over. Inside `torch.no_grad()` the case is inference (mode fwd); with gradients
enabled it is fwd_bwd, so an implementation without a backward here says so (Unavailable).

The interface is registered once under the name `bench_swap` (with a mask function that builds no mask: the
pattern is the mask) and the model switched to it for the context (`set_attn_implementation`), back on exit.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from bench import registry
from bench.measure.case_cache import CaseCache
from bench.measure.prepare import prepare
from bench.patterns import Pattern
from bench.spec.case import DTYPES, Case

INTERFACE = "bench_swap"
_NAMES = {v: k for k, v in DTYPES.items()}


@dataclass
class Swap:
    """What the swapped layers compute: the implementation, the case's fields but its shape, the layers."""

    impl: registry.Impl
    template: Case
    layers: frozenset[int] | None
    calls: int = 0  # layer calls routed through the implementation
    patterns: dict[tuple[int, int], Pattern] = field(default_factory=dict)  # (q_len, N): views built once

    def pattern(self, case: Case) -> Pattern:
        key = (case.n_queries, case.seq_len)
        if key not in self.patterns:
            self.patterns[key] = case.make_pattern()
        return self.patterns[key]


_ACTIVE: contextvars.ContextVar[Swap | None] = contextvars.ContextVar("bench_swap", default=None)


def _case_for(swap: Swap, query: Tensor, key: Tensor) -> Case:
    b, h, nq, d = query.shape
    n, hkv = key.shape[2], key.shape[1]
    backward = torch.is_grad_enabled() and query.requires_grad
    return replace(swap.template, batch=b, heads=h, kv_heads=None if hkv == h else hkv, head_dim=d, seq_len=n,
                   q_len=None if nq == n else nq, dtype=_NAMES[query.dtype], device=query.device.type,
                   mode="fwd_bwd" if backward else "fwd")


def swapped_attention(module: Any, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                      dropout: float = 0.0, scaling: float | None = None, **kwargs: Any) -> tuple[Tensor, None]:
    """transformers' attention interface: (B, N, H, D) from query (B, H, N, D) and key, value (B, Hkv, N, D)."""
    swap = _ACTIVE.get()
    layer = getattr(module, "layer_idx", None)
    if swap is None or (swap.layers is not None and layer not in swap.layers):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    d = query.shape[-1]
    if scaling is not None and not math.isclose(scaling, d**-0.5, rel_tol=1e-6):
        raise ValueError(f"layer {layer} scales scores by {scaling:g}, not 1/sqrt(head_dim) = {d**-0.5:g}: the "
                         "implementations compute softmax(q k^T / sqrt(D))")
    if dropout:
        raise ValueError("attention dropout in the swapped layers: evaluate the model in eval mode")
    case = _case_for(swap, query, key)
    prepared = prepare(swap.impl, case, swap.pattern(case), query, key, value, None, CaseCache())
    swap.calls += 1
    return prepared.output.transpose(1, 2).contiguous(), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None  # the case's pattern is the mask: nothing to build


_registered = False


def _register() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface.register(INTERFACE, swapped_attention)
        AttentionMaskInterface.register(INTERFACE, _no_mask)
        _registered = True


def swap_case(impl_name: str, selector: str | None = None, budget: int | float | None = None,
              threshold: float | None = None, pattern: str = "causal", **fields: Any) -> Case:
    """The case template of a swap (its shape comes from each call). ValueError naming an unknown field."""
    unknown = sorted(set(fields) - set(Case.field_names()))
    if unknown:
        raise ValueError(f"swap_attention() got unknown keyword(s) {unknown}; the keywords are case fields: "
                         f"{', '.join(Case.field_names())}")
    if selector is not None:
        from bench.selection import get_selector

        info = get_selector(selector)  # KeyError naming the known ones
        if (info.takes == "budget" and budget is None) or (info.takes == "threshold" and threshold is None):
            raise ValueError(f"selector {selector} keeps a {info.takes}: give {info.takes}=...")
    elif budget is not None or threshold is not None:
        raise ValueError("budget and threshold are a selector's: give selector=... too")
    return Case(pattern=pattern, selector=selector, budget=budget, threshold=threshold, **fields)


@contextlib.contextmanager
def swapping(model: Any, impl_name: str, template: Case, layers: list[int] | None = None) -> Iterator[Swap]:
    """Route `model`'s attention layers (`layers`, None: all) through `impl_name`, computing `template` (a case
    whose shape each call supplies) for the block."""
    try:
        impl = registry.get(impl_name)
    except KeyError as exc:
        raise ValueError(exc.args[0]) from None
    swap = Swap(impl, template, frozenset(layers) if layers is not None else None)
    _register()
    previous = model.config._attn_implementation
    model.set_attn_implementation(INTERFACE)
    token = _ACTIVE.set(swap)
    try:
        yield swap
    finally:
        _ACTIVE.reset(token)
        model.set_attn_implementation(previous)


@contextlib.contextmanager
def swap_attention(model: Any, impl_name: str, selector: str | None = None, budget: int | float | None = None,
                   threshold: float | None = None, pattern: str = "causal", layers: list[int] | None = None,
                   **fields: Any) -> Iterator[Swap]:
    """Route `model`'s attention layers (`layers`: their indices; None: all) through `impl_name` for the block.

    `selector`, `budget`, `threshold` and `pattern` (the base pattern) and any other case field (`window`,
    `block_size`, `score_mod`...) are as in a suite. Yields the `Swap` (its `calls` counts the routed calls).
    ValueError for an unknown implementation, selector or field, or a selector without its budget.
    """
    with swapping(model, impl_name, swap_case(impl_name, selector, budget, threshold, pattern, **fields),
                  layers) as swap:
        yield swap
