"""The hardware table: units and magnitudes, sources, name matching, and the suite chosen for a GPU."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench.cli import main
from bench.measure.machine import hardware
from bench.measure.machine.hardware import HARDWARE, GiB, match_gpu, resolve, suite_for_gpu

TERA = 1e12


@pytest.mark.parametrize("key", sorted(HARDWARE))
def test_units_and_magnitudes(key):
    s = HARDWARE[key]
    assert 1e13 <= s.fp32_flops <= 1e14  # FLOP/s, not TFLOP/s
    assert s.fp32_flops <= s.tf32_flops < s.bf16_flops <= 2e15
    assert s.fp16_flops == s.bf16_flops
    assert 5e11 <= s.memory_bandwidth <= 1e13  # bytes/s
    assert 16 * GiB <= s.memory_bytes <= 256 * GiB and s.memory_bytes % GiB == 0
    assert 32 * 2**20 <= s.l2_bytes <= 128 * 2**20
    assert 1e10 <= s.interconnect_bandwidth <= 2e12
    assert 50 <= s.bf16_flops / s.memory_bandwidth <= 1000  # ridge point, FLOP per byte
    assert s.source and s.interconnect


def test_every_entry_has_its_source_in_a_comment():
    text = Path(hardware.__file__).read_text()
    for key in HARDWARE:
        before = text[: text.index(f'_add(HardwareSpec("{key}"')].rstrip().splitlines()[-1]
        assert before.lstrip().startswith("#"), key


def test_known_datasheet_values():
    assert resolve("h100").bf16_flops == pytest.approx(989.4 * TERA)
    assert resolve("h100_pcie").tf32_flops == pytest.approx(378 * TERA)
    assert resolve("a100").memory_bandwidth == 2039e9 and resolve("a100_40gb").memory_bandwidth == 1555e9
    assert resolve("rtx4090").fp16_flops == pytest.approx(165.2 * TERA)
    assert resolve("h200").memory_bytes == 141 * GiB and resolve("h200").memory_bandwidth == 4.8e12


def test_peak_by_dtype():
    spec = resolve("a100")
    assert spec.peak_flops("bfloat16") == (312 * TERA, "bf16 tensor")
    assert spec.peak_flops("float32") == (19.5 * TERA, "fp32")
    assert spec.peak_flops("float32", tf32=True) == (156 * TERA, "tf32 tensor")
    with pytest.raises(ValueError, match="allowed: float32, float16, bfloat16"):
        spec.peak_flops("int8")
    with pytest.raises(ValueError, match="unknown GPU 'v100'; allowed: 4090, a100"):
        resolve("v100")


@pytest.mark.parametrize(("name", "memory_gib", "key"), [
    ("NVIDIA GeForce RTX 4090", 24, "rtx4090"),
    ("NVIDIA GeForce RTX 4090 D", 24, None),
    ("NVIDIA GeForce RTX 4090 Laptop GPU", 16, None),
    ("NVIDIA A100-SXM4-40GB", 40, "a100_40gb"),
    ("NVIDIA A100-PCIE-40GB", 40, "a100_40gb"),
    ("NVIDIA A100-SXM4-80GB", 80, "a100_80gb"),
    ("NVIDIA A100 80GB PCIe", 80, "a100_80gb"),
    ("NVIDIA A100", 80, "a100_80gb"),  # by memory
    ("NVIDIA H100 80GB HBM3", 80, "h100_sxm"),
    ("NVIDIA H100 PCIe", 80, "h100_pcie"),
    ("NVIDIA H100 NVL", 94, None),
    ("NVIDIA H200", 141, "h200"),
    ("NVIDIA H200 NVL", 141, None),
    ("Tesla V100-SXM2-16GB", 16, None),
])
def test_device_names_as_drivers_report_them(name, memory_gib, key):
    spec = match_gpu(name, memory_gib * GiB)
    assert (spec.key if spec else None) == key


@pytest.mark.parametrize(("name", "memory_gib", "suite"), [
    ("NVIDIA GeForce RTX 4090", 24, "rtx4090.yaml"), ("NVIDIA A100-SXM4-40GB", 40, "a100.yaml"),
    ("NVIDIA A100-SXM4-80GB", 80, "a100.yaml"), ("NVIDIA H100 80GB HBM3", 80, "h100.yaml"),
    ("NVIDIA H100 PCIe", 80, "h100.yaml"), ("NVIDIA H200", 141, "h100.yaml"),
    ("Tesla V100-SXM2-16GB", 16, "rtx4090.yaml"), ("NVIDIA L40S", 48, "a100.yaml"),
    ("NVIDIA H100 NVL", 94, "h100.yaml"), ("Some GPU", None, "rtx4090.yaml"),
])
def test_suite_for_gpu(name, memory_gib, suite):
    path = suite_for_gpu(name, memory_gib * GiB if memory_gib else None)
    assert path.name == suite and path.is_file()


def test_suite_for_gpu_command(monkeypatch, capsys):
    monkeypatch.setattr(hardware, "detect_gpu", lambda: ("NVIDIA A100-SXM4-40GB", 40 * GiB))
    assert hardware.main(["suite-for-gpu"]) == 0
    out, err = capsys.readouterr()
    assert out.strip().endswith("suites/a100.yaml") and "datasheet entry a100_40gb" in err
    assert hardware.main(["suite-for-gpu", "--name", "NVIDIA L4", "--memory-gib", "22.5"]) == 0
    out, err = capsys.readouterr()
    assert out.strip().endswith("suites/rtx4090.yaml") and "chosen by memory" in err


def test_suite_for_gpu_without_a_gpu_fails_with_a_message(monkeypatch, capsys):
    monkeypatch.setattr(hardware, "detect_gpu", lambda: None)
    assert hardware.main(["suite-for-gpu"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and "no GPU detected" in err


def test_list_hardware(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    assert main(["list", "hardware"]) == 0
    out = capsys.readouterr().out
    for key in HARDWARE:
        assert re.search(rf"\b{key}\b", out), key
    assert "bf16 TFLOP/s" in out and "989.4" in out and "NVLink 4" in out


@pytest.mark.parametrize(("suite_name", "card", "largest_fit", "smallest_skip"), [
    ("rtx4090", "rtx4090", 16384, 32768), ("a100", "a100_40gb", 16384, 32768), ("a100", "a100_80gb", 32768, 65536),
    ("h100", "h100_sxm", 32768, 65536), ("h100", "h200", 32768, 65536)])
def test_gpu_suites_reach_each_cards_dense_limit(suite_name, card, largest_fit, smallest_skip):
    from bench import registry
    from bench.measure.memory_model import does_not_fit
    from bench.spec.suite import load_suite

    suite = load_suite(hardware.SUITES_DIR / f"{suite_name}.yaml")
    memory = resolve(card).memory_bytes
    dense = registry.get("dense")
    fits, skipped = set(), set()
    for case in suite.cases:
        assert case.device == "cuda" and case.dtype in ("bfloat16", "float16")
        if case.mode == "fwd" and case.pattern == "local":
            too_big = does_not_fit(dense, case, available=(memory, "on the card"))
            (skipped if too_big else fits).add(case.seq_len)
    assert max(fits) == largest_fit and min(skipped) == smallest_skip
    assert max(c.seq_len for c in suite.cases) >= 2 * smallest_skip  # the sparse ones go on past dense


def test_an_installed_bench_finds_its_suites_outside_the_checkout(tmp_path):
    """`pip install .` (not editable) carries suites/ in the package (bench/suites): suite_for_gpu finds them
    and they load (their plugins and data beside them) with no checkout on the path."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    site = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                          "--target", str(site), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    program = ("import bench, sys\n"
               "from bench.measure.machine.hardware import suite_for_gpu\n"
               "from bench.spec.suite import load_suite\n"
               f"assert bench.__file__.startswith({str(site)!r}), bench.__file__\n"
               "path = suite_for_gpu('NVIDIA H100 80GB HBM3', 80 * 2**30)\n"
               "print(path, len(load_suite(path).cases), len(load_suite(path.parent / 'inputs.yaml').cases))\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site), "HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    path, cases, inputs_cases = proc.stdout.split()
    assert path == str(site / "bench" / "suites" / "h100.yaml") and int(cases) > 0 and int(inputs_cases) > 0
