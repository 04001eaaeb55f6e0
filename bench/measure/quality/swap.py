"""Any registered implementation in a Hugging Face causal LM's attention, through transformers' attention interface.

`swap_attention(model, impl, selector=..., budget=..., pattern="causal", layers=None, **fields)` is a context
manager: inside it, every chosen attention layer of `model` computes its attention with `impl` (and the selector
over the base pattern) as `bench run` would, by `bench.measure.case.prepare` on each call's q, k, v (the
implementation's untimed setup and its first call: every layer call brings new tensors). The other layers keep
the model's own implementation. GQA is the model's: query heads (B, H, N, D), keys and values (B, Hkv, N, D) as
the layer hands them over. Inside `torch.no_grad()` the case is inference (mode fwd); with gradients
enabled it is fwd_bwd, so an implementation without a backward here says so (Unavailable).

The swap applies what the model asks of its attention, or refuses it (Unavailable naming the keyword), never drops
it: the model's own boolean mask is built (`_model_mask`) and read for padding (each sequence's run of tokens is
computed apart, left or right padding alike) and checked against the case's pattern (which may keep fewer pairs
than the model's mask, never more); a layer's `sliding_window` becomes the pattern causal_local and its `softcap`
the score_mod softcap; any other keyword it passes with a value is refused by name.

The interface is registered once under the name `bench_swap` (with that mask function) and the model switched to
it for the context (`set_attn_implementation`), back on exit.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from bench import registry
from bench.errors import Unavailable
from bench.measure.case.case_cache import CaseCache
from bench.measure.case.prepare import prepare
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
    patterns: dict[tuple[str, int, int, int], Pattern] = field(default_factory=dict)  # views built once per shape

    checked: tuple[tuple[Any, ...], list[tuple[int, int]] | None] | None = None  # the last mask read, its runs

    def pattern(self, case: Case) -> Pattern:
        key = (case.pattern, case.window, case.n_queries, case.seq_len)
        if key not in self.patterns:
            self.patterns[key] = case.make_pattern()
        return self.patterns[key]

    def sequences(self, mask: Tensor | None, case: Case, pattern_of: Any, read: Any) -> list[tuple[int, int]] | None:
        """`read(mask, case, pattern_of)` (sequences_of), once per mask: a forward's layers share one mask."""
        if mask is None:
            return read(mask, case, pattern_of)
        key = (mask.data_ptr(), tuple(mask.shape), case.pattern, case.window)
        if self.checked is None or self.checked[0] != key:
            self.checked = (key, read(mask, case, pattern_of))
        return self.checked[1]


_ACTIVE: contextvars.ContextVar[Swap | None] = contextvars.ContextVar("bench_swap", default=None)


def _case_for(swap: Swap, query: Tensor, key: Tensor, asked: LayerAsks) -> Case:
    """The case of one layer call: the template at the call's shape, with what the layer asks applied."""
    b, h, nq, d = query.shape
    n, hkv = key.shape[2], key.shape[1]
    backward = torch.is_grad_enabled() and query.requires_grad
    return asked.apply(replace(swap.template, batch=b, heads=h, kv_heads=None if hkv == h else hkv, head_dim=d,
                               seq_len=n, q_len=None if nq == n else nq, dtype=_NAMES[query.dtype],
                               device=query.device.type, mode="fwd_bwd" if backward else "fwd"))


# What a layer may pass to its attention that changes nothing here: positions (rotary is applied before the call),
# cache bookkeeping, flags of the mask the model built (read from the mask itself).
_INERT = frozenset({"position_ids", "cache_position", "use_cache", "output_attentions", "past_key_values",
                    "past_key_value", "is_causal", "layer_idx", "position_embeddings"})


@dataclass(frozen=True)
class LayerAsks:
    """What a layer's attention asks beyond the template: a sliding window (the pattern causal_local) and a softcap."""

    window: int | None = None
    softcap: float | None = None

    def apply(self, case: Case) -> Case:
        """`case` with what the layer asks: the pattern causal_local at the window, the score_mod softcap."""
        if self.window is not None:
            case = replace(case, pattern="causal_local", window=self.window)
        if self.softcap is not None:
            case = replace(case, score_mod="softcap", softcap=self.softcap)
        return case


def layer_asks(template: Case, layer: int | None, scaling: float | None, d: int, dropout: float,
               kwargs: Mapping[str, object]) -> LayerAsks:
    """The case fields a layer's own attention asks for beyond the template (a sliding window as the pattern
    causal_local, a logit softcap as the score_mod softcap); Unavailable naming any keyword the swap cannot apply."""
    where = f"layer {layer}"
    if scaling is not None and not math.isclose(scaling, d**-0.5, rel_tol=1e-6):
        raise Unavailable(f"{where} passes scaling={scaling:g}, not 1/sqrt(head_dim) = {d**-0.5:g}: the "
                          "implementations compute softmax(q k^T / sqrt(D))")
    if dropout:
        raise Unavailable(f"{where} passes dropout={dropout:g}: evaluate the model in eval mode")
    window, cap = kwargs.get("sliding_window"), kwargs.get("softcap")
    own_window = None
    if window is not None:
        if template.pattern not in ("causal", "causal_local"):
            raise Unavailable(f"{where} passes sliding_window={window}: the swap applies it as causal_local over a "
                              f"causal or causal_local base pattern, not {template.pattern}")
        own_window = int(window)  # type: ignore[call-overload]
        if template.pattern == "causal_local":
            own_window = min(own_window, int(template.window))
    own_cap = None
    if cap is not None:
        own_cap = float(cap)  # type: ignore[arg-type]
        if template.score_mod not in (None, "none", "softcap") or (template.score_mod == "softcap" and
                                                                    not math.isclose(float(template.softcap or 0),
                                                                                     own_cap)):
            raise Unavailable(f"{where} passes softcap={own_cap:g}, which the case's score_mod "
                              f"{template.score_mod} would replace")
    for name, value in kwargs.items():
        if name not in _INERT and name not in ("sliding_window", "softcap") and value is not None:
            raise Unavailable(f"{where} passes {name}={_brief(value)} to its attention, which the swap does not "
                              "apply")
    return LayerAsks(own_window, own_cap)


def _brief(value: Any) -> str:
    return f"a tensor of shape {tuple(value.shape)}" if isinstance(value, Tensor) else repr(value)[:60]


def sequences_of(mask: Tensor | None, case: Case, pattern_of: Any) -> list[tuple[int, int]] | None:
    """Per sequence of the batch, the run [lo, hi) of keys the model's boolean mask (B, 1, q_len, N) lets some row
    see (its tokens between left and right padding); None where every sequence has all N. Unavailable where the
    mask is not padding around one run of tokens, or where the case's pattern over a sequence's tokens would let a
    query see a key the model masks (`pattern_of(seq_len, q_len)` gives that pattern)."""
    if mask is None:
        return None
    if mask.dtype != torch.bool or mask.dim() != 4:
        raise Unavailable(f"attention_mask of dtype {mask.dtype} and shape {tuple(mask.shape)}: the swap reads "
                          "a boolean (B, 1, q_len, N) mask")
    nq, n = mask.shape[-2:]
    runs = []
    for b in range(mask.shape[0]):
        seen = mask[b, 0].any(dim=0)
        cols = seen.nonzero().flatten()
        lo, hi = (int(cols[0]), int(cols[-1]) + 1) if cols.numel() else (n, n)
        if not bool(seen[lo:hi].all()) or (nq < n and hi != n):
            raise Unavailable(f"attention_mask of sequence {b} is not padding around one run of tokens (keys "
                              f"{lo}..{hi - 1} with holes, or queries past its last key): the swap does not apply it")
        rows = slice(lo, hi) if nq == n else slice(0, nq)
        allowed = pattern_of(hi - lo, (hi - lo) if nq == n else nq).dense_mask()
        given = mask[b, 0, rows, lo:hi]
        if allowed.shape == given.shape and bool((allowed & ~given.cpu()).any()):
            raise Unavailable(f"attention_mask: the case's pattern {case.pattern} lets a query of sequence {b} see "
                              "keys the model masks (its mask is narrower: causal, a window, padding)")
        runs.append((lo, hi))
    return None if all(run == (0, n) for run in runs) else runs


def swapped_attention(module: Any, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                      dropout: float = 0.0, scaling: float | None = None, **kwargs: Any) -> tuple[Tensor, None]:
    """transformers' attention interface: (B, N, H, D) from query (B, H, N, D) and key, value (B, Hkv, N, D).
    What the layer asks (padding in its mask, a sliding window, a softcap) is applied or refused by name."""
    swap = _ACTIVE.get()
    layer = getattr(module, "layer_idx", None)
    if swap is None or (swap.layers is not None and layer not in swap.layers):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    asked = layer_asks(swap.template, layer, scaling, query.shape[-1], dropout, kwargs)
    case = _case_for(swap, query, key, asked)

    def pattern_of(seq_len: int, q_len: int) -> Pattern:
        return swap.pattern(replace(case, batch=1, seq_len=seq_len, q_len=None if q_len == seq_len else q_len))

    runs = swap.sequences(attention_mask, case, pattern_of, sequences_of)
    swap.calls += 1
    if runs is None:
        return _attend(swap, case, swap.pattern(case), query, key, value).transpose(1, 2).contiguous(), None
    out = query.new_zeros(query.shape)  # rows outside a sequence's tokens (padding) stay zero
    for b, (lo, hi) in enumerate(runs):
        if hi <= lo:
            continue
        rows = slice(lo, hi) if query.shape[2] == key.shape[2] else slice(0, query.shape[2])
        one = replace(case, batch=1, seq_len=hi - lo, q_len=None if rows.stop - rows.start == hi - lo else
                      rows.stop - rows.start)
        out[b : b + 1, :, rows] = _attend(swap, one, swap.pattern(one), query[b : b + 1, :, rows],
                                          key[b : b + 1, :, lo:hi], value[b : b + 1, :, lo:hi])
    return out.transpose(1, 2).contiguous(), None


def _attend(swap: Swap, case: Case, pattern: Pattern, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return prepare(swap.impl, case, pattern, q, k, v, None, CaseCache()).output


def _model_mask(*args: Any, **kwargs: Any) -> Tensor | None:
    """The model's own boolean mask (causal, its window, its padding), always built: the swap checks its pattern
    against it and reads the padding from it (transformers' sdpa mask, never skipped for `is_causal`)."""
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **{**kwargs, "allow_is_causal_skip": False})


_registered = False


def _register() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface.register(INTERFACE, swapped_attention)
        AttentionMaskInterface.register(INTERFACE, _model_mask)
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
