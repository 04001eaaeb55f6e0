"""Reading results: `bench compare`, `bench ab`, `bench history`, `bench export`, `bench dashboard`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.cli.common import DEVICES, make_console
from bench.errors import BadInput


def _cmd_compare(args: argparse.Namespace) -> int:
    import json

    from bench.analysis.compare import compare_specs
    from bench.analysis.report import print_comparison

    result = compare_specs(args.base, args.new, results=Path(args.results) if args.results else None, suite=args.suite,
                           threshold_pct=args.threshold, alpha=args.alpha, deterministic_only=args.deterministic_only)
    if args.json:
        for warning in result.warnings:
            print(f"bench compare: WARNING: {warning}", file=sys.stderr)
        print(json.dumps(result.to_json(), indent=2))
    else:
        print_comparison(result, make_console(), make_console(stderr=True), show_all=args.all)
    return result.exit_code


def add_compare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="which cases got slower or faster between two runs or commits")
    p.add_argument("base", metavar="BASE", help="run directory, or a commit id prefix found in the results store")
    p.add_argument("new", metavar="NEW", help="run directory, or a commit id prefix found in the results store")
    p.add_argument("--threshold", type=float, default=10.0, metavar="PCT",
                   help="smallest slowdown that counts, in percent (default 10: runs measured apart drift more than "
                        "bench ab's interleaved rounds, whose default is 5)")
    p.add_argument("--alpha", type=float, default=0.05, help="false discovery rate across cases (default 0.05)")
    p.add_argument("--json", action="store_true", help="print the whole result as JSON (every pair and figure)")
    p.add_argument("--all", action="store_true", help="list every pair and every figure change, not only the "
                   "regressions, the time changes and the path changes")
    p.add_argument("--results", metavar="DIR", help="results store for commit prefixes (default: results; refused "
                   "with two run directories)")
    p.add_argument("--suite", metavar="NAME", help="with a commit prefix: only runs of this suite (refused with two "
                   "run directories)")
    p.add_argument("--deterministic-only", action="store_true",
                   help="compare only exact figures (status, FLOPs, correctness, bytes), not times")
    p.set_defaults(func=_cmd_compare)


def _cmd_ab(args: argparse.Namespace) -> int:
    import json

    from bench.analysis.ab import check_levels, run_ab
    from bench.analysis.ab_report import markdown, print_ab
    from bench.run.ab.command import ABOptions

    check_levels(args.threshold, args.alpha)
    markdown_file = Path(args.markdown) if args.markdown else None
    if markdown_file is not None and not markdown_file.parent.is_dir():
        raise BadInput("the file's directory does not exist", file=str(markdown_file), field="--markdown")
    options = ABOptions(base=args.base, new=args.new, suite=args.suite, rounds=args.rounds, impls=args.impl or [],
                        out=Path(args.out), device=args.device, block_s=args.block_ms / 1e3, threads=args.threads,
                        max_rounds=args.max_rounds, budget_s=args.budget_s)
    console = make_console(stderr=True) if args.json else make_console()
    result = run_ab(options, console, threshold_pct=args.threshold, alpha=args.alpha)
    if markdown_file is not None:
        markdown_file.write_text(markdown(result), encoding="utf-8")
    print_ab(result, console, show_all=args.all)  # with --json on stderr (a CI log), the JSON alone on stdout
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    return result.exit_code


def add_ab(sub: argparse._SubParsersAction) -> None:
    from bench.run.ab.command import (
        BUDGET_FACTOR,
        DEFAULT_BLOCK_S,
        DEFAULT_MAX_ROUNDS_FACTOR,
        DEFAULT_ROUNDS,
        DEFAULT_THREADS,
    )

    DEFAULT_AB_THRESHOLD = 5.0  # bench.analysis.ab.DEFAULT_THRESHOLD_PCT (not imported here: scipy is slow)

    p = sub.add_parser("ab", help="two commits or checkouts measured side by side, interleaved: trustworthy verdicts",
                       description="Each side runs its own code and suite file in its own warm worker; every "
                                   "(case, impl) is timed in R rounds of short blocks, BASE and NEW in random order, "
                                   "and judged on the paired per-round ratios. Exit 1 on a regression.")
    p.add_argument("base", metavar="BASE", help="git revision of this repository, or a checkout directory")
    p.add_argument("new", metavar="NEW", help="git revision of this repository, or a checkout directory")
    p.add_argument("suite", metavar="SUITE.yaml", help="suite file, read by each side from its own checkout")
    p.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, metavar="R",
                   help=f"interleaved rounds per pair, the first look (default {DEFAULT_ROUNDS})")
    p.add_argument("--max-rounds", type=int, metavar="N",
                   help="rounds a pair may reach while its verdict is open, a trial of R more rounds on fresh "
                        f"workers per look (default {DEFAULT_MAX_ROUNDS_FACTOR} x R; R: no looks added)")
    p.add_argument("--budget-s", type=float, metavar="S",
                   help="no look is added once the run has taken S seconds (default: "
                        f"{BUDGET_FACTOR:g} x the time of the first pass over every pair)")
    p.add_argument("--threshold", type=float, default=DEFAULT_AB_THRESHOLD, metavar="PCT",
                   help="SLOWER needs the whole interval past this slowdown, in percent (default "
                        f"{DEFAULT_AB_THRESHOLD:g}); what is caught reliably is each verdict's MDE, a little more")
    p.add_argument("--alpha", type=float, default=0.05, help="false discovery rate across pairs (default 0.05)")
    p.add_argument("--impl", action="append", metavar="NAME", help="only this implementation (repeatable)")
    p.add_argument("--out", default="results", metavar="DIR", help="results root for both runs (default: results)")
    p.add_argument("--device", choices=DEVICES, help="override every case's device")
    p.add_argument("--block-ms", type=float, default=DEFAULT_BLOCK_S * 1e3, metavar="MS",
                   help=f"shortest timed block per side and round (default {DEFAULT_BLOCK_S * 1e3:g})")
    p.add_argument("--threads", type=int, default=DEFAULT_THREADS, metavar="N",
                   help=f"intra-op threads per worker, 0 for torch's default (default {DEFAULT_THREADS})")
    p.add_argument("--json", action="store_true",
                   help="print the result as JSON on stdout (progress and the report go to stderr)")
    p.add_argument("--markdown", metavar="FILE", help="also write the result as Markdown (a CI job summary)")
    p.add_argument("--all", action="store_true", help="list every pair, not only regressions and improvements")
    p.set_defaults(func=_cmd_ab)


def _cmd_history(args: argparse.Namespace) -> int:
    from bench.analysis.history import history_command

    return history_command(Path(args.results), args.suite, threshold_pct=args.threshold, as_json=args.json,
                           show_all=args.all, console=make_console(), include_uncommitted=args.uncommitted)


def add_history(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("history", help="per (case, impl) series over commits, with detected steps")
    p.add_argument("suite", nargs="?", metavar="SUITE", help="suite name (default: every suite)")
    p.add_argument("--results", default="results", metavar="DIR", help="results store (default: results)")
    p.add_argument("--threshold", type=float, default=5.0, metavar="PCT",
                   help="smallest step reported, in percent (default 5: a step is fitted over many commits' runs, so "
                        "it resolves less than compare's 10 between two sets of runs; bench ab's 5 comes from its "
                        "interleaved rounds)")
    p.add_argument("--all", action="store_true", help="list every series, not only those with steps")
    p.add_argument("--uncommitted", action="store_true", help="add the runs under DIR that git does not track "
                   "(default: only committed runs, the project's references)")
    p.add_argument("--json", action="store_true", help="print the series and steps as JSON")
    p.set_defaults(func=_cmd_history)


def _cmd_export(args: argparse.Namespace) -> int:
    if args.format == "flashinfer-trace":  # a dataset directory, written by bench.interop (above bench.results)
        from bench.interop.flashinfer.cli import export_trace

        return export_trace(Path(args.run), Path(args.output) if args.output else None, args.reference)
    from bench.results.export import export_command

    return export_command(Path(args.run), args.format, Path(args.output) if args.output else None)


def add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="a run as pytest-benchmark JSON, CSV, github-action-benchmark or Bencher JSON, "
                                      "or a FlashInfer Trace dataset")
    p.add_argument("run", metavar="RUN_DIR", help="the run directory to export (results/<run id>)")
    p.add_argument("--format", required=True,
                   choices=["pytest-benchmark", "csv", "github-action-benchmark", "bencher", "flashinfer-trace"],
                   help="github-action-benchmark: its customSmallerIsBetter JSON; bencher: Bencher Metric Format; "
                        "flashinfer-trace: a FlashInfer Trace dataset directory (-o ROOT; docs/flashinfer.md)")
    p.add_argument("-o", "--output", metavar="FILE", help="output file (default: stdout); flashinfer-trace: ROOT")
    p.add_argument("--reference", default="flashinfer_reference", metavar="IMPL",
                   help="flashinfer-trace: the implementation speedups are against (default: flashinfer_reference, "
                        "the definition's reference run())")
    p.set_defaults(func=_cmd_export)


def _cmd_dashboard(args: argparse.Namespace) -> int:
    from bench.dashboard import dashboard_command

    return dashboard_command(args.runs, Path(args.output), Path(args.results), make_console())


def add_dashboard(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dashboard", help="Plotly HTML pages of the results (offline; open DIR/index.html)")
    p.add_argument("runs", nargs="*", metavar="RUN_DIR", help="run directories (default: every run in --results)")
    p.add_argument("-o", "--output", default="dashboards", metavar="DIR", help="output directory (default: dashboards)")
    p.add_argument("--results", default="results", metavar="DIR", help="results store (default: results)")
    p.set_defaults(func=_cmd_dashboard)


COMMANDS = (add_compare, add_ab, add_history, add_export, add_dashboard,)
