"""The `bench` command line (docs/DESIGN.md "Command line").

Exit codes: 0 success; 1 a run had a failed or incorrect case, or compare found a regression; 2 bad input,
printed as one message naming the file, the field, the value given and what is allowed - no traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.errors import BadInput
from bench.terminal import make_console

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2

# bench.spec.case.DEVICES (tests hold them equal), not imported: it imports torch, which `bench --help` needs not
DEVICES = ("auto", "cpu", "cuda")


def _cmd_run(args: argparse.Namespace) -> int:
    from bench.run.runner import RunOptions, run
    from bench.run.shards import parse_shard

    shard = parse_shard(args.shard) if args.shard is not None else None
    if args.run_id is not None and shard is None:
        raise BadInput(f"got {args.run_id!r} without --shard; --run-id names the run that shards share",
                       field="--run-id")
    options = RunOptions(suite=Path(args.suite), impls=args.impl or [], device=args.device, out=Path(args.out),
                         resume=Path(args.resume) if args.resume else None, dry_run=args.dry_run, shard=shard,
                         run_id=args.run_id, rank_group_shards=args.rank_group_shards)
    return run(options, make_console())


def _cmd_submit(args: argparse.Namespace) -> int:
    from bench.run.submit import SubmitOptions, submit

    if (args.suite is None) == (args.attach is None):
        raise BadInput("give SUITE.yaml to submit a run, or --attach RUN_DIR to watch one (not both)", field="SUITE")
    options = SubmitOptions(suite=Path(args.suite) if args.suite else None, executor=args.executor,
                            shards=args.shards, partition=args.partition, gpus_per_shard=args.gpus_per_shard,
                            time_limit=args.time, nodes_per_rank_group=args.nodes_per_rank_group, out=Path(args.out),
                            no_wait=args.no_wait, attach=Path(args.attach) if args.attach else None,
                            impls=args.impl or [])
    return submit(options, make_console())


def _add_submit(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("submit", help="run a suite as N shards on Slurm or as local processes, and watch them",
                       description="Every shard is `bench run SUITE --shard I/N` writing its part of one run; a "
                                   "shard that dies is submitted again for its missing pairs (docs/cluster.md).")
    p.add_argument("suite", nargs="?", metavar="SUITE.yaml")
    p.add_argument("--executor", default="local", help="slurm (a job array via sbatch) or local (processes "
                   "here; default)")
    p.add_argument("--shards", type=int, default=2, metavar="N", help="number of shards (default 2)")
    p.add_argument("--partition", metavar="P", help="Slurm partition")
    p.add_argument("--gpus-per-shard", type=int, default=0, metavar="G", help="GPUs per Slurm shard (default 0)")
    p.add_argument("--time", metavar="T", help="Slurm time limit per shard (e.g. 01:00:00)")
    p.add_argument("--nodes-per-rank-group", type=int, default=1, metavar="K",
                   help="nodes a multi-rank pair spans (only 1 here: see docs/cluster.md)")
    p.add_argument("--impl", action="append", metavar="NAME", help="only this implementation (repeatable)")
    p.add_argument("--out", default="results", metavar="DIR", help="results root (default: results)")
    p.add_argument("--no-wait", action="store_true", help="return once the shards are submitted")
    p.add_argument("--attach", metavar="RUN_DIR", help="watch (and finish) a submitted run")
    p.set_defaults(func=_cmd_submit)


def _cmd_list(args: argparse.Namespace) -> int:
    from bench.listing import list_command
    from bench.plugins import load_plugin

    for spec in args.plugin or []:
        load_plugin(spec, base_dir=Path.cwd(), file="--plugin", field=spec)
    if args.suite:
        from bench.spec.suite import load_suite

        load_suite(Path(args.suite))
    return list_command(args.what, make_console())


def _cmd_env(args: argparse.Namespace) -> int:
    import json

    from bench.measure.env import capture
    from bench.spec.case import resolve_device

    env = capture(backend=resolve_device("auto"))
    print(json.dumps(env.model_dump(mode="json", by_alias=True, exclude_none=False), indent=2))
    return EXIT_OK


def _cmd_compare(args: argparse.Namespace) -> int:
    import json

    from bench.analysis.compare import compare_specs
    from bench.analysis.report import print_comparison

    result = compare_specs(args.base, args.new, results=Path(args.results), suite=args.suite,
                           threshold_pct=args.threshold, alpha=args.alpha, deterministic_only=args.deterministic_only)
    if args.json:
        for warning in result.warnings:
            print(f"bench compare: WARNING: {warning}", file=sys.stderr)
        print(json.dumps(result.to_json(), indent=2))
    else:
        print_comparison(result, make_console(), make_console(stderr=True))
    return result.exit_code


def _cmd_ab(args: argparse.Namespace) -> int:
    import json

    from bench.analysis.ab import check_levels, run_ab
    from bench.analysis.ab_report import markdown, print_ab
    from bench.run.ab import ABOptions

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


def _cmd_history(args: argparse.Namespace) -> int:
    from bench.analysis.history import history_command

    return history_command(Path(args.results), args.suite, threshold_pct=args.threshold, as_json=args.json,
                           show_all=args.all, console=make_console())


def _cmd_export(args: argparse.Namespace) -> int:
    from bench.results.export import export_command

    return export_command(Path(args.run), args.format, Path(args.output) if args.output else None)

def _cmd_calibrate(args: argparse.Namespace) -> int:
    from bench.measure import calibrate
    from bench.spec.case import resolve_device

    dtypes = args.dtype or list(calibrate.MATMUL_DTYPES)
    return calibrate.command(resolve_device(args.device), Path(args.out), args.quick, dtypes, make_console())


def _cmd_model(args: argparse.Namespace) -> int:
    from bench.analysis.model import model_command

    return model_command(Path(args.suite), args.gpu, Path(args.out), make_console())


def _cmd_profile(args: argparse.Namespace) -> int:
    from bench.measure.profile import profile_command

    out = Path(args.output) if args.output else None
    return profile_command(Path(args.suite), args.impl, args.case, out, args.device, make_console())


def _cmd_dashboard(args: argparse.Namespace) -> int:
    from bench.dashboard import dashboard_command

    return dashboard_command(args.runs, Path(args.output), Path(args.results), make_console())


def _cmd_inputs(args: argparse.Namespace) -> int:
    from bench.measure.inputs_report import inputs_command

    return inputs_command(Path(args.suite), args.case, args.device, args.json, make_console())


def _cmd_capture(args: argparse.Namespace) -> int:
    from bench.capture import capture_command

    return capture_command(args.model, args.text, Path(args.output), args.layers, args.max_tokens, args.dtype,
                           args.name, make_console())


def _add_inputs(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inputs", help="the attention statistics of a suite's inputs (how concentrated each row is)")
    p.add_argument("suite", metavar="SUITE.yaml")
    p.add_argument("--case", type=int, metavar="N", help="only this case (index, see run --dry-run)")
    p.add_argument("--device", choices=DEVICES, help="override the cases' device")
    p.add_argument("--json", action="store_true", help="print the statistics as JSON")
    p.set_defaults(func=_cmd_inputs)


def _add_capture(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("capture", help="save a Hugging Face causal LM's q, k, v per layer on a text, as case inputs",
                       description="Runs MODEL (a local directory or a name in your Hugging Face cache; never "
                                   "downloaded) once on TEXT and saves the chosen layers' post-RoPE q, k, v to a "
                                   "safetensors file that a suite reads with inputs: {file: FILE, layer: L}. Needs "
                                   "the optional extra `capture` (transformers).")
    p.add_argument("model", metavar="MODEL")
    p.add_argument("text", metavar="TEXT", help="the text, or the path of a text file")
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="the safetensors file to write")
    p.add_argument("--layers", metavar="L,L,...", help="layers to save, negative from the end (default: all)")
    p.add_argument("--max-tokens", type=int, metavar="N", help="cut the text to its first N tokens")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="the model's and the saved tensors' dtype (default float32)")
    p.add_argument("--name", metavar="NAME", help="the model's name in the file's metadata (default: MODEL)")
    p.set_defaults(func=_cmd_capture)


def _add_run(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run a suite and store every measurement")
    p.add_argument("suite", metavar="SUITE.yaml")
    p.add_argument("--impl", action="append", metavar="NAME", help="only this implementation (repeatable)")
    p.add_argument("--device", choices=DEVICES, help="override every case's device")
    p.add_argument("--out", default="results", metavar="DIR", help="results root (default: results)")
    p.add_argument("--resume", metavar="RUN_DIR", help="measure only the pairs missing from this run")
    p.add_argument("--dry-run", action="store_true", help="print the cases and implementations, run nothing")
    p.add_argument("--shard", metavar="I/N", help="measure only part I of N of the pairs (0 <= I < N), into "
                   "records.<I>of<N>.jsonl of the run the shards share (docs/cluster.md)")
    p.add_argument("--run-id", metavar="ID", help="with --shard: the run the shards write (default: derived from "
                   "the commit, so shards of one commit join one run)")
    p.add_argument("--rank-group-shards", action="store_true", help="with --shard: shards 0..G-1 are the G world "
                   "sizes above 1, each whole (launched across nodes), the others split the single-rank pairs")
    p.set_defaults(func=_cmd_run)


def _add_list(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("list", help="implementations, patterns, selectors or hardware, with availability")
    p.add_argument("what", nargs="?", choices=["impls", "patterns", "selectors", "hardware"], default="impls")
    p.add_argument("--plugin", action="append", metavar="MODULE|FILE.py",
                   help="import this plugin first, to list what it registers (repeatable)")
    p.add_argument("--suite", metavar="SUITE.yaml", help="import the plugins this suite names first")
    p.set_defaults(func=_cmd_list)


def _add_compare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="which cases got slower or faster between two runs or commits")
    p.add_argument("base", metavar="BASE", help="run directory, or a commit id prefix found in the results store")
    p.add_argument("new", metavar="NEW", help="run directory, or a commit id prefix found in the results store")
    p.add_argument("--threshold", type=float, default=10.0, metavar="PCT",
                   help="smallest slowdown that counts, in percent (default 10)")
    p.add_argument("--alpha", type=float, default=0.05, help="false discovery rate across cases (default 0.05)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--results", default="results", metavar="DIR", help="results store for commit prefixes")
    p.add_argument("--suite", metavar="NAME", help="with a commit prefix: only runs of this suite")
    p.add_argument("--deterministic-only", action="store_true",
                   help="compare only exact figures (status, FLOPs, correctness, bytes), not times")
    p.set_defaults(func=_cmd_compare)


def _add_ab(sub: argparse._SubParsersAction) -> None:
    from bench.run.ab import BUDGET_FACTOR, DEFAULT_BLOCK_S, DEFAULT_MAX_ROUNDS_FACTOR, DEFAULT_ROUNDS, DEFAULT_THREADS

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


def _add_history(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("history", help="per (case, impl) series over commits, with detected steps")
    p.add_argument("suite", nargs="?", metavar="SUITE", help="suite name (default: every suite)")
    p.add_argument("--results", default="results", metavar="DIR", help="results store (default: results)")
    p.add_argument("--threshold", type=float, default=5.0, metavar="PCT",
                   help="smallest step reported, in percent (default 5)")
    p.add_argument("--all", action="store_true", help="list every series, not only those with steps")
    p.add_argument("--json", action="store_true", help="print the series and steps as JSON")
    p.set_defaults(func=_cmd_history)


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="a run as pytest-benchmark JSON, CSV, github-action-benchmark or Bencher JSON")
    p.add_argument("run", metavar="RUN_DIR")
    p.add_argument("--format", required=True, choices=["pytest-benchmark", "csv", "github-action-benchmark", "bencher"],
                   help="github-action-benchmark: its customSmallerIsBetter JSON; bencher: Bencher Metric Format")
    p.add_argument("-o", "--output", metavar="FILE", help="output file (default: stdout)")
    p.set_defaults(func=_cmd_export)


def _add_dashboard(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dashboard", help="Plotly HTML pages of the results (offline; open DIR/index.html)")
    p.add_argument("runs", nargs="*", metavar="RUN_DIR", help="run directories (default: every run in --results)")
    p.add_argument("-o", "--output", default="dashboards", metavar="DIR", help="output directory (default: dashboards)")
    p.add_argument("--results", default="results", metavar="DIR", help="results store (default: results)")
    p.set_defaults(func=_cmd_dashboard)


def _add_env(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("env", help="what was detected: GPUs, drivers, versions, git state")
    p.set_defaults(func=_cmd_env)


def _add_calibrate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="measure this machine's matmul rate per dtype and copy bandwidth")
    p.add_argument("--device", choices=DEVICES, default="auto")
    p.add_argument("--out", default="results", metavar="DIR",
                   help="results root; stored in DIR/calibration/<fingerprint>.json (default: results)")
    p.add_argument("--dtype", action="append", choices=["float32", "bfloat16", "float16"],
                   help="only this dtype (repeatable; default: all three, plus TF32 on CUDA)")
    p.add_argument("--quick", action="store_true", help="smaller sizes and budgets (what a run does at its start)")
    p.set_defaults(func=_cmd_calibrate)


def _add_model(sub: argparse._SubParsersAction) -> None:
    from bench.measure.hardware import GPU_CHOICES

    p = sub.add_parser("model", help="lower-bound times of a suite's cases on a GPU that is not here (a model)")
    p.add_argument("suite", metavar="SUITE.yaml")
    p.add_argument("--gpu", required=True, choices=GPU_CHOICES, help="the card to model")
    p.add_argument("--out", default="results", metavar="DIR", help="results root (default: results)")
    p.set_defaults(func=_cmd_model)


def _add_profile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="a torch.profiler trace (Chrome JSON) of one (case, impl) and its top ops")
    p.add_argument("suite", metavar="SUITE.yaml")
    p.add_argument("--impl", required=True, metavar="NAME")
    p.add_argument("--case", type=int, default=0, metavar="N", help="index of the case (see run --dry-run)")
    p.add_argument("-o", "--output", metavar="FILE", help="trace file (default: profiles/<suite>-<case>-<impl>.json)")
    p.add_argument("--device", choices=DEVICES, help="override the case's device")
    p.set_defaults(func=_cmd_profile)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bench", description="Benchmark and profile sparse attention.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_run, _add_list, _add_compare, _add_ab, _add_history, _add_export, _add_dashboard, _add_env,
                _add_calibrate, _add_model, _add_profile, _add_inputs, _add_capture, _add_submit):
        add(sub)
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
