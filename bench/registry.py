"""The implementation interface (`Impl`) and the registry it registers into (`@register`).

This is a public module: implementations and plugins import `Impl`, `register`, `setup_phase` and `Case`
from here (docs/DESIGN.md "Implementations"). An implementation declares its capabilities as class
attributes, says why it cannot run (`unavailable`, `unsupported`), and splits untimed setup from the timed
call: `prepare()` returns the zero-argument callable that the runner times. Inside `prepare` (or the first
call), `with setup_phase("mask"): ...` and `with setup_phase("compile"): ...` mark mask building and
compilation or autotuning, which records report apart (`setup.mask_s`, `setup.compile_s`).

Implementations come from `impls/` (built in), from the modules a suite names under `plugins:`, and from
installed packages that declare an entry point in the group `sparse_attention_bench.plugins`.
"""

from __future__ import annotations

import contextvars
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from bench.patterns.score_mods import BUILTIN_SCORE_MODS
from bench.spec.case import Case
from bench.spec.plugins import load_entry_points, source_of

# Set by `bench run` for its children: the run directory, where logs an implementation writes belong.
RUN_DIR_ENV = "BENCH_RUN_DIR"

if TYPE_CHECKING:
    from torch import Tensor

    from bench.patterns import Pattern
    from bench.selection import Selection

__all__ = ["ALL_DEVICES", "ALL_DTYPES", "Case", "Impl", "SetupPhase", "all_impls", "get", "names", "register",
           "setup_phase"]

ALL_DEVICES = frozenset({"cpu", "cuda"})
ALL_DTYPES = frozenset({"float32", "float16", "bfloat16"})


SetupPhase = Literal["mask", "compile"]


class SetupClock:
    """Times the setup phases an implementation marks while it is active (see `setup_phase`).

    Phases are exclusive: time spent in a phase nested inside another counts for the inner one only.
    """

    def __init__(self) -> None:
        self._totals: dict[str, float] = {}
        self._stack: list[list[Any]] = []  # [name, start, time spent in nested phases]
        self._token: contextvars.Token | None = None

    def __enter__(self) -> SetupClock:
        self._token = _ACTIVE.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._token is not None
        _ACTIVE.reset(self._token)

    def total(self, name: str) -> float | None:
        """Seconds marked as `name`; None when the implementation marked no such phase."""
        return self._totals.get(name)

    def marked_s(self) -> float:
        return sum(self._totals.values())

    def _begin(self, name: str) -> None:
        self._stack.append([name, time.perf_counter(), 0.0])

    def _end(self) -> None:
        name, start, nested = self._stack.pop()
        elapsed = time.perf_counter() - start
        self._totals[name] = self._totals.get(name, 0.0) + elapsed - nested
        if self._stack:
            self._stack[-1][2] += elapsed


_ACTIVE: contextvars.ContextVar[SetupClock | None] = contextvars.ContextVar("setup_clock", default=None)


@contextmanager
def setup_phase(name: SetupPhase) -> Iterator[None]:
    """Mark a setup phase of an implementation: `mask` (building masks, layouts, lookup tables) or `compile`
    (compilation, autotuning). Outside a measurement it does nothing."""
    if name not in ("mask", "compile"):
        raise ValueError(f"setup_phase takes 'mask' or 'compile', got {name!r}")
    clock = _ACTIVE.get()
    if clock is None:
        yield
        return
    clock._begin(name)
    try:
        yield
    finally:
        clock._end()


class Impl:
    """Base class of every implementation. Defaults: every pattern, cpu and cuda, every dtype, fwd only."""

    name: ClassVar[str] = ""
    source: ClassVar[str] = "built-in"  # where it came from: built-in, a plugin, an installed package
    description: ClassVar[str] = ""
    devices: ClassVar[frozenset[str]] = ALL_DEVICES
    dtypes: ClassVar[frozenset[str]] = ALL_DTYPES
    patterns: ClassVar[frozenset[str] | None] = None  # None: every pattern
    fwd_bwd: ClassVar[bool] = False  # supports mode fwd_bwd (the returned call is differentiable)
    distributed: ClassVar[bool] = False  # runs with world_size > 1 (one process per rank)
    max_seq_len: ClassVar[int | None] = None  # beyond this the implementation is impractical
    # Data-dependent sparse attention (bench.selection): the selections it attends over, e.g.
    # {"q_unit": (1, "block"), "kv_unit": ("block", "token")} (1: a selection per query row), or None for none.
    selections: ClassVar[dict[str, tuple[int | str, ...]] | None] = None
    # Score modifications it applies (bench.patterns.score_mods): built-in names, and "custom" for any registered
    # FlexAttention score_mod. The others are a skip with the reason (`unsupported_score_mod`).
    score_mods: ClassVar[frozenset[str]] = frozenset()
    # Applies a case's learned `sinks` (one logit per query head joining each row's softmax). Sinks merge through
    # the row's log-sum-exp, so only an implementation that has one can; the others skip with that reason.
    applies_sinks: ClassVar[bool] = False

    def unavailable(self) -> str | None:
        """Why this implementation cannot run on this machine at all (no GPU, no triton, ...), or None."""
        return None

    def build_ahead(self, devices: set[str]) -> None:
        """Compile what this implementation would build on first use (a C++ extension), for cases on `devices`.

        The runner calls it once before the first pair: a build of a minute or more would otherwise count
        against that pair's timeout, and on a busy machine fail it. A failed build is not raised here; the pairs
        report it as they would have. Default: nothing to build."""

    def unsupported(self, case: Case) -> str | None:
        """Why this implementation cannot run this case, or None. Subclasses extend, calling super()."""
        device = case.device
        if device not in self.devices:
            return f"{self.name} runs on {', '.join(sorted(self.devices))}, not {device}"
        if case.dtype not in self.dtypes:
            return f"{self.name} supports dtypes {', '.join(sorted(self.dtypes))}, not {case.dtype}"
        if self.patterns is not None and case.pattern not in self.patterns:
            return f"{self.name} supports patterns {', '.join(sorted(self.patterns))}, not {case.pattern}"
        if case.mode == "fwd_bwd" and not self.fwd_bwd:
            return f"{self.name} has no backward (mode fwd_bwd)"
        if case.world_size > 1 and not self.distributed:
            return f"{self.name} is single-process; world_size {case.world_size} needs a distributed impl"
        if case.world_size == 1 and self.distributed and not self.runs_single_process():
            return f"{self.name} needs world_size > 1"
        if self.max_seq_len is not None and case.seq_len > self.max_seq_len:
            return f"{self.name} is limited to seq_len <= {self.max_seq_len} (got {case.seq_len})"
        if case.sinks is not None and not self.applies_sinks:
            return (f"{self.name} does not apply learned sinks: a sink joins each row's softmax through the row's "
                    f"log-sum-exp, which {self.name} does not compute")
        if case.score_mod != "none":
            return self.unsupported_score_mod(case)
        return None

    def unsupported_score_mod(self, case: Case) -> str | None:
        """Why this implementation does not apply the case's score_mod, or None. The default reads `score_mods`."""
        kind = case.score_mod if case.score_mod in BUILTIN_SCORE_MODS else "custom"
        if kind in self.score_mods:
            return None
        what = "custom score_mods" if kind == "custom" else f"score_mod {kind}"
        return f"{self.name} does not apply {what} (score_mod {case.score_mod})"

    def runs_single_process(self) -> bool:
        """Distributed implementations that also make sense with one rank return True."""
        return True

    def prepare(self, case: Case, pattern: Pattern, q: Tensor, k: Tensor, v: Tensor) -> Callable[[], Tensor]:
        """Untimed setup (format conversion, compilation, autotuning); returns the timed zero-argument call.

        q, k, v: (B, H, N, D). The call returns the output (B, H, N, D). In mode fwd_bwd q, k, v require
        grad and the returned output must be differentiable with respect to them.
        """
        raise NotImplementedError

    def prepare_selected(self, case: Case, pattern: Pattern, q: Tensor, k: Tensor, v: Tensor
                         ) -> Callable[[Selection], Tensor | tuple[Tensor, Tensor]]:
        """Untimed setup for attention over selections under the base `pattern`; returns `attend(selection)`,
        timed, giving the output (B, H, q_len, D) or (output, lse (B, H, q_len) float32, -inf on empty rows).

        The effective mask of row i and key j: the pattern allows (i, j) and j lies in a unit the selection keeps
        for i's query unit (bench.selection). Differentiable in fwd_bwd; the selection is not differentiated.
        """
        raise NotImplementedError

    def unsupported_selection(self, case: Case, q_unit: str, kv_unit: str, shared: str) -> str | None:
        """Why this implementation cannot attend over a selection of these units and sharing (q_unit row|block,
        kv_unit token|block|page, shared head|kv_group|all), or None. The default reads `selections`."""
        if self.selections is None:
            return f"{self.name} does not take selections (data-dependent sparse attention)"
        q_units = {"row" if u == 1 else u for u in self.selections.get("q_unit", ())}
        if q_unit not in q_units:
            return f"{self.name} takes selections per {' or '.join(sorted(map(str, q_units)))}, not per query {q_unit}"
        if kv_unit not in self.selections.get("kv_unit", ()):
            return (f"{self.name} takes selections of {' or '.join(map(str, self.selections.get('kv_unit', ())))} "
                    f"units, not {kv_unit}s")
        return None

    def paged_native(self, case: Case) -> bool:
        """Whether this implementation reads a paged KV cache (a case with `page_size`) through its page table;
        the others get the pages gathered back into contiguous K/V inside their timed call."""
        return False

    def prepare_paged(self, case: Case, pattern: Pattern, q: Tensor, cache: Any,
                      patterns: list[Pattern] | None) -> Callable[[], Tensor]:
        """Untimed setup of attention over a paged cache (bench.inputs.paged.PagedKV: k_pages, v_pages (P, Hkv,
        page_size, D), page_table (B, max_pages), kv_lens (B,)); returns the timed call. `patterns`: one pattern
        per sequence where sequences have their own lengths (kv_lens), else None (`pattern` for all)."""
        raise NotImplementedError

    def tf32(self, case: Case) -> bool:
        """Whether float32 inputs go through TF32 matmuls (looser tolerance, docs/DESIGN.md)."""
        return False

    def record_extras(self) -> dict[str, object]:
        """Fields this implementation adds to its record after prepare (e.g. the autotuned config)."""
        return {}

    def memory_bytes(self, case: Case) -> int | None:
        """A lower bound on the bytes one call allocates beyond its inputs and its output, or None when unknown.

        bench.measure.memory_model adds the inputs (and gradients in fwd_bwd) and skips a case that cannot fit in the
        device's free memory instead of running it into an out-of-memory error. Count only what the call
        certainly holds at once (e.g. the (B, H, N, N) scores of a dense implementation): an overestimate
        would skip a case that fits.
        """
        return None

    def expected_comm_bytes(self, case: Case) -> int | None:
        """Distributed implementations: total bytes all ranks send, in closed form."""
        return None


_REGISTRY: dict[str, type[Impl]] = {}
_INSTANCES: dict[str, Impl] = {}


def artifact_path(name: str) -> Path:
    """Where an implementation keeps a file for the user to read (a whole compiler log): the run directory under
    `bench run`, else a directory of this package's in the system's temporary directory."""
    directory = Path(os.environ.get(RUN_DIR_ENV) or Path(tempfile.gettempdir()) / "sparse-attention-bench")
    directory.mkdir(parents=True, exist_ok=True)
    return directory / name


def register(cls: type[Impl]) -> type[Impl]:
    """Class decorator adding an implementation to the registry. Names are unique."""
    name = getattr(cls, "name", "")
    if not isinstance(name, str) or not name or not name.replace("_", "").isalnum() or name != name.lower():
        raise ValueError(f"{cls.__qualname__}: name must be lowercase letters, digits and '_', got {name!r}")
    previous = _REGISTRY.get(name)
    if previous is not None and previous is not cls:
        same_definition = (previous.__module__, previous.__qualname__) == (cls.__module__, cls.__qualname__)
        if not same_definition:
            raise ValueError(f"implementation name {name!r} is already registered by "
                             f"{previous.__module__}.{previous.__qualname__}")
        _INSTANCES.pop(name, None)  # the same module imported again: the newer class wins
    cls.source = source_of(cls.__module__)
    _REGISTRY[name] = cls
    return cls


def _load_builtin() -> None:
    import impls  # noqa: F401 - registers the built-in implementations

    load_entry_points()


def names() -> list[str]:
    _load_builtin()
    return list(_REGISTRY)


def get(name: str) -> Impl:
    """The implementation registered under `name`. Raises KeyError listing the known names."""
    _load_builtin()
    if name not in _REGISTRY:
        raise KeyError(f"unknown implementation {name!r}; known: {', '.join(sorted(_REGISTRY))}")
    if name not in _INSTANCES:
        _INSTANCES[name] = _REGISTRY[name]()
    return _INSTANCES[name]


def all_impls() -> list[Impl]:
    return [get(n) for n in names()]
