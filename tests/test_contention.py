"""Contention: each measured record says whether the machine was busy while it was timed, and nothing calls a
time change from a busy side.

The machine the tests run on is shared, so "a run alone marks nothing busy" cannot be asserted end to end: the
quiet side is tested through injected readings (the meter and the verdict rule), the busy side end to end beside
busy processes this test starts."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from rich.console import Console

from bench.analysis import ab_stats as st
from bench.analysis import stats as cs
from bench.measure.machine import contention as ct
from bench.results.records import DeviceState, Record
from bench.run.console import busy_line, summary_table
from tests.conftest import only_run_dir, read_jsonl, run_bench, write_suite
from tests.synthetic import commit_id, noisy, record, write_run


def fixed_readings(wall: list[float], cpu: list[float], pressure: list[int | None], load: float | None
                   ) -> ct.Readings:
    """Readings that return the given values in turn (start, stop, start, stop, ...)."""
    walls, cpus, pressures = iter(wall), iter(cpu), iter(pressure)
    return ct.Readings(pressure_us=lambda: next(pressures), load=lambda: load, wall=lambda: next(walls),
                       cpu=lambda: next(cpus))


def test_a_quiet_interval_is_quiet_and_pressure_over_the_threshold_is_busy():
    # 2 s timed: 40 ms of PSI stall (2%), 1.9 CPU s: quiet
    meter = ct.ContentionMeter(fixed_readings([10.0, 12.0], [5.0, 6.9], [1_000_000, 1_040_000], 1.0))
    meter.start()
    meter.stop()
    quiet = meter.result("cpu")
    assert quiet is not None
    assert quiet.verdict == "quiet" and quiet.cpu_pressure == pytest.approx(0.02)
    assert quiet.cpu_over_wall == pytest.approx(0.95) and quiet.reason is None
    # the same with 0.8 s of stall: 40% of the interval
    meter = ct.ContentionMeter(fixed_readings([10.0, 12.0], [5.0, 6.9], [1_000_000, 1_800_000], 1.0))
    meter.start()
    meter.stop()
    busy = meter.result("cpu")
    assert busy is not None and busy.verdict == "busy" and "CPU pressure 40%" in busy.reason


def test_the_meter_sums_blocks_and_loses_psi_if_any_block_lacks_it():
    meter = ct.ContentionMeter(fixed_readings([0.0, 1.0, 5.0, 6.0], [0.0, 1.0, 1.0, 2.0],
                                              [0, 100_000, 500_000, 700_000], 0.5))
    for _ in range(2):
        meter.start()
        meter.stop()
    result = meter.result("cpu")
    assert result is not None and result.cpu_pressure == pytest.approx(0.15)  # 0.3 s of 2 s, not of 6 s
    meter = ct.ContentionMeter(fixed_readings([0.0, 1.0, 5.0, 6.0], [0.0, 1.0, 1.0, 2.0], [0, 1, None, 2], 0.5))
    for _ in range(2):
        meter.start()
        meter.stop()
    result = meter.result("cpu")
    assert result is not None and result.cpu_pressure is None and result.verdict == "quiet"
    assert ct.ContentionMeter().result("cpu") is None  # nothing timed: no contention to report


@pytest.mark.parametrize(("pressure", "load", "over_wall", "throttle", "expected"), [
    (0.05, 9.0, 1.0, None, "quiet"),  # with PSI the lagging load does not decide
    (0.20, 0.1, 1.0, None, "busy"),
    (None, 1.0, 1.0, None, "quiet"),  # no PSI: the load decides
    (None, ct.LOAD_BUSY, 1.0, None, "busy"),
    (0.0, 0.5, 0.3, None, "busy"),  # the timing loop got under half a core
    (None, None, None, ["hw_thermal_slowdown"], "busy"),
    (None, None, None, [], "quiet"),
    (None, None, None, ["sw_power_cap"], "quiet"),  # the GPU's own power limit under this load
    (None, None, None, ["power violation counters grew"], "quiet"),
    (None, None, None, ["sw_power_cap", "sw_thermal_slowdown"], "busy"),
    (None, None, None, ["thermal violation counters grew"], "busy"),
])
def test_the_verdict_rule(pressure, load, over_wall, throttle, expected):
    assert ct.verdict(pressure, load, over_wall, throttle)[0] == expected


def test_cpu_over_wall_does_not_decide_on_cuda_and_a_throttled_gpu_is_busy():
    meter = ct.ContentionMeter(fixed_readings([0.0, 1.0], [0.0, 0.1], [0, 0], 0.1))
    meter.start()
    meter.stop()
    state = DeviceState(throttled=True, throttle_reasons=["sw_thermal_slowdown"])
    result = meter.result("cuda", state)
    assert result is not None and result.gpu_throttle == ["sw_thermal_slowdown"] and result.verdict == "busy"
    result = meter.result("cuda", DeviceState(throttled=False))
    assert result is not None and result.verdict == "quiet" and result.cpu_over_wall == pytest.approx(0.1)


def test_psi_is_read_from_the_some_line(tmp_path):
    path = tmp_path / "cpu"
    path.write_text("some avg10=1.00 avg60=2.00 avg300=3.00 total=123456\nfull avg10=0.00 avg60=0.00 avg300=0.00 "
                    "total=0\n")
    assert ct.psi_some_us(path) == 123456
    assert ct.psi_some_us(tmp_path / "absent") is None


def busy_record(case_id: str, samples: np.ndarray, verdict: str = "busy") -> Record:
    reason = "CPU pressure 70% (>= 20%)" if verdict == "busy" else None
    return record(case_id, "dense", samples, contention={"cpu_pressure": 0.7 if reason else 0.01, "load": 1.0,
                                                         "cpu_over_wall": 1.0, "verdict": verdict,
                                                         "reason": reason})


def test_compare_calls_a_change_from_a_busy_side_noisy(tmp_path, capsys):
    from bench.cli import main

    rng = np.random.default_rng(3)
    base_samples = noisy(rng, 1e-3, n=20)
    base = write_run(tmp_path, commit=commit_id(1), records=[busy_record("c", base_samples, "quiet"),
                                                             busy_record("d", base_samples, "quiet")])
    new = write_run(tmp_path, commit=commit_id(2), started_at="2026-01-02T00:00:00.000000Z",
                    records=[busy_record("c", base_samples * 1.5, "busy"),
                             busy_record("d", base_samples * 1.5, "quiet")])
    assert main(["compare", str(base), str(new), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    verdicts = {p["case_id"]: p for p in doc["pairs"]}
    assert verdicts["c"]["verdict"] == "NOISY" and "NEW timed on a busy machine" in " ".join(verdicts["c"]["notes"])
    assert verdicts["d"]["verdict"] == "SLOWER"  # both sides quiet: the change is called


def test_the_busy_rule_of_bench_ab_is_the_same_rule():
    busy = cs.busy_side([("BASE", [None]), ("NEW", [busy_record("c", np.ones(3) * 1e-3)])])
    assert busy is not None and busy.startswith("NEW timed on a busy machine")
    assert cs.refuse_busy(st.SLOWER, busy) == cs.NOISY == st.NOISY
    assert cs.refuse_busy(st.SAME, busy) == st.SAME  # no change called: nothing to refuse
    assert cs.refuse_busy(st.FASTER, None) == st.FASTER


def test_busy_records_are_marked_in_the_table_and_counted():
    samples = np.full(5, 1e-3)
    records = [busy_record("c", samples, "busy"), busy_record("d", samples, "quiet")]
    console = Console(width=120, record=True)
    console.print(summary_table(records, {"c": "case-c", "d": "case-d"}, ["dense"]))
    text = " ".join(console.export_text().split())  # the caption wraps to the table's width
    assert "case-c │ 1 ms! │" in text and "case-d │ 1 ms │" in text and "timed while the machine was busy" in text
    assert busy_line(records) == ("1 of 2 measured pairs were timed on a busy machine (marked !); their times are "
                                  "not to be trusted")
    assert busy_line([records[1]]) is None


SPIN = "while True: pass"


@pytest.mark.parametrize("busy", [2])  # as many spinners as CI's cores: more adds time, not another verdict
def test_a_run_beside_busy_processes_marks_its_pairs_busy(tmp_path, busy):
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(busy)]
    try:
        suite = write_suite(tmp_path, {
            "name": "contention", "impls": ["dense", "cp_ring"],  # one pair in the worker, one over 2 ranks
            "defaults": {"heads": 2, "head_dim": 32, "seq_len": 256, "device": "cpu"},
            "sweep": {"world_size": [1, 2]},
            "measure": {"warmup": 1, "repeat": 5, "max_time_s": 0.05, "memory": "worker", "check": False,
                        "wait_for_quiet_s": 0.5}})
        proc = run_bench("run", str(suite), "--out", str(tmp_path / "results"), env={"COLUMNS": "200"})
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = only_run_dir(tmp_path / "results")
    measured = [r for r in read_jsonl(run_dir / "records.jsonl") if r["status"] == "ok"]
    assert {("dense", 1), ("cp_ring", 2)} <= {(r["impl"], r["params"]["world_size"]) for r in measured}
    for r in measured:
        assert r["contention"]["verdict"] == "busy", r["contention"]
    assert next(r for r in measured if r["impl"] == "dense")["contention"]["waited_s"] is not None
    assert f"{len(measured)} of {len(measured)} measured pairs were timed on a busy machine" in proc.stdout
    info = json.loads((run_dir / "run.json").read_text())
    assert set(info["env"]["load"]) == {"start", "end"}


def test_the_dashboards_mark_busy_records(tmp_path):
    from bench.dashboard.data import rows_from_runs
    from bench.dashboard.figures import provenance, row_hover
    from bench.results.store import load_run

    samples = np.full(5, 1e-3)
    run = load_run(write_run(tmp_path, commit=commit_id(1), records=[busy_record("c", samples, "busy"),
                                                                     busy_record("d", samples, "quiet")]))
    busy, quiet = rows_from_runs([run])
    assert busy.busy == "CPU pressure 70% (>= 20%)" and quiet.busy is None
    assert "BUSY: timed on a busy machine" in row_hover(busy) and "BUSY" not in row_hover(quiet)
    assert "1 records timed on a busy machine" in provenance([busy, quiet]).text()


class Clock:
    """A wall clock that `sleep` advances, with PSI stall growing at `rates[i]` (share) in window i."""

    def __init__(self, rates: list[float | None]) -> None:
        self.t, self.stall, self.rates, self.window = 0.0, 0.0, rates, 0

    def sleep(self, s: float) -> None:
        rate = self.rates[min(self.window, len(self.rates) - 1)]
        self.stall += (rate or 0.0) * s * 1e6
        self.t += s
        self.window += 1

    def readings(self) -> ct.Readings:
        rates = self.rates
        return ct.Readings(pressure_us=lambda: None if rates[0] is None else int(self.stall),
                           load=lambda: 0.5, wall=lambda: self.t, cpu=lambda: 0.0)


def test_waiting_for_quiet_stops_at_the_first_quiet_window_or_the_limit():
    clock = Clock([0.9, 0.8, 0.05])
    assert ct.wait_for_quiet(10.0, clock.readings(), window_s=0.5, sleep=clock.sleep) == pytest.approx(1.5)
    clock = Clock([0.9])
    assert ct.wait_for_quiet(2.0, clock.readings(), window_s=0.5, sleep=clock.sleep) == pytest.approx(2.0)
    clock = Clock([None])  # no PSI: nothing tells that it is quiet now; one window, then on
    assert ct.wait_for_quiet(5.0, clock.readings(), window_s=0.5, sleep=clock.sleep) == pytest.approx(0.5)


def test_the_suite_takes_wait_for_quiet_s_and_refuses_a_negative_one(tmp_path):
    from bench.errors import BadInput
    from bench.spec.suite import load_suite

    base = {"name": "w", "impls": ["dense"], "sweep": {"seq_len": [64]}}
    assert load_suite(write_suite(tmp_path, {**base, "measure": {"wait_for_quiet_s": 5.0}})).measure.wait_for_quiet_s \
        == 5.0
    with pytest.raises(BadInput, match="wait_for_quiet_s"):
        load_suite(write_suite(tmp_path, {**base, "measure": {"wait_for_quiet_s": -1.0}}, name="bad.yaml"))


def test_a_gpu_that_throttles_while_timed_makes_a_busy_record_through_nvml():
    """The CUDA side, through the fake NVML: a thermal slowdown seen around the timing, or thermal violation time
    that grew in between, is a busy verdict with the reasons; the GPU holding its power limit (power-cap time that
    grew) is recorded but quiet; an idle-then-busy GPU that never throttled is quiet."""
    from tests.fake_nvml import FakeGpu
    from tests.test_env import monitor_of

    def verdict_after(change) -> ct.ContentionInfo:
        gpu = FakeGpu(reasons=0x0)
        monitor, meter = monitor_of(gpu), ct.ContentionMeter(fixed_readings([0.0, 1.0], [0.0, 1.0], [0, 0], 0.1))
        monitor.start()
        meter.start()
        change(gpu)
        meter.stop()
        result = meter.result("cuda", monitor.stop())
        assert result is not None
        return result

    hot = verdict_after(lambda g: setattr(g, "reasons", 0x20))
    assert hot.verdict == "busy" and hot.gpu_throttle == ["sw_thermal_slowdown"]
    capped = verdict_after(lambda g: g.violation_ns.__setitem__(0, 250_000_000))
    assert capped.verdict == "quiet" and capped.gpu_throttle == ["power violation counters grew"]
    heated = verdict_after(lambda g: g.violation_ns.__setitem__(1, 250_000_000))
    assert heated.verdict == "busy" and heated.gpu_throttle == ["thermal violation counters grew"]
    calm = verdict_after(lambda g: setattr(g, "reasons", 0x1))
    assert calm.verdict == "quiet" and calm.gpu_throttle == []


def test_a_later_trial_timed_busy_makes_the_ab_change_noisy():
    """bench ab's later trials write no record, but their contention counts: a change with a busy later trial
    is NOISY, the same change with every trial quiet is SLOWER."""
    from bench.analysis.ab import compare_ab
    from bench.run.ab.command import ABMeasurement, PairMeasurement
    from tests.test_ab_stats import rounds_for, side

    rng = np.random.default_rng(8)
    quiet = busy_record("c", np.full(3, 1e-3), "quiet")
    busy = busy_record("c", np.full(3, 1e-3), "busy")
    verdicts = []
    for later in (quiet, busy):
        pm = PairMeasurement("c", "dense", "c", "interleaved", quiet, quiet, rounds_for(rng, 1.3),
                             more_trials=[rounds_for(rng, 1.3)], more_records=[(quiet, later)])
        result = compare_ab(ABMeasurement(side("BASE"), side("NEW"), [pm], [], [], 15, 0.02, 5, 1.0, looks=[15, 30]))
        verdicts.append((result.pairs[0].verdict, result.pairs[0].busy))
    assert verdicts[0] == (st.SLOWER, None)
    assert verdicts[1][0] == st.NOISY and verdicts[1][1].startswith("NEW timed on a busy machine")
