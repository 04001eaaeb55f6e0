"""Other tools' formats: `bench import flashinfer-trace ROOT` (docs/flashinfer.md). `bench export --format
flashinfer-trace` is `bench export`'s (bench/cli/results.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.cli.common import EXIT_BAD_INPUT, EXIT_OK, make_console


def _cmd_import(args: argparse.Namespace) -> int:
    from bench.interop.flashinfer.importer import DEFAULT_IMPLS, import_dataset, suite_name
    from bench.interop.flashinfer.report import print_import

    root = Path(args.root)
    out = Path(args.output) if args.output else Path(f"{suite_name(root)}.yaml")
    if not out.resolve().parent.is_dir():
        from bench.errors import BadInput

        raise BadInput("the suite's directory does not exist", file=str(out), field="-o")
    report = import_dataset(root, out, list(args.impl or DEFAULT_IMPLS), check=not args.no_check, name=args.name)
    print_import(report, make_console())
    return EXIT_BAD_INPUT if report.problems else EXIT_OK


def add_import(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("import", help="a FlashInfer Trace dataset as a suite (its solutions as implementations)",
                       description="Each workload of a definition that maps (gqa_ragged prefill, gqa_paged prefill "
                                   "and decode) becomes a case; its reference run() is checked against the float64 "
                                   "oracle once per workload. Exit 2 when a file of the dataset is at fault (the "
                                   "rest is imported).")
    p.add_argument("format", choices=["flashinfer-trace"], help="the dataset's format")
    p.add_argument("root", metavar="ROOT", help="the dataset's root (definitions/, workloads/, solutions/)")
    p.add_argument("-o", "--output", metavar="SUITE.yaml", help="the suite to write (default: ./<ROOT's name>.yaml)")
    p.add_argument("--impl", action="append", metavar="NAME",
                   help="our implementations to list beside the dataset's (repeatable; default: sdpa, blocked)")
    p.add_argument("--name", help="the suite's name (default: from ROOT's directory name)")
    p.add_argument("--no-check", action="store_true", help="do not run the definitions' reference code")
    p.set_defaults(func=_cmd_import)


COMMANDS = (add_import,)
