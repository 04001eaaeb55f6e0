"""What a suite checks of each case once it is expanded: constraints between its fields (pattern, shapes,
grouped-query heads, layouts), a selection's selector and amount, a paged cache, score modifications, captured
inputs, and the pattern's own constraints; each failure a BadInput naming the file and the field."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from bench.errors import BadInput
from bench.inputs import InputsError
from bench.inputs import files as input_files
from bench.models.spec import model_config
from bench.patterns import PATTERNS, PatternError
from bench.patterns.score_mods import case_problems as score_mod_problems
from bench.selection import allowed_units, get_selector, selector_names
from bench.spec.case import Case


def _check_selection(case: Case, where: Any, bad: Any) -> None:
    """A selection case: a known selector, the amount it takes, a budget the base pattern can give."""
    if case.selector is None:
        name = "budget" if case.budget is not None else "threshold"
        raise bad(f"got {name} with no selector; {name} is what a selector keeps: set `selector` too "
                  f"(known: {', '.join(selector_names())})", name)
    try:
        info = get_selector(case.selector)
    except KeyError as exc:
        raise bad(f"got {case.selector!r}; {exc.args[0].split('; ')[-1]}", "selector") from None
    if info.takes == "budget" and case.budget is None:
        raise bad(f"selector {info.name} keeps a budget of {info.kv_unit}s per query {info.q_unit}: set `budget` "
                  "(a count, or a fraction in (0, 1] of the units the base pattern allows)", "budget")
    if info.takes == "threshold" and case.threshold is None:
        raise bad(f"selector {info.name} keeps the units reaching a share of the attention mass: set `threshold` "
                  "in (0, 1]", "threshold")
    if info.takes is None and (case.budget is not None or case.threshold is not None):
        name = "budget" if case.budget is not None else "threshold"
        raise bad(f"got {name} {case.budget if name == 'budget' else case.threshold}; selector {info.name} is fixed "
                  f"(registered with takes=None): its cases take no budget or threshold", name)
    if isinstance(case.budget, int) and not isinstance(case.budget, bool):
        allowed = allowed_units(case.make_pattern(), info.q_unit_size(case), info.kv_unit_size(case))
        most = int(allowed.sum(dim=-1).max()) if allowed.numel() else 0
        if case.budget > most:
            raise bad(f"got {case.budget}; the base pattern {case.pattern_label()} allows at most {most} "
                      f"{info.kv_unit}s of {info.kv_unit_size(case)} keys per query {info.q_unit} (seq_len "
                      f"{case.seq_len}): allowed budget 1..{most}, or a fraction in (0, 1]", "budget")


def _check_paging(case: Case, bad: Any) -> None:
    """A paged KV cache: pages of a power-of-two size aligned with the blocks, for inference; lengths per
    sequence that the batch and the queries allow."""
    size = case.page_size
    if size is None:
        raise bad("got kv_lens with no page_size; sequences of their own lengths share a paged pool: set "
                  "page_size (a power of two, e.g. 16 as vLLM and FlashInfer use)", "kv_lens")
    if size & (size - 1):
        allowed = [2**i for i in range(0, 13)]
        raise bad(f"got {size}; a page holds a power of two of tokens: allowed {allowed}", "page_size")
    if case.block_size % size and size % case.block_size:
        raise bad(f"got {size} with block_size {case.block_size}; pages and blocks must align (one divides the "
                  f"other): allowed page_size {[2**i for i in range(13) if case.block_size % 2**i == 0]} or a "
                  f"multiple of {case.block_size}", "page_size")
    if case.mode != "fwd":
        raise bad(f"got page_size with mode {case.mode!r}; a paged KV cache is read in inference (decode): "
                  "allowed mode fwd", "page_size")
    if isinstance(case.kv_lens, tuple):
        if len(case.kv_lens) != case.batch:
            raise bad(f"got {len(case.kv_lens)} lengths for batch {case.batch}; kv_lens lists one length per "
                      "sequence", "kv_lens")
        for length in case.kv_lens:
            if not case.n_queries <= length <= case.seq_len:
                raise bad(f"got {length}; each length must be between q_len {case.n_queries} and seq_len "
                          f"{case.seq_len} (a sequence's queries are its last q_len positions)", "kv_lens")


def check_case(case: Case, origin: dict[str, str], file: str) -> None:
    """Constraints between fields of one case: pattern name, shapes, and what the pattern needs of its fields."""
    where = lambda name: origin.get(name, name)  # noqa: E731 - unset fields are named as themselves

    def bad(message: str, name: str) -> BadInput:
        if name not in origin and name != "pattern":
            message += f"; set defaults.{name} or sweep it"
        return BadInput(message, file=file, field=where(name))

    if case.pattern not in PATTERNS:
        raise BadInput(f"got {case.pattern!r}; known patterns: {', '.join(sorted(PATTERNS))}",
                       file=file, field=where("pattern"))
    if case.checkpoint and case.mode != "fwd_bwd":
        raise BadInput(f"got checkpoint: true with mode {case.mode!r}; checkpointing recomputes attention in "
                       "backward, so it needs mode fwd_bwd", file=file, field=where("checkpoint"))
    if case.kv_heads is not None and case.heads % case.kv_heads:
        divisors = [d for d in range(1, case.heads + 1) if case.heads % d == 0]
        raise bad(f"got {case.kv_heads} with heads {case.heads}; grouped-query attention needs heads % kv_heads "
                  f"== 0: allowed kv_heads {divisors}", "kv_heads")
    if case.cp_layout != "contiguous" and case.world_size < 2:
        raise bad(f"got cp_layout {case.cp_layout!r} with world_size {case.world_size}; a layout places sequence "
                  "chunks on ranks, so it needs world_size >= 2 (allowed with world_size 1: 'contiguous')",
                  "cp_layout")
    if case.ulysses_degree is not None and case.world_size % case.ulysses_degree:
        divisors = [d for d in range(1, case.world_size + 1) if case.world_size % d == 0]
        raise bad(f"got {case.ulysses_degree} with world_size {case.world_size}; Ulysses groups of ulysses_degree "
                  f"ranks must tile the ranks: allowed ulysses_degree {divisors} (or null)", "ulysses_degree")
    if case.selector is not None or case.budget is not None or case.threshold is not None:
        _check_selection(case, where, bad)
    if case.page_size is not None or case.kv_lens is not None:
        _check_paging(case, bad)
    for name, message in score_mod_problems(case):
        raise bad(message, name)
    sinks_problem = case.sinks_problem()
    if sinks_problem:
        raise bad(sinks_problem, "sinks")
    if case.model is not None:
        _check_model(case, bad)
    if case.inputs.kind == "file":
        try:
            input_files.check_shapes(case.inputs, batch=case.batch, heads=case.heads, kv_heads=case.n_kv_heads,
                                     head_dim=case.head_dim, seq_len=case.seq_len, q_len=case.n_queries)
        except InputsError as exc:
            raise BadInput(exc.message, file=file, field=where("inputs")) from None
    try:
        pattern = case.make_pattern()
        if PATTERNS[case.pattern].source != "built-in":
            pattern.probe()  # a custom predicate that raises or returns no bool fails here, not mid-run
    except PatternError as exc:
        name = exc.field or "pattern"
        message = exc.message if exc.field else f"pattern {exc.pattern}: {exc.message}"
        if case.pattern not in message:
            message += f" (pattern {case.pattern})"
        raise bad(message, name) from None


def _check_model(case: Case, bad: Any) -> None:
    """A model case: a causal base pattern (a language model must not see later tokens), layers the model has,
    a selection or static pattern of one sequence (no paged cache, no distributed run)."""
    if case.world_size > 1 or case.page_size is not None or case.q_len not in (None, case.seq_len):
        name = "world_size" if case.world_size > 1 else ("page_size" if case.page_size is not None else "q_len")
        raise bad(f"got {name} {getattr(case, name)} with a model: a model case runs the model's own forward, one "
                  "sequence of seq_len tokens at a time (world_size 1, no page_size, q_len = seq_len)", name)
    n = min(case.seq_len, 256)
    probe = replace(case, seq_len=n, q_len=None, documents=None, model=None, task=None, train=None, layers=None)
    mask = probe.make_pattern().dense_mask()
    later = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)
    if bool((mask & later).any()):
        raise bad(f"got pattern {case.pattern_label()} with a model: it lets a token see later ones, which a causal "
                  "language model must not: use a causal pattern (causal, causal_local, sink, block_causal "
                  "selections over causal, ...)", "pattern")
    layers = int(model_config(case.model).get("num_hidden_layers") or 0)
    bad_layers = [i for i in case.layers or () if layers and i >= layers]
    if bad_layers:
        raise bad(f"got layers {list(case.layers or ())}; the model has {layers} layers (0..{layers - 1})", "layers")
