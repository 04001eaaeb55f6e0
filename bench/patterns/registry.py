"""The pattern table: built-in patterns and the custom ones plugins add, by unique name.

`register_pattern` takes a `Pattern` subclass with a predicate; `register_mask_mod` takes any FlexAttention
mask_mod from a factory of the case's pattern fields (attention-gym's `generate_*` functions, say). Either
then runs on every implementation and in the oracle, with no other code.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor

from bench.patterns.base import PATTERN_FIELDS, Pattern, PatternError
from bench.spec.plugins import source_of

PATTERNS: dict[str, type[Pattern]] = {}
NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")


def builtin(cls: type[Pattern]) -> type[Pattern]:
    """Register one of the table's own patterns."""
    PATTERNS[cls.name] = cls
    return cls


def _origin(cls: type[Pattern]) -> tuple[str, str]:
    return getattr(cls, "origin", (cls.__module__, cls.__qualname__))


def register_pattern(cls: type[Pattern]) -> type[Pattern]:
    """Class decorator adding a custom pattern. Its name must be new; its fields are case fields.

    The predicate `allowed(self, i, j)` takes int64 tensors of absolute query and key positions
    (broadcastable) and returns a bool tensor. Set `length_free = True` when it never reads `self.seq_len`
    (then one instance serves packed documents of every length).
    """
    if not (isinstance(cls, type) and issubclass(cls, Pattern)):
        raise TypeError(f"register_pattern takes a subclass of bench.patterns.Pattern, got {cls!r}")
    name = cls.__dict__.get("name", "")
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ValueError(f"{cls.__qualname__}: a pattern needs a `name` of lowercase letters, digits and '_' "
                         f"starting with a letter, got {name!r}")
    unknown = [f for f in cls.fields if f not in PATTERN_FIELDS]
    if unknown:
        raise ValueError(f"pattern {name!r}: unknown field(s) {unknown}; a pattern reads case fields among "
                         f"{', '.join(PATTERN_FIELDS)}")
    if cls.allowed is Pattern.allowed:
        raise ValueError(f"pattern {name!r}: define allowed(self, i, j) (a bool tensor over positions)")
    previous = PATTERNS.get(name)
    if previous is not None and _origin(previous) != _origin(cls):
        raise ValueError(f"pattern name {name!r} is already registered ({previous.source}); pattern names are "
                         "unique across built-in and custom patterns")
    if "length_free" not in cls.__dict__:
        cls.length_free = False  # unless it says otherwise, a custom predicate may read seq_len
    cls.source = source_of(_origin(cls)[0])
    PATTERNS[name] = cls
    return cls


MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


class MaskModPattern(Pattern):
    """A pattern whose predicate is a FlexAttention mask_mod made by `factory(pattern)`.

    The mask_mod is called as FlexAttention calls it, mask_mod(b, h, q_idx, kv_idx), with q_idx the row of
    the q_len x seq_len matrix (inside a document: the position relative to the document's start), kv_idx
    the key position, and b = h = 0.
    """

    factory: ClassVar[Callable[[Pattern], MaskMod]]
    origin: ClassVar[tuple[str, str]]
    length_free = False  # factories read p.seq_len

    def __init__(self, seq_len: int, **kwargs: Any) -> None:
        super().__init__(seq_len, **kwargs)
        try:
            self._mask_mod = type(self).factory(self)
        except Exception as exc:
            raise PatternError(self.name, None, f"its mask_mod factory ({self.source}) raised "
                                                f"{type(exc).__name__}: {exc}") from None
        if not callable(self._mask_mod):
            raise PatternError(self.name, None, f"its factory ({self.source}) returned "
                                                f"{type(self._mask_mod).__name__}, not a mask_mod function")
        self._zero = torch.zeros((), dtype=torch.int64)

    def allowed(self, i: Tensor, j: Tensor) -> Tensor:
        zero = self._zero.to(i.device)
        return self._mask_mod(zero, zero, i - self.q_offset, j)


def register_mask_mod(name: str, factory: Callable[[Pattern], MaskMod], fields: tuple[str, ...] | list[str] = (),
                      description: str = "") -> type[Pattern]:
    """Add a pattern named `name` whose predicate is the mask_mod `factory(p)` returns.

    `p` has the case's pattern fields (`p.seq_len`, `p.q_len`, `p.window`, `p.image_width`, ...); `fields`
    names the ones the factory reads (they label the pattern's series).
    """
    if not callable(factory):
        raise TypeError(f"register_mask_mod({name!r}, ...): factory must be callable, got {type(factory).__name__}")
    module = getattr(factory, "__module__", None) or "__main__"
    cls = type(f"MaskMod_{name}", (MaskModPattern,), {
        "name": name, "fields": tuple(fields),
        "description": description or f"FlexAttention mask_mod from {getattr(factory, '__qualname__', factory)!s}",
        "factory": staticmethod(factory), "origin": (module, f"mask_mod {name}"), "__module__": module,
    })
    return register_pattern(cls)


def make_pattern(name: str, seq_len: int, *, q_len: int | None = None,
                 documents: int | list[int] | tuple[int, ...] | None = None, **fields: Any) -> Pattern:
    """The pattern `name` over seq_len tokens (q_len query rows, packed documents); fields are case fields.

    Raises ValueError naming the allowed names or the bad field (`PatternError` for the latter).
    """
    if name not in PATTERNS:
        raise ValueError(f"unknown pattern {name!r}; known patterns: {', '.join(sorted(PATTERNS))}")
    unknown = sorted(set(fields) - set(PATTERN_FIELDS))
    if unknown:
        raise ValueError(f"make_pattern got unknown field(s) {unknown}; pattern fields are {list(PATTERN_FIELDS)}")
    return PATTERNS[name](seq_len, q_len=q_len, documents=documents, **fields)
