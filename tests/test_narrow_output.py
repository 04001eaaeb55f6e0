"""`bench run`'s summary lays out to the terminal's width: at 80, 100 and 200 columns, on a terminal or not, no
cell is wrapped or cut ("skipp…") and no implementation's column is dropped."""

from __future__ import annotations

import io

import numpy as np
import pytest
from rich.cells import cell_len
from rich.console import Console

from bench.run.console import print_summary
from tests.synthetic import record

IMPLS = ["naive_loop", "dense", "sdpa", "csr", "blocked", "flex", "triton_block_sparse", "cp_ring"]
LABELS = {f"c{i}": f"bigbird_w256_g64_p0.1 N={1024 << i} B1H16D64 bf16 fwd_bwd" for i in range(3)}
STATUS = {"naive_loop": "skipped", "csr": "failed", "cp_ring": "incorrect"}


def records():
    out = []
    for case_id in LABELS:
        for impl in IMPLS:
            status = STATUS.get(impl, "ok")
            out.append(record(case_id, impl, np.full(5, 1.234e-3) if status != "skipped" else None, status=status))
    return out


@pytest.mark.parametrize("terminal", [True, False])
@pytest.mark.parametrize("width", [80, 100, 200])
def test_the_summary_fits_the_width_and_keeps_every_cell_whole(width, terminal):
    buffer = io.StringIO()
    console = Console(file=buffer, width=width, force_terminal=terminal, color_system=None, highlight=False)
    print_summary(console, records(), LABELS, IMPLS)
    text = buffer.getvalue()
    lines = text.splitlines()
    table_lines = [ln for ln in lines if ln[:1] in "┏┃┡│└┗╇╭╰"]
    assert table_lines and all(cell_len(ln) <= width for ln in table_lines), width
    assert "…" not in text
    for impl in IMPLS:  # every column is there, with its cells whole
        assert any(f" {impl} " in ln for ln in table_lines), impl
    cells = [c.strip() for ln in table_lines if ln.startswith("│") for c in ln.strip("│").split("│")]
    assert cells.count("skipped") == 3 and cells.count("failed") == 3 and cells.count("incorrect") == 3
    assert cells.count("1.23 ms") == 3 * 5
    if width >= 200:  # wide enough for one table
        assert sum(ln.startswith("┏") for ln in lines) == 1


@pytest.mark.parametrize("width", [80, 100, 200])
def test_compare_keeps_every_column_at_any_width(tmp_path, capsys, monkeypatch, width):
    """The case column folds; ratio, interval, p, q and verdict are never cut or dropped (the table of every pair,
    --all; the default output counts advisory verdicts instead)."""
    from bench.cli import main
    from tests.test_compare import _mixed_scenario

    base, new = _mixed_scenario(tmp_path)
    monkeypatch.setenv("COLUMNS", str(width))
    main(["compare", str(base), str(new), "--all"])
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert all(cell_len(ln) <= width for ln in lines if ln[:1] in "┏┃┡│└├") and "…" not in out
    for figure in ("1.300", "0.700", "1.7e-07", "[1.28, 1.32]", "SLOWER", "FASTER", "SAME", "AMBIGUOUS",
                   "ok -> incorrect"):  # whole, on one line each
        assert any(figure in ln for ln in lines), figure
    if width >= 200:  # one row per pair, every column
        header = next(ln for ln in lines if "ratio" in ln and "verdict" in ln)
        for column in ("case", "impl", "base", "new", "ratio", "interval", "p", "q", "verdict"):
            assert f" {column} " in header, (column, header)
