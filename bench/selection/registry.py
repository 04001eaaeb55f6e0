"""The selector table: built-in selectors and the ones plugins add, by unique name.

A selector is a small named function of (q, k, case) returning indices int32 (B, H_sel, query units, K), -1
padded, as attention-gym's mask factories are small named closures. Its registration says what one of its
indices stands for (`kv_unit`: token, block, page), which query rows share one selection (`q_unit`: row,
block), which heads share one (`shared`: head, kv_group, all), and whether it keeps a `budget` of units or
reaches a `threshold` of attention mass. `reference` selectors (the oracles) compute dense attention: they are
the yardstick a real selector is judged against, not a method to deploy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor

from bench.selection.base import SHARED, Selection, unit_size
from bench.spec.plugins import source_of

if TYPE_CHECKING:
    from bench.spec.case import Case

SelectorFn = Callable[[Tensor, Tensor, Any], Tensor]
# What a selector keeps: a `budget` of units (required), a `threshold` of mass (required), None: a fixed
# selector (its cases take neither, and their ids carry none), or, when registered without saying, a budget
# if the case gives one (a selector that reads case.budget) and a fixed selection otherwise.
Takes = Literal["budget", "threshold", "optional_budget"] | None
TAKES: tuple[str | None, ...] = ("budget", "threshold", "optional_budget", None)


@dataclass(frozen=True)
class SelectorInfo:
    name: str
    fn: SelectorFn
    q_unit: str  # row | block
    kv_unit: str  # token | block | page
    shared: str  # head | kv_group | all
    takes: Takes
    reference: bool
    description: str
    source: str

    def q_unit_size(self, case: Case) -> int:
        return unit_size(self.q_unit, case.block_size)

    def kv_unit_size(self, case: Case) -> int:
        return unit_size(self.kv_unit, case.block_size, getattr(case, "page_size", None))


SELECTORS: dict[str, SelectorInfo] = {}


def register_selector(name: str, *, q_unit: str = "block", kv_unit: str = "block", shared: str = "head",
                      takes: Takes = "optional_budget", description: str = "", reference: bool = False
                      ) -> Callable[[SelectorFn], SelectorFn]:
    """Decorator adding a selector `fn(q, k, case) -> indices` under `name` (unique)."""
    if not isinstance(name, str) or not name or not name.replace("_", "").isalnum() or name != name.lower():
        raise ValueError(f"a selector's name is lowercase letters, digits and '_', got {name!r}")
    checks = {"q_unit": (q_unit, ("row", "block")), "kv_unit": (kv_unit, ("token", "block", "page")),
              "shared": (shared, SHARED), "takes": (takes, TAKES)}
    for field, (value, allowed) in checks.items():
        if value not in allowed:
            raise ValueError(f"selector {name!r}: {field} {value!r}; allowed: {', '.join(map(str, allowed))}")

    def add(fn: SelectorFn) -> SelectorFn:
        if not callable(fn):
            raise TypeError(f"register_selector({name!r}) decorates a function, got {type(fn).__name__}")
        module = getattr(fn, "__module__", None) or "__main__"
        previous = SELECTORS.get(name)
        if previous is not None and (getattr(previous.fn, "__module__", None), previous.fn.__qualname__) != (
                module, fn.__qualname__):
            raise ValueError(f"selector name {name!r} is already registered ({previous.source})")
        doc = description or (fn.__doc__ or "").strip().split("\n")[0]
        SELECTORS[name] = SelectorInfo(name, fn, q_unit, kv_unit, shared, takes, reference, doc, source_of(module))
        return fn

    return add


def get_selector(name: str) -> SelectorInfo:
    _load_builtin()
    if name not in SELECTORS:
        raise KeyError(f"unknown selector {name!r}; known selectors: {', '.join(sorted(SELECTORS))}")
    return SELECTORS[name]


def selector_names() -> list[str]:
    _load_builtin()
    return sorted(SELECTORS)


def _load_builtin() -> None:
    from bench.selection import builtin, oracle, oracle_rows  # noqa: F401 - registers the built-in selectors
    from bench.spec.plugins import load_entry_points

    load_entry_points()


def run_selector(info: SelectorInfo, q: Tensor, k: Tensor, case: Case) -> Selection:
    """The selector's indices as a Selection (not yet validated: `Selection.validate`). Raises what it raises."""
    with torch.no_grad():
        indices = info.fn(q.detach(), k.detach(), case)
    if isinstance(indices, Tensor) and indices.dtype == torch.int64:
        indices = indices.to(torch.int32)
    return Selection(indices, info.q_unit_size(case), info.kv_unit_size(case), info.shared)  # type: ignore[arg-type]
