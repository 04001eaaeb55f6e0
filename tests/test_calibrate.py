"""`bench calibrate`: FLOP and byte counts of the calibration, its storage, and the peak records compare with."""

from __future__ import annotations

import json

import pytest

from bench.cli import main
from bench.errors import BadInput
from bench.measure.machine import calibrate
from bench.measure.machine.calibrate import Settings, copy_bandwidth, load, matmul_rate, peak_for, store
from bench.measure.machine.calibrate import calibrate as run_calibration
from bench.measure.machine.env import capture
from bench.measure.machine.hardware import GiB
from bench.measure.timing import TimingPolicy
from bench.results.environment import Calibration
from tests.conftest import only_run_dir, read_jsonl, run_bench, write_suite


class FixedTimer:
    """Every call 'takes' 1 ms; the calls really run."""

    def __init__(self) -> None:
        self.now = 0.0
        self.calls = 0

    def time_call(self, fn) -> float:
        fn()
        self.calls += 1
        self.now += 1e-3
        return 1e-3

    def clock(self) -> float:
        return self.now


SMALL = Settings(TimingPolicy(warmup=1, repeat=3, max_time_s=1.0), target_call_s=1.0, min_n={"cpu": 64},
                 max_n={"cpu": 128}, copy_bytes={"cpu": 2**20}, past_llc=0)


def test_matmul_rate_counts_2_n_cubed_flops():
    result = matmul_rate("cpu", "float32", SMALL, FixedTimer())
    assert result.n == 128  # 1 ms per call is under the 1 s target: grown to max_n
    assert result.flops_per_s == pytest.approx(2 * 128**3 / 1e-3)
    settings = Settings(SMALL.policy, target_call_s=1e-4, min_n={"cpu": 64}, max_n={"cpu": 128})
    assert matmul_rate("cpu", "bfloat16", settings, FixedTimer()).n == 64  # long enough at once


def test_copy_bandwidth_counts_the_read_and_the_write():
    result = copy_bandwidth("cpu", SMALL, FixedTimer())
    assert result.bytes == 2**20 and result.bytes_per_s == pytest.approx(2 * 2**20 / 1e-3)


def test_calibrate_measures_each_dtype_and_no_tf32_on_cpu():
    result = run_calibration("cpu", ["float32", "bfloat16"], SMALL, FixedTimer())
    assert set(result.matmul) == {"float32", "bfloat16"}
    assert result.backend == "cpu" and str(result.device).startswith("cpu: ")
    assert result.torch_threads >= 1 and result.copy_.bytes_per_s > 0
    json.dumps(result.model_dump(mode="json"), allow_nan=False)


def test_stored_calibrations_are_found_by_fingerprint_and_damage_is_named(tmp_path):
    data = {"device": "cpu: X", "matmul": {"float32": {"flops_per_s": 5e10, "n": 1024}}}
    path = store(tmp_path, "abc123", Calibration.model_validate(data))
    assert path == tmp_path / "calibration" / "abc123.json"
    loaded = load(tmp_path, "abc123")
    assert loaded is not None and loaded.rate("float32") == 5e10 and loaded.source == str(path)
    assert load(tmp_path, "other") is None
    path.write_text("{not json")
    with pytest.raises(BadInput, match=r"abc123\.json: not a calibration file"):
        load(tmp_path, "abc123")
    path.write_text(json.dumps({**data, "fingerprint": "zzz"}))
    with pytest.raises(BadInput, match="fingerprint or rates do not match"):
        load(tmp_path, "abc123")


CALIBRATED = Calibration(device="cuda:0 NVIDIA H100 80GB HBM3",
                         matmul={"float32": {"flops_per_s": 5e13}, "tf32": {"flops_per_s": 4e14},
                                 "bfloat16": {"flops_per_s": 8e14}})
H100 = ("NVIDIA H100 80GB HBM3", 80 * GiB)


def test_peak_is_calibrated_when_the_machine_was():
    peak = peak_for(2e14, "bfloat16", "cuda", False, CALIBRATED, H100)
    assert peak.model_dump(exclude_none=True) == {
        "fraction": 0.25, "peak_flops": 8e14, "source": "calibrated",
        "hardware": "cuda:0 NVIDIA H100 80GB HBM3 bfloat16 matmul",
        # no read bandwidth calibrated: the memory roof is the datasheet's, and says so
        "bandwidth": 3.35e12, "bandwidth_source": "h100_sxm datasheet memory bandwidth", "above_roof": False}
    assert peak_for(1e14, "float32", "cuda", True, CALIBRATED, H100).peak_flops == 4e14  # TF32 impl
    assert peak_for(1e13, "float32", "cuda", False, CALIBRATED, H100).peak_flops == 5e13


def test_peak_falls_back_to_the_datasheet_and_says_so():
    peak = peak_for(494.7e12, "float16", "cuda", False, CALIBRATED, H100)  # float16 was not calibrated
    assert peak.source == "datasheet" and peak.hardware == "h100_sxm fp16 tensor"
    assert peak.fraction == pytest.approx(0.5)
    assert peak_for(1e12, "float32", "cuda", True, None, H100).hardware == "h100_sxm tf32 tensor"
    assert peak_for(1e12, "float32", "cuda", False, None, ("Tesla V100-SXM2-16GB", 16 * GiB)) is None
    assert peak_for(1e9, "float32", "cpu", False, None, None) is None  # no datasheet for CPUs
    assert "fraction" not in peak_for(None, "float32", "cpu", False, CALIBRATED, None)  # a roof, no rate


def test_bench_calibrate_stores_under_the_fingerprint(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(calibrate, "QUICK", Settings(TimingPolicy(warmup=1, repeat=3, max_time_s=0.05), 0.0,
                                                     {"cpu": 128}, {"cpu": 128}, {"cpu": 4 * 2**20}))
    code = main(["calibrate", "--device", "cpu", "--quick", "--dtype", "float32", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    fingerprint = capture("cpu").fingerprint
    stored = load(tmp_path, fingerprint)
    assert stored is not None and stored.matmul["float32"].n == 128 and stored.matmul["float32"].flops_per_s > 0
    # the read bandwidth decode is held to, with every thread and with one, beside the copy figure
    assert stored.read is not None
    assert stored.read["all_threads"].bytes_per_s > 0 and stored.read["one_thread"].threads == 1
    assert "read, 1 thread(s)" in out
    assert "float32 matmul" in out and "GFLOP/s" in out and f"calibration/{fingerprint}.json" in out


def test_records_use_the_stored_calibration_of_this_machine(tmp_path):
    results = tmp_path / "results"
    fingerprint = capture("cpu").fingerprint  # what the runner will compute in its own process
    rate = 3.2e10
    store(results, fingerprint, Calibration(device="cpu: test", matmul={"float32": {"flops_per_s": rate}}))
    suite = write_suite(tmp_path, {"name": "peaks", "impls": ["dense"], "defaults": {"heads": 1, "head_dim": 8,
                                   "device": "cpu"}, "sweep": {"seq_len": [64]},
                                   "measure": {"warmup": 0, "repeat": 3, "max_time_s": 0.01}})
    proc = run_bench("run", str(suite), "--out", str(results))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (run_dir,) = [p for p in results.iterdir() if (p / "run.json").is_file()]  # calibration/ is beside it
    info = json.loads((run_dir / "run.json").read_text())
    assert info["env"]["calibration"]["source"] == str(results / "calibration" / f"{fingerprint}.json")
    (record,) = read_jsonl(run_dir / "records.jsonl")
    assert record["peak"]["source"] == "calibrated" and record["peak"]["peak_flops"] == rate
    assert record["peak"]["fraction"] == pytest.approx(record["flops_per_s"] / rate)


def test_a_suite_can_calibrate_at_the_start_of_its_run(tmp_path):
    suite = write_suite(tmp_path, {"name": "selfcal", "impls": ["dense"],
                                   "defaults": {"heads": 1, "head_dim": 8, "device": "cpu"},
                                   "sweep": {"seq_len": [64]},
                                   "measure": {"warmup": 0, "repeat": 3, "max_time_s": 0.01, "calibrate": True}})
    proc = run_bench("run", str(suite), "--out", str(tmp_path / "results"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "calibrating cpu" in proc.stdout
    run_dir = only_run_dir(tmp_path / "results")
    calibration = json.loads((run_dir / "run.json").read_text())["env"]["calibration"]
    assert calibration["source"] == "measured at the start of this run"
    assert set(calibration["matmul"]) == {"float32"}  # the suite's dtypes only
    rate = calibration["matmul"]["float32"]["flops_per_s"]
    assert rate > 0 and calibration["copy"]["bytes_per_s"] > 0
    (record,) = read_jsonl(run_dir / "records.jsonl")
    assert record["peak"]["source"] == "calibrated"
    assert record["peak"]["fraction"] == pytest.approx(record["flops_per_s"] / rate)
    assert not (tmp_path / "results" / "calibration").exists()  # a run's calibration lives in its run.json
