"""Score modifications: what a case does to the scaled scores before the mask (docs/DESIGN.md "Score modifications").

A `ScoreMod` is built per case from its fields: a FlexAttention score_mod `fn(score, b, h, q_idx, kv_idx)` (q_idx
the row of the q_len x seq_len matrix, kv_idx the key position, h the query head) and what kernels need to apply
it themselves (`cap`, `slopes`, `table`). `apply` runs it over a tile of scores by absolute positions, which is
how the oracle and the torch implementations use it. Built-ins: softcap, alibi, relative_bias; plugins add any
FlexAttention score_mod with `register_score_mod`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from bench.spec.plugins import source_of

ScoreModFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
BUILTIN_SCORE_MODS = ("softcap", "alibi", "relative_bias")
NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")
T5_BUCKETS, T5_MAX_DISTANCE = 32, 128


class ScoreModError(ValueError):
    """A score modification that cannot be built: `field` names the case field at fault."""

    def __init__(self, message: str, field: str = "score_mod") -> None:
        super().__init__(message)
        self.message, self.field = message, field


@dataclass(frozen=True)
class ScoreModInfo:
    name: str
    factory: Callable[[Any], ScoreModFn] | None  # None for the built-ins, which build their own ScoreMod
    fields: tuple[str, ...]
    description: str
    source: str


SCORE_MODS: dict[str, ScoreModInfo] = {
    "softcap": ScoreModInfo("softcap", None, ("softcap",), "s -> c * tanh(s / c) (Gemma 2: 50, Grok: 30)",
                            "built-in"),
    "alibi": ScoreModInfo("alibi", None, (), "s - m_h * |i - j|, Press et al.'s slopes for the query heads "
                          "(MPT, BLOOM)", "built-in"),
    "relative_bias": ScoreModInfo("relative_bias", None, (), "s + b[h, bucket(j - i)], T5's bidirectional "
                                  "buckets (32, max distance 128), b ~ N(0, 1) from the seed", "built-in"),
}


def score_mod_names() -> list[str]:
    return ["none", *SCORE_MODS]


def alibi_slopes(heads: int) -> list[float]:
    """Press et al.'s `get_slopes(n)` (ofirpress/attention_with_linear_biases): a geometric sequence from
    2^(-8/n) for a power of two n, else the closest power of two's slopes and every other one of twice that."""
    def power_of_two(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(heads).is_integer():
        return power_of_two(heads)
    closest = 2 ** math.floor(math.log2(heads))
    return power_of_two(closest) + alibi_slopes(2 * closest)[0::2][: heads - closest]


def t5_bucket(relative: Tensor) -> Tensor:
    """T5's `_relative_position_bucket(relative_position = j - i, bidirectional=True, 32, 128)`: half the
    buckets per direction, exact distances below 8, logarithmic bins up to 128, the last bin beyond."""
    half = T5_BUCKETS // 2
    exact = half // 2
    bucket = (relative > 0).to(torch.int64) * half
    distance = relative.abs()
    log_bin = exact + (torch.log(distance.clamp_min(1).to(torch.float32) / exact)
                       / math.log(T5_MAX_DISTANCE / exact) * (half - exact)).to(torch.int64)
    return bucket + torch.where(distance < exact, distance, log_bin.clamp_max(half - 1))


class ScoreMod:
    """One case's score modification. `kind` is softcap, alibi, relative_bias or custom; `additive` says the
    modification is a bias independent of the score (an additive float mask can carry it)."""

    def __init__(self, name: str, kind: str, fn: ScoreModFn, q_offset: int, *, cap: float | None = None,
                 slopes: Tensor | None = None, table: Tensor | None = None) -> None:
        self.name, self.kind, self.fn, self.q_offset = name, kind, fn, q_offset
        self.cap, self.slopes, self.table = cap, slopes, table
        self.additive = kind in ("alibi", "relative_bias")

    def apply(self, scores: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        """The modified scores: `scores` (..., c, n) float with `h` (query heads), `i` (absolute query positions)
        and `j` (key positions) int64 tensors broadcastable to it."""
        zero = torch.zeros((), dtype=torch.int64, device=scores.device)
        args = (scores, zero, h.to(scores.device), (i - self.q_offset).to(scores.device), j.to(scores.device))
        if self.kind != "custom":
            return self.fn(*args)
        try:
            return self.fn(*args)
        except Exception as exc:  # a plugin's code: the record names it
            raise RuntimeError(f"score_mod {self.name} ({SCORE_MODS[self.name].source}) raised "
                               f"{type(exc).__name__}: {exc}") from None

    def bias(self, heads: int, i: Tensor, j: Tensor, dtype: torch.dtype) -> Tensor:
        """An additive modification as a (heads, len(i), len(j)) float tensor."""
        assert self.additive, f"score_mod {self.name} is not additive"
        h = torch.arange(heads)[:, None, None]
        return self.apply(torch.zeros((), dtype=torch.float64), h, i[:, None], j[None, :]).to(dtype)

    def distance_bias(self, heads: int, seq_len: int) -> Tensor:
        """A built-in additive modification as the kernels read it: (heads, 2 * seq_len - 1) float64, entry e the
        bias at i - j = e - (seq_len - 1). ALiBi and T5's bias depend on the head and i - j only."""
        assert self.additive, f"score_mod {self.name} is not additive"
        return self.apply(torch.zeros((), dtype=torch.float64), torch.arange(heads)[:, None],
                          torch.arange(2 * seq_len - 1)[None, :], torch.full((1, 1), seq_len - 1))

    def for_device(self, device: torch.device | str, dtype: torch.dtype = torch.float32) -> ScoreMod:
        """The same modification with its tables on `device` in `dtype` (FlexAttention captures them)."""
        mod = make_builtin(self.name, self.q_offset, cap=self.cap, slopes=self.slopes, table=self.table,
                           device=device, dtype=dtype)
        return mod if mod is not None else self


def make_builtin(kind: str, q_offset: int, *, cap: float | None = None, slopes: Tensor | None = None,
                 table: Tensor | None = None, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> ScoreMod | None:
    """A built-in modification with its constants on `device` in `dtype`; None for another kind."""
    if kind == "softcap":
        assert cap is not None
        # the cap as a captured 0-dim tensor: torch.compile(dynamic=True) turns a closed-over float into a
        # symbolic scalar that FlexAttention's template cannot lower
        c = torch.tensor(float(cap), dtype=dtype, device=device)
        return ScoreMod(kind, kind, lambda s, b, h, qi, kj: c * torch.tanh(s / c), q_offset, cap=float(cap))
    if kind == "alibi":
        assert slopes is not None
        m = slopes.to(device, dtype)
        return ScoreMod(kind, kind, lambda s, b, h, qi, kj: s - m[h] * (qi + q_offset - kj).abs(), q_offset,
                        slopes=m)
    if kind == "relative_bias":
        assert table is not None
        t = table.to(device, dtype)
        return ScoreMod(kind, kind, lambda s, b, h, qi, kj: s + t[h, t5_bucket(kj - qi - q_offset)], q_offset,
                        table=t)
    return None


def make_score_mod(name: str, *, heads: int, seq_len: int, q_len: int | None = None, seed: int = 0,
                   softcap: float | None = None, **fields: Any) -> ScoreMod | None:
    """The case's modification (None for `none`). ScoreModError names the field at fault. Tables are float32
    (every implementation and the oracle read the same rounded values)."""
    problems = score_mod_problems(name, softcap)
    if problems:
        raise ScoreModError(problems[0][1], problems[0][0])
    q_offset = seq_len - (seq_len if q_len is None else q_len)
    if name == "none":
        return None
    if name == "softcap":
        return make_builtin(name, q_offset, cap=softcap)
    if name == "alibi":
        return make_builtin(name, q_offset, slopes=torch.tensor(alibi_slopes(heads), dtype=torch.float32))
    if name == "relative_bias":
        gen = torch.Generator().manual_seed(seed)
        return make_builtin(name, q_offset, table=torch.randn(heads, T5_BUCKETS, generator=gen))
    info = SCORE_MODS[name]
    assert info.factory is not None
    view = SimpleNamespace(heads=heads, seq_len=seq_len, q_len=seq_len - q_offset, seed=seed, softcap=softcap,
                           **fields)
    try:
        fn = info.factory(view)
    except Exception as exc:
        raise ScoreModError(f"score_mod {name}: its factory ({info.source}) raised {type(exc).__name__}: {exc}"
                            ) from None
    if not callable(fn):
        raise ScoreModError(f"score_mod {name}: its factory ({info.source}) returned {type(fn).__name__}, not a "
                            "score_mod function (score, b, h, q_idx, kv_idx) -> score")
    return ScoreMod(name, "custom", fn, q_offset)


def score_mod_problems(name: str, softcap: float | None) -> list[tuple[str, str]]:
    """(field, message) for a score_mod and softcap that do not go together; empty when they do."""
    if name != "none" and name not in SCORE_MODS:
        return [("score_mod", f"got {name!r}; known score_mods: {', '.join(score_mod_names())}")]
    if name == "softcap":
        if softcap is None:
            return [("softcap", "score_mod softcap needs `softcap`, the cap c > 0 of s -> c * tanh(s / c) "
                                "(Gemma 2: 50.0)")]
        if not softcap > 0 or not math.isfinite(softcap):
            return [("softcap", f"got {softcap}; the cap of s -> c * tanh(s / c) must be a finite number > 0")]
    elif softcap is not None:
        return [("softcap", f"got softcap {softcap} with score_mod {name!r}; softcap is the cap of score_mod "
                            "softcap: set `score_mod: softcap` or drop `softcap`")]
    return []


def probe(mod: ScoreMod, heads: int, seq_len: int) -> None:
    """Call a custom modification on a few pairs as the oracle does: ScoreModError if it raises or returns no
    float tensor of the scores' shape."""
    i = torch.tensor([seq_len - 1, mod.q_offset])[:, None]
    j = torch.tensor([0, seq_len - 1, min(1, seq_len - 1)])[None, :]
    h = torch.arange(heads)[:, None, None]
    scores = torch.ones(heads, 2, 3, dtype=torch.float64)
    try:
        out = mod.apply(scores, h, i, j)
    except Exception as exc:
        raise ScoreModError(str(exc)) from None
    if not isinstance(out, Tensor) or not out.is_floating_point() or out.shape != scores.shape:
        raise ScoreModError(f"score_mod {mod.name} returned {type(out).__name__} "
                            f"{tuple(getattr(out, 'shape', ()))}; a score_mod returns float scores of the input's "
                            "shape")


def register_score_mod(name: str, factory: Callable[[Any], ScoreModFn], fields: tuple[str, ...] | list[str] = (),
                       description: str = "") -> str:
    """Add a score modification `name`: `factory(p)` returns a FlexAttention score_mod (score, b, h, q_idx,
    kv_idx) -> score, with `p` the case's fields (p.heads, p.seq_len, p.q_len, p.seed, p.softcap, p.window, ...);
    `fields` names the ones it reads. q_idx is the row of the q_len x seq_len matrix, as FlexAttention passes it."""
    if not callable(factory):
        raise TypeError(f"register_score_mod({name!r}, ...): factory must be callable, got {type(factory).__name__}")
    if not isinstance(name, str) or not NAME_RE.match(name) or name == "none":
        raise ValueError(f"a score_mod needs a name of lowercase letters, digits and '_' starting with a letter "
                         f"(not 'none'), got {name!r}")
    module = getattr(factory, "__module__", None) or "__main__"
    previous = SCORE_MODS.get(name)
    if previous is not None and (previous.factory is None or previous.source != source_of(module)):
        raise ValueError(f"score_mod name {name!r} is already registered ({previous.source}); names are unique")
    SCORE_MODS[name] = ScoreModInfo(name, factory, tuple(fields), description or
                                    f"FlexAttention score_mod from {getattr(factory, '__qualname__', factory)!s}",
                                    source_of(module))
    return name


def case_problems(case: Any) -> list[tuple[str, str]]:
    """(field, message) for a case's score modification that the suite refuses at load: a bad name or cap, a
    combination not measured, a custom score_mod whose factory or function raises on a few pairs."""
    problems = score_mod_problems(case.score_mod, case.softcap)
    if problems or case.score_mod == "none":
        return problems
    for field, value in (("selector", case.selector), ("page_size", case.page_size)):
        if value is not None:
            return [("score_mod", f"got score_mod {case.score_mod!r} with {field} {value!r}; score modifications "
                                  f"are measured on static patterns over contiguous K/V: allowed with {field}: none")]
    try:
        mod = case.make_score_mod()
        if mod is not None and mod.kind == "custom":
            probe(mod, case.heads, case.seq_len)
    except ScoreModError as exc:
        return [(exc.field, exc.message)]
    return []
