"""`bench list`: implementations with availability, patterns with their fields, selectors with their units."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from bench import registry
from bench.patterns import PATTERNS, SCORE_MODS
from bench.selection import get_selector, selector_names

NARROW = 120  # columns below which `bench list` folds each implementation's facts into one cell


def impls_table(width: int | None = None) -> Table:
    """Every implementation with its availability; below NARROW columns, one row per implementation whose second
    cell holds the facts and, below them, the description (a table of seven columns folds into one word a line)."""
    table = Table(title="implementations")
    narrow = width is not None and width < NARROW
    columns = ("name", "available, devices, backward, distributed, source / description") if narrow else \
        ("name", "available", "devices", "fwd_bwd", "distributed", "source", "description")
    for column in columns:
        table.add_column(column, no_wrap=column == "name")
    for impl in registry.all_impls():
        why = impl.unavailable()
        cells = ["yes" if why is None else f"no: {escape(why)}", ",".join(sorted(impl.devices)),
                 "yes" if impl.fwd_bwd else "no", "yes" if impl.distributed else "no", escape(impl.source)]
        if narrow:
            facts = f"{cells[0]}; {cells[1]}; backward {cells[2]}; distributed {cells[3]}; {cells[4]}"
            table.add_row(impl.name, f"{facts}\n[dim]{escape(impl.description)}[/]")
        else:
            table.add_row(impl.name, *cells, escape(impl.description))
    return table


def patterns_table() -> Table:
    registry.names()  # installed plugin packages register their patterns too
    table = Table(title="patterns (i = query position, j = key position)")
    for column in ("name", "fields", "source", "allowed(i, j)"):
        table.add_column(column)
    for name, cls in PATTERNS.items():
        table.add_row(name, ", ".join(cls.fields) or "-", escape(cls.source), escape(cls.description))
    table.caption = ("every pattern also takes q_len (the last q_len positions are the queries) and documents "
                     "(packed documents: the pattern applies inside each, on positions relative to its start)")
    return table


def score_mods_table() -> Table:
    """The score modifications (case field `score_mod`), with the implementations that apply each."""
    table = Table(title="score modifications (score_mod: applied to the scaled scores s before the mask)")
    for column in ("name", "fields", "source", "applied by", "modification"):
        table.add_column(column)
    impls = registry.all_impls()
    for name, info in SCORE_MODS.items():
        kind = name if info.factory is None else "custom"
        takers = [i.name for i in impls if kind in i.score_mods]
        table.add_row(name, ", ".join(info.fields) or "-", escape(info.source), ", ".join(takers) or "-",
                      escape(info.description))
    table.caption = "the others skip such cases with the reason; `none` (the default) leaves the scores as they are"
    return table


def selectors_table() -> Table:
    """The selectors (bench.selection), with their units and the implementations that attend over them."""
    registry.names()  # installed plugin packages register their selectors too
    table = Table(title="selectors (data-dependent sparse attention: key units chosen from q, k)")
    for column in ("name", "query unit", "key unit", "shared by", "keeps", "source", "attended by", "description"):
        table.add_column(column)
    impls = registry.all_impls()
    probe = registry.Case()
    for name in selector_names():
        info = get_selector(name)
        takers = [i.name for i in impls
                  if i.unsupported_selection(probe, info.q_unit, info.kv_unit, info.shared) is None]
        keeps = {"budget": "a budget", "threshold": "a threshold of mass", "optional_budget": "a budget if given",
                 None: "a fixed selection"}[info.takes]
        keeps += " (reference)" if info.reference else ""
        table.add_row(name, info.q_unit, info.kv_unit, info.shared, keeps, escape(info.source),
                      ", ".join(takers) or "-", escape(info.description))
    table.caption = "docs/selectors.md: what each computes, where it simplifies its paper, its cost"
    return table


def models_table() -> Table:
    """The built-in models with their cards: what they answer, their shape, how they were made."""
    from bench.models.spec import BUILTIN_MODELS, attention_shape, card

    table = Table(title="built-in models (case field `model`; or a local model directory)")
    for column in ("name", "task", "attention", "made by", "dense accuracy", "description"):
        table.add_column(column)
    for name, model in BUILTIN_MODELS.items():
        info = card(name)
        try:
            heads, kv_heads, head_dim, positions = attention_shape(name)
            shape = f"H{heads}/{kv_heads} D{head_dim}, {positions} positions"
        except Exception as exc:  # a missing or damaged model directory is shown, not fatal to the listing
            shape = f"unavailable: {exc}"
        made = str(info.get("made_by") or "-")
        accuracy = ((info.get("evaluation") or {}).get("accuracy") or {}).get("float32") or {}
        by_length = ", ".join(f"{n}: {a.get('accuracy', float('nan')):.3f}" for n, a in accuracy.items()
                              if isinstance(a, dict))
        table.add_row(name, model.task, shape, escape(made[:60]), escape(by_length or "-"), escape(model.description))
    table.caption = "each model's card: bench/models/<name>/README.md and card.json"
    return table


def tasks_table() -> Table:
    from bench.models.spec import BUILTIN_TASKS

    table = Table(title="tasks (case field `task`)")
    for column in ("task", "metric", "what it scores"):
        table.add_column(column)
    for name, description in BUILTIN_TASKS.items():
        table.add_row(name, "accuracy", escape(description))
    table.add_row("{text: FILE}", "ppl", "perplexity on a UTF-8 text, tokenized by the model directory's tokenizer")
    table.add_row("{tokens: FILE}", "ppl", "perplexity on token ids: a JSON list of lists, or safetensors input_ids")
    return table


def list_command(what: str, console: Console) -> int:
    if what == "impls":
        console.print(impls_table(console.width))
    elif what == "patterns":
        console.print(patterns_table())
        console.print(score_mods_table())
    elif what == "selectors":
        console.print(selectors_table())
    elif what == "models":
        console.print(models_table())
    elif what == "tasks":
        console.print(tasks_table())
    else:
        from bench.measure.machine.hardware import hardware_table

        console.print(hardware_table())
    return 0
