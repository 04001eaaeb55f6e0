"""Terminal formatting."""

from __future__ import annotations

from bench.console.format import format_seconds


def test_console_time_format_rounds_into_the_next_unit():
    assert format_seconds(0.0009996) == "1 ms"
    assert format_seconds(0.000999) == "999 us"
    assert format_seconds(1.5) == "1.5 s"
    assert format_seconds(None) == "-"
