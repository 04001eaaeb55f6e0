"""What is here and what a case sees: `bench list`, `bench env`, `bench calibrate`, `bench model`, `bench inputs`,
`bench capture`."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.cli.common import DEVICES, EXIT_OK, make_console


def _cmd_list(args: argparse.Namespace) -> int:
    from bench.cli.listing import list_command
    from bench.spec.plugins import load_plugin

    for spec in args.plugin or []:
        load_plugin(spec, base_dir=Path.cwd(), file="--plugin", field=spec)
    if args.suite:
        from bench.spec.suite import load_suite

        load_suite(Path(args.suite))
    return list_command(args.what, make_console())


def add_list(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("list", help="implementations, patterns, selectors or hardware, with availability")
    p.add_argument("what", nargs="?", choices=["impls", "patterns", "selectors", "models", "tasks", "hardware"],
                   default="impls", help="what to list (default: impls)")
    p.add_argument("--plugin", action="append", metavar="MODULE|FILE.py",
                   help="import this plugin first, to list what it registers (repeatable)")
    p.add_argument("--suite", metavar="SUITE.yaml", help="import the plugins this suite names first")
    p.set_defaults(func=_cmd_list)


def _cmd_env(args: argparse.Namespace) -> int:
    import json

    from bench.measure.machine.env import capture
    from bench.spec.case import resolve_device

    env = capture(backend=resolve_device("auto"))
    print(json.dumps(env.model_dump(mode="json", by_alias=True, exclude_none=False), indent=2))
    return EXIT_OK


def add_env(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("env", help="what was detected: GPUs, drivers, versions, git state")
    p.set_defaults(func=_cmd_env)


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from bench.measure.machine import calibrate
    from bench.spec.case import resolve_device

    dtypes = args.dtype or list(calibrate.MATMUL_DTYPES)
    return calibrate.command(resolve_device(args.device), Path(args.out), args.quick, dtypes, make_console())


def add_calibrate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="measure this machine's matmul rate per dtype and copy bandwidth")
    p.add_argument("--device", choices=DEVICES, default="auto", help="the device to calibrate (default auto: the "
                   "GPU when one is visible, else the CPU)")
    p.add_argument("--out", default="results", metavar="DIR",
                   help="results root; stored in DIR/calibration/<fingerprint>.json (default: results)")
    p.add_argument("--dtype", action="append", choices=["float32", "bfloat16", "float16"],
                   help="only this dtype (repeatable; default: all three, plus TF32 on CUDA)")
    p.add_argument("--quick", action="store_true", help="smaller sizes and budgets (what a run does at its start)")
    p.set_defaults(func=_cmd_calibrate)


def _cmd_model(args: argparse.Namespace) -> int:
    from bench.analysis.model import model_command

    return model_command(Path(args.suite), args.gpu, Path(args.out), make_console())


def add_model(sub: argparse._SubParsersAction) -> None:
    from bench.measure.machine.hardware import GPU_CHOICES

    p = sub.add_parser("model", help="lower-bound times of a suite's cases on a GPU that is not here (a model)")
    p.add_argument("suite", metavar="SUITE.yaml", help="the suite whose cases to model")
    p.add_argument("--gpu", required=True, choices=GPU_CHOICES, help="the card to model")
    p.add_argument("--out", default="results", metavar="DIR", help="results root (default: results)")
    p.set_defaults(func=_cmd_model)


def _cmd_inputs(args: argparse.Namespace) -> int:
    from bench.measure.inputs_report import inputs_command

    return inputs_command(Path(args.suite), args.case, args.device, args.json, make_console())


def add_inputs(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inputs", help="the attention statistics of a suite's inputs (how concentrated each row is)")
    p.add_argument("suite", metavar="SUITE.yaml", help="the suite whose inputs to describe")
    p.add_argument("--case", type=int, metavar="N", help="only this case (index, see run --dry-run)")
    p.add_argument("--device", choices=DEVICES, help="override the cases' device")
    p.add_argument("--json", action="store_true", help="print the statistics as JSON")
    p.set_defaults(func=_cmd_inputs)


def _cmd_capture(args: argparse.Namespace) -> int:
    from bench.inputs.capture import capture_command

    return capture_command(args.model, args.text, Path(args.output), args.layers, args.max_tokens, args.dtype,
                           args.name, make_console())


def add_capture(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("capture", help="save a Hugging Face causal LM's q, k, v per layer on a text, as case inputs",
                       description="Runs MODEL (a local directory or a name in your Hugging Face cache; never "
                                   "downloaded) once on TEXT and saves the chosen layers' post-RoPE q, k, v to a "
                                   "safetensors file that a suite reads with inputs: {file: FILE, layer: L}. Needs "
                                   "the optional extra `capture` (transformers).")
    p.add_argument("model", metavar="MODEL", help="a local Hugging Face model directory, or a name in your cache")
    p.add_argument("text", metavar="TEXT", help="the text, or the path of a text file")
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="the safetensors file to write")
    p.add_argument("--layers", metavar="L,L,...", help="layers to save, negative from the end (default: all)")
    p.add_argument("--max-tokens", type=int, metavar="N", help="cut the text to its first N tokens")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="the model's and the saved tensors' dtype (default float32)")
    p.add_argument("--name", metavar="NAME", help="the model's name in the file's metadata (default: MODEL)")
    p.set_defaults(func=_cmd_capture)


COMMANDS = (add_list, add_env, add_calibrate, add_model, add_inputs, add_capture,)
