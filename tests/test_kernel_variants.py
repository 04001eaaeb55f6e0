"""blocked's C++ kernels on every x86-64 level torch dispatches to (DEFAULT, AVX2, AVX512): each variant compiles on
any x86-64 machine (compiling needs no such CPU), and each variant this machine can run is built as a run would
build it and checked against the float64 oracle in a process whose torch, oneDNN and MKL are held to that level
(ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS), the way a CPU of that level runs them."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from impls.blocked import kernel

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [ROOT / "impls" / "blocked" / "kernel.cpp", ROOT / "impls" / "blocked" / "decode.cpp"]
# How each variant's libraries are held to its level (oneDNN's and MKL's own names for it)
LIBRARY_LEVEL = {"DEFAULT": ("SSE41", "SSE4_2"), "AVX2": ("AVX2", "AVX2"), "AVX512": ("AVX512_CORE", "AVX512")}
# The engines each level runs: (prefill products in float32, in bfloat16, decode engine)
ENGINES = {"DEFAULT": ("onednn_brgemm", "onednn_brgemm_widened", "portable"),
           "AVX2": ("onednn_brgemm", "onednn_brgemm_widened", "avx2_fma")}

CHECK = r"""
import json, torch
from bench.measure.oracle.reference import compare, reference_attention, tolerance_for
from bench.patterns import make_pattern
from impls.blocked import kernel, decode

out = {"capability": torch.backends.cpu.get_cpu_capability(), "kernel": kernel.unavailable_reason(
    torch.zeros(1, 1, 16, 64), 64), "decode": decode.decode_unavailable(torch.zeros(1, 1, 1, 64), "fwd")}
gen = torch.Generator().manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    name = str(dtype).split(".")[1]
    for pattern, rows in ((make_pattern("block_random", 320, density=0.3, seed=1, block_size=64), 320),
                          (make_pattern("causal", 320, q_len=2), 2)):
        q = torch.randn(1, 4, rows, 64, generator=gen).to(dtype)
        k, v = (torch.randn(1, 2, 320, 64, generator=gen).to(dtype) for _ in range(2))
        if rows > 16:
            table = kernel.block_table(pattern, 64)
            got = kernel.kernel_attention(table, q[0].reshape(2, 2, rows, 64), k[0], v[0], 64**-0.5).reshape(q.shape)
            out[f"products_{name}"] = kernel.kernel_products(dtype, 64, 64, False)
        else:
            plan = decode.pattern_plan(pattern.dense_mask(), 2, 64)
            got = decode.decode_attention(plan, q, k, v, 64**-0.5)[0]
            out[f"decode_engine_{name}"] = decode.decode_engine(dtype)
        stats = compare(got, reference_attention(q.double(), k.double(), v.double(), pattern), tolerance_for(name))
        out[f"{name}_{rows}_passed"] = bool(stats.passed)
        out[f"{name}_{rows}_rel_l2"] = stats.rel_l2
print(json.dumps(out))
"""


def machine_has(isa: str) -> bool:
    flags: set[str] = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    return all(f in flags for f in kernel.ISA_NEEDS[isa])


pytestmark = pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 variants (aarch64 falls back)")


@pytest.mark.parametrize("isa", ["DEFAULT", "AVX2", "AVX512"])
def test_each_variant_compiles_and_where_this_cpu_has_it_runs_right(isa, tmp_path):
    if not machine_has(isa):  # compile only: what a build on such a CPU would meet in the compiler
        for source in SOURCES:
            try:
                kernel.compile_object(source, isa, tmp_path / f"{source.stem}.o")
            except subprocess.CalledProcessError as exc:
                pytest.fail(f"{source.name} does not compile for {isa}:\n{exc.stderr[-3000:]}")
        return
    onednn, mkl = LIBRARY_LEVEL[isa]
    # Inductor's cache keys ignore ATEN_CPU_CAPABILITY: a process held to another level keeps its own
    env = {**os.environ, "ATEN_CPU_CAPABILITY": isa.lower(), "ONEDNN_MAX_CPU_ISA": onednn,
           "MKL_ENABLE_INSTRUCTIONS": mkl, "PYTHONPATH": str(ROOT), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "ind")}
    proc = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["capability"] == isa
    assert got["kernel"] is None and got["decode"] is None, got  # both built: no fallback at this level
    assert all(got[key] for key in got if key.endswith("_passed")), got
    if isa in ENGINES:
        assert (got["products_float32"], got["products_bfloat16"], got["decode_engine_float32"]) == ENGINES[isa]
