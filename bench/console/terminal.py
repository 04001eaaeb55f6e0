"""The terminal: one way to make a rich Console, and the colour of each record status."""

from __future__ import annotations

import os
from typing import Any

from rich.console import Console

STATUS_STYLE = {"ok": "green", "skipped": "yellow", "failed": "red", "incorrect": "magenta"}


class LineConsole(Console):
    """A Console that prints a message (plain strings) as one line, never folded at the console's width: the
    paths and run ids in messages stay whole to copy from a log, and the terminal wraps what it must.
    Tables and panels still lay out to the width."""

    def print(self, *objects: Any, **kwargs: Any) -> None:
        if "soft_wrap" not in kwargs and objects and all(isinstance(o, str) for o in objects):
            kwargs["soft_wrap"] = True
        super().print(*objects, **kwargs)


def make_console(stderr: bool = False) -> Console:
    """Plain when not a terminal; 160 columns wide in logs unless COLUMNS says otherwise."""
    console = LineConsole(stderr=stderr, highlight=False, soft_wrap=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = 160  # logs are read in wide viewers; 80 columns would fold every table
    return console
