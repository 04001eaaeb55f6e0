"""The calibration a run compares its records with: measured at its start in a child process, or stored.

With `measure: {calibrate: true}` the runner measures a quick calibration (bench.measure.machine.calibrate) in a child
(bench.run.child), so that a GPU context is not kept in the runner; otherwise it uses the one `bench calibrate`
stored for this environment's fingerprint, if any.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bench.measure.machine.calibrate import MATMUL_DTYPES, QUICK, Settings, calibrate, load
from bench.results.environment import Calibration
from bench.run import messages
from bench.run.child import Child, ChildSide, describe_exit

CALIBRATION_MODULE = "bench.run.calibration"


def measure_in_child(device: str, dtypes: list[str], timeout_s: float = 900.0) -> Calibration:
    """A quick calibration in a child process (bench.run.child); one with `error` set instead of raising."""
    child = Child(CALIBRATION_MODULE, ["--device", device, "--quick", "--dtype", ",".join(dtypes)])
    try:
        raw = child.receive(time.monotonic() + timeout_s)
        if raw is None:
            if child.poll() is None:
                return Calibration(error=f"calibration timed out after {timeout_s:g} s")
            return Calibration(error=f"calibration failed ({describe_exit(child.wait(1.0))})")
        answer = messages.Result.model_validate(raw)
        if answer.error or answer.result is None:
            return Calibration(error=f"calibration failed: {answer.error}")
        return answer.result.model_copy(update={"source": "measured at the start of this run"})
    finally:
        child.close(grace_s=5.0)


def for_run(calibrate_now: bool, backend: str, dtypes: list[str], results: Path, fingerprint: str
            ) -> Calibration | None:
    """The calibration a new run uses: measured now when the suite asks, else the stored one, else None."""
    if calibrate_now:
        return measure_in_child(backend, dtypes)
    return load(results, fingerprint)


def main(argv: list[str] | None = None) -> int:
    """The child side of `measure_in_child`: calibrate and send the result (or the error) up the pipe."""
    parser = argparse.ArgumentParser(prog=f"python -m {CALIBRATION_MODULE}")
    ChildSide.add_arguments(parser)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=",".join(MATMUL_DTYPES))
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    side = ChildSide.from_args(args)
    if not side.start():
        return 1
    try:
        result = calibrate(args.device, args.dtype.split(","), QUICK if args.quick else Settings())
    except Exception as exc:
        side.send(messages.Result(error=f"{type(exc).__name__}: {exc}"))
        return 1
    side.send(messages.Result(result=result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
