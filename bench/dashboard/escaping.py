"""Results are data: every string that comes from a suite file, run.json or records.jsonl is escaped here.

Three places a string can end up, three escapes:

- HTML text and attributes: `html_text` (the jinja2 templates also autoescape everything they print).
- Plotly text fields (trace names, hover text, titles, axis categories): plotly.js renders a subset of HTML in
  them (`<b>`, `<a href>`, `<br>`, entities), so a record string is HTML-escaped before it goes into a figure;
  plotly decodes the entities back and shows the literal characters. Our own markup (`<br>`, `<sup>`) is added
  around already escaped text, never inside it.
- JSON inside a `<script>` element: `script_json` escapes `<`, `>` and `&` (and the two JavaScript line
  separators) as `\\u003c`-style escapes, so no string in the data can close the script element or open a
  comment; JSON.parse turns them back into the same characters.
"""

from __future__ import annotations

import html
import json
import math
from typing import Any

_SCRIPT_ESCAPES = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028",
                                  "\u2029": "\\u2029"})


def html_text(value: object) -> str:
    """Any value as HTML-safe text (quotes included, so it is safe in attributes too)."""
    return html.escape(str(value), quote=True)


def plot_text(value: object) -> str:
    """A data string for a plotly text field: shown literally, never rendered as markup.

    Only `&`, `<` and `>` are escaped: plotly decodes exactly those entities (and numeric ones) back, but shows
    `&quot;` literally; without `<` no tag can start, so quotes are harmless in its text.
    """
    return html.escape(str(value), quote=False)


def script_json(data: Any) -> str:
    """Compact JSON that is safe to place between <script> tags (no `</script>`, `<!--`, `&` possible)."""
    text = json.dumps(data, separators=(",", ":"), allow_nan=False, ensure_ascii=False)
    return text.translate(_SCRIPT_ESCAPES)


def round_floats(data: Any, digits: int = 5) -> Any:
    """`data` with every float rounded to `digits` significant digits (keeps the page data small).

    Non-finite floats become None: JSON has no NaN, and plotly treats null as a gap.
    """
    if isinstance(data, float):
        if not math.isfinite(data):
            return None
        return float(f"{data:.{digits}g}")
    if isinstance(data, dict):
        return {k: round_floats(v, digits) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [round_floats(v, digits) for v in data]
    return data
