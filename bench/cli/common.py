"""What every command module shares: the exit codes, the device choices and the console."""

from __future__ import annotations

from bench.console.terminal import make_console

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2

# bench.spec.case.DEVICES (tests hold them equal), not imported: it imports torch, which `bench --help` needs not
DEVICES = ("auto", "cpu", "cuda")

__all__ = ["DEVICES", "EXIT_BAD_INPUT", "EXIT_FAILED", "EXIT_OK", "make_console"]
