"""The terminal: one way to make a rich Console, and the colour of each record status."""

from __future__ import annotations

import os

from rich.console import Console

STATUS_STYLE = {"ok": "green", "skipped": "yellow", "failed": "red", "incorrect": "magenta"}


def make_console(stderr: bool = False) -> Console:
    """Plain when not a terminal; 160 columns wide in logs unless COLUMNS says otherwise."""
    console = Console(stderr=stderr, highlight=False, soft_wrap=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = 160  # logs are read in wide viewers; 80 columns would fold every table
    return console
