"""Measuring: `bench run`, `bench submit`, `bench profile`."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

from bench.cli.common import DEVICES, make_console
from bench.errors import BadInput

if TYPE_CHECKING:
    from bench.run.cluster.shards import ShardSpec
    from bench.run.runner import RunOptions
    from bench.spec.suite import Suite


def _cmd_run(args: argparse.Namespace) -> int:
    from bench.run.cluster.shards import parse_shard
    from bench.run.runner import run

    shard = parse_shard(args.shard) if args.shard is not None else None
    if args.run_id is not None and args.resume is not None:
        raise BadInput(f"got {args.run_id!r} with --resume; --resume RUN_DIR names the run already",
                       field="--run-id")
    suite: Path | Suite = Path(args.suite)
    if not args.solutions:
        return run(_run_options(args, suite, shard), make_console())
    # FlashInfer-Bench solutions as implementations (docs/flashinfer.md), named to the workers through the
    # environment for this run only: a caller in this process (a test, a notebook) keeps its own
    from bench.interop.flashinfer.cli import with_solutions
    from bench.interop.flashinfer.plugin import SOLUTIONS_ENV

    saved = os.environ.get(SOLUTIONS_ENV)
    try:
        suite = with_solutions(Path(args.suite), args.solutions)
        return run(_run_options(args, suite, shard), make_console())
    finally:
        if saved is None:
            os.environ.pop(SOLUTIONS_ENV, None)
        else:
            os.environ[SOLUTIONS_ENV] = saved


def _run_options(args: argparse.Namespace, suite: Path | Suite, shard: ShardSpec | None) -> RunOptions:
    from bench.run.runner import RunOptions

    return RunOptions(suite=suite, impls=args.impl or [], add_impls=args.add_impl or [], device=args.device,
                      out=Path(args.out),
                      resume=Path(args.resume) if args.resume else None, dry_run=args.dry_run, shard=shard,
                      run_id=args.run_id, rank_group_shards=args.rank_group_shards)


def add_run(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run a suite and store every measurement")
    p.add_argument("suite", metavar="SUITE.yaml", help="the suite file (suites/*.yaml; its schema: docs/DESIGN.md)")
    p.add_argument("--impl", action="append", metavar="NAME", help="only this one of the suite's implementations "
                   "(repeatable; a name outside the suite is refused: see --add-impl)")
    p.add_argument("--add-impl", action="append", metavar="NAME", help="also measure this implementation, which the "
                   "suite does not list (repeatable)")
    p.add_argument("--device", choices=DEVICES, help="override every case's device")
    p.add_argument("--out", default="results", metavar="DIR", help="results root (default: results; made if "
                   "missing, in an existing directory)")
    p.add_argument("--resume", metavar="RUN_DIR", help="measure only the pairs missing from this run")
    p.add_argument("--dry-run", action="store_true", help="check every option as a real run would, then list the "
                   "pairs it would measure (with --resume, the missing ones) and the skips it can predict; run "
                   "nothing")
    p.add_argument("--shard", metavar="I/N", help="measure only part I of N of the pairs (0 <= I < N), into "
                   "records.<I>of<N>.jsonl of the run the shards share (docs/cluster.md)")
    p.add_argument("--run-id", metavar="ID", help="the run's name: 1-100 letters, digits, '.', '_', '-' (default: "
                   "<UTC time>-<commit>-<suite>; with --shard derived from the commit, so shards of one commit join "
                   "one run; its time and commit are in run.json, whatever the name)")
    p.add_argument("--solutions", action="append", metavar="ROOT", help="register the python and triton Solutions of "
                   "this FlashInfer Trace dataset as implementations and run them too (repeatable)")
    p.add_argument("--rank-group-shards", action="store_true", help="with --shard: shards 0..G-1 are the G world "
                   "sizes above 1, each whole (launched across nodes), the others split the single-rank pairs")
    p.set_defaults(func=_cmd_run)


def _cmd_submit(args: argparse.Namespace) -> int:
    from bench.run.cluster.submit import SubmitOptions, submit

    if (args.suite is None) == (args.attach is None):
        raise BadInput("give SUITE.yaml to submit a run, or --attach RUN_DIR to watch one (not both)", field="SUITE")
    options = SubmitOptions(suite=Path(args.suite) if args.suite else None, executor=args.executor,
                            shards=args.shards, partition=args.partition, gpus_per_shard=args.gpus_per_shard,
                            time_limit=args.time, nodes_per_rank_group=args.nodes_per_rank_group, out=Path(args.out),
                            no_wait=args.no_wait, attach=Path(args.attach) if args.attach else None,
                            impls=args.impl or [])
    return submit(options, make_console())


def add_submit(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("submit", help="run a suite as N shards on Slurm or as local processes, and watch them",
                       description="Every shard is `bench run SUITE --shard I/N` writing its part of one run; a "
                                   "shard that dies is submitted again for its missing pairs (docs/cluster.md).")
    p.add_argument("suite", nargs="?", metavar="SUITE.yaml", help="the suite to run in shards (or --attach RUN_DIR)")
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


def _cmd_profile(args: argparse.Namespace) -> int:
    from bench.measure.profile import profile_command

    out = Path(args.output) if args.output else None
    return profile_command(Path(args.suite), args.impl, args.case, out, args.device, make_console())


def add_profile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="a torch.profiler trace (Chrome JSON) of one (case, impl) and its top ops")
    p.add_argument("suite", metavar="SUITE.yaml", help="the suite holding the case")
    p.add_argument("--impl", required=True, metavar="NAME", help="the implementation to profile")
    p.add_argument("--case", type=int, default=0, metavar="N", help="index of the case (see run --dry-run)")
    p.add_argument("-o", "--output", metavar="FILE", help="trace file (default: profiles/<suite>-<case>-<impl>.json)")
    p.add_argument("--device", choices=DEVICES, help="override the case's device")
    p.set_defaults(func=_cmd_profile)


COMMANDS = (add_run, add_submit, add_profile,)
