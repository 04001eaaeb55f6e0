"""The `bench` command line (docs/DESIGN.md "Command line"): `main` parses and dispatches; each command's parser
and handler live in the module of its group (`run`: measuring; `results`: reading results; `machine`: what is
here and what a case sees; `interop`: other tools' formats).

Exit codes: 0 success; 1 a run had a failed or incorrect case, or compare found a regression; 2 bad input,
printed as one message naming the file, the field, the value given and what is allowed - no traceback.
"""

from __future__ import annotations

import argparse
import sys

from bench.cli import interop, machine, results
from bench.cli import run as run_commands
from bench.cli.common import DEVICES, EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK
from bench.errors import BadInput

__all__ = ["DEVICES", "EXIT_BAD_INPUT", "EXIT_FAILED", "EXIT_OK", "build_parser", "main"]

# The order `bench --help` lists them in.
_ORDER = ("run", "list", "compare", "ab", "history", "export", "import", "dashboard", "env", "calibrate", "model",
          "profile", "inputs", "capture", "submit")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bench", description="Benchmark and profile sparse attention.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    adders = {add.__name__.removeprefix("add_"): add
              for module in (run_commands, results, machine, interop) for add in module.COMMANDS}
    for name in _ORDER:
        adders.pop(name)(sub)
    assert not adders, f"commands missing from _ORDER: {sorted(adders)}"
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except BadInput as exc:
        print(f"bench {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(f"bench {args.command}: interrupted; records written so far are kept", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
