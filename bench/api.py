"""The Python API: `attention` runs one implementation once; `run` runs a whole suite, as `bench run` does.

This is a public module (docs/DESIGN.md "Implementations"): tests, notebooks and scripts call these.
"""

from __future__ import annotations

import io
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from bench import registry
from bench.errors import Unavailable
from bench.measure.case.prepare import prepare
from bench.measure.oracle.reference import check_shapes
from bench.patterns import Pattern
from bench.patterns.score_mods import case_problems as score_mod_case_problems
from bench.results.records import Record
from bench.selection import SHARED, Selection, get_selector, run_selector, unit_size
from bench.spec.case import DTYPES, Case

__all__ = ["Unavailable", "attention", "case_for", "run", "select", "swap_attention"]

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


def attention(impl_name: str, q: Tensor, k: Tensor, v: Tensor, pattern: Pattern,
              selection: Selection | Tensor | str | None = None, *, q_unit: int | str = "block",
              kv_unit: int | str = "block", shared: str = "head", block_size: int | None = None,
              score_mod: str | None = None, **fields: Any) -> Tensor:
    """Attention under `pattern` with scale 1/sqrt(D), by implementation `impl_name`: (B, H, q_len, D).

    q (B, H, q_len, D); k, v (B, Hkv, seq_len, D) with H % Hkv == 0, query head h reading KV head
    h // (H / Hkv). Differentiable when q, k or v require grad and the implementation supports fwd_bwd.
    `selection`: attend only over the key units a selector chose (bench.selection), a `Selection` or its indices
    int32 (B, H_sel, query units, K) with `q_unit`, `kv_unit` (1, a number of keys, or row/token, block, page)
    and `shared`, or a selector's name, run on (q, k) with the `budget` or `threshold` keyword (`"msa",
    budget=8`); `pattern` is then the base pattern. `score_mod` (softcap, alibi, relative_bias or a registered
    name) modifies the scaled scores before the mask, with its case fields as keywords (`softcap=50.0`); other case
    fields are keywords too (`sinks="learned"` or one logit per query head, `budget`). Raises
    `bench.errors.Unavailable` with the reason when the implementation cannot run here or this case, ValueError
    for a bad selection or score modification.
    """
    check_inputs(q, k, v, pattern)
    try:
        impl = registry.get(impl_name)
    except KeyError as exc:
        raise ValueError(exc.args[0]) from None
    wants_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    case = case_for(q, pattern, "fwd_bwd" if wants_grad else "fwd", k)
    if block_size is not None:
        case = replace(case, block_size=block_size)
    case = with_score_mod(case, score_mod, fields)
    if selection is not None and case.score_mod != "none":
        raise ValueError(f"score_mod {case.score_mod!r} with a selection: score modifications are measured on "
                         "static patterns only (selection=None)")
    if isinstance(selection, str):  # a selector's name: its selection of these inputs, with the case's amount
        selection = select_by_name(selection, q, k, case)
    chosen = None if selection is None else as_selection(selection, case, q_unit, kv_unit, shared)
    grad_out = None  # the caller runs the backward: the call is the forward alone
    prepared = prepare(impl, case, pattern, q, k, v, grad_out, selection=chosen)
    return prepared.output


def with_score_mod(case: Case, score_mod: str | None, fields: dict[str, Any]) -> Case:
    """`case` with a score modification and the case fields it reads; ValueError naming what is wrong."""
    unknown = sorted(set(fields) - set(Case.field_names()))
    if unknown:
        raise ValueError(f"attention() got unknown keyword(s) {unknown}; the keywords after score_mod are case "
                         f"fields (softcap, window, ...): {', '.join(Case.field_names())}")
    case = replace(case, score_mod=score_mod or "none", **fields)
    problems = score_mod_case_problems(case)
    if problems:
        raise ValueError(f"{problems[0][0]}: {problems[0][1]}")
    if case.sinks_problem():
        raise ValueError(f"sinks: {case.sinks_problem()}")
    return case


def as_selection(selection: Selection | Tensor, case: Case, q_unit: int | str, kv_unit: int | str,
                 shared: str) -> Selection:
    """A validated Selection from a Selection or indices with their units (ValueError naming the problem)."""
    if not isinstance(selection, Selection):
        sizes = [unit_size(u, case.block_size) if isinstance(u, str) else int(u) for u in (q_unit, kv_unit)]
        if shared not in SHARED:
            raise ValueError(f"shared {shared!r}; allowed: {', '.join(SHARED)}")
        selection = Selection(selection, sizes[0], sizes[1], shared)  # type: ignore[arg-type]
    selection.validate(case.batch, case.heads, case.n_kv_heads, case.n_queries, case.seq_len)
    return selection


def select_by_name(name: str, q: Tensor, k: Tensor, case: Case) -> Selection:
    """The named selector's selection for `attention`: ValueError for an unknown name or a missing amount."""
    try:
        takes = get_selector(name).takes
    except KeyError as exc:
        raise ValueError(exc.args[0]) from None
    missing = (takes == "budget" and case.budget is None) or (takes == "threshold" and case.threshold is None)
    if missing:
        allowed = "a count of units, or a fraction in (0, 1] of what the pattern allows" if takes == "budget" \
            else "a mass in (0, 1]"
        raise ValueError(f"selector {name!r} keeps a {takes}: give {takes}= ({allowed})")
    return select(name, q, k, replace(case, selector=name))


def select(selector_name: str, q: Tensor, k: Tensor, case: Case) -> Selection:
    """The Selection selector `selector_name` makes of (q, k) for `case` (its block_size, budget, threshold,
    base pattern, ...), validated. KeyError for an unknown selector, SelectionError for an invalid output."""
    chosen = run_selector(get_selector(selector_name), q, k, case)
    chosen.validate(case.batch, case.heads, case.n_kv_heads, case.n_queries, case.seq_len)
    return chosen


def run(suite: str | Path | dict[str, Any], out: str | Path = "results", *, impls: list[str] | None = None,
        device: str | None = None, quiet: bool = False) -> list[Record]:
    """Run a suite as `bench run` does and return the records it wrote (also stored under `out`).

    `suite`: a suite file, or a dict with the suite file's schema (plugins relative to the working directory).
    Raises `bench.errors.BadInput` for a bad suite, like the command line's exit code 2. `quiet`: no progress
    or summary on the terminal.
    """
    from bench.console.terminal import make_console
    from bench.run.runner import RunOptions
    from bench.run.runner import run as run_suite
    from bench.spec.suite import load_suite, parse_suite

    parsed = parse_suite(suite, file="<dict>", base_dir=Path.cwd()) if isinstance(suite, dict) \
        else load_suite(Path(suite))
    console = make_console()
    if quiet:
        from rich.console import Console

        console = Console(file=io.StringIO(), width=160)
    records: list[Record] = []
    run_suite(RunOptions(suite=parsed, impls=list(impls or []), device=device, out=Path(out)), console,
              on_record=records.append)
    return records


def swap_attention(model: Any, impl_name: str, selector: str | None = None, budget: int | float | None = None,
                   threshold: float | None = None, pattern: str = "causal", layers: list[int] | None = None,
                   **fields: Any) -> Any:
    """A context manager routing a transformers model's attention layers through `impl_name` (with `selector`,
    `budget`, `threshold` over the base `pattern`, and any case field) for a user's own evaluation loop:

        with bench.api.swap_attention(model, "blocked", selector="moba", budget=0.125):
            logits = model(input_ids).logits

    `layers`: the indices of the layers to swap (None: every one). The model is back on its own attention after
    the block. ValueError for an unknown implementation, selector or field (bench.measure.quality.swap)."""
    from bench.measure.quality.swap import swap_attention as swap

    return swap(model, impl_name, selector, budget, threshold, pattern, layers, **fields)
