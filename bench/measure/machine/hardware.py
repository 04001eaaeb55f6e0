"""Datasheet figures of the GPUs this suite targets, the peak a record is compared with, and the suite for a GPU.

Rates are dense (without 2:4 structured sparsity, which datasheets quote as the headline figure and which
attention does not use), in FLOP/s; memory in bytes; bandwidths in bytes/s. NVIDIA's "GB" of device memory
are GiB (a 24 GB RTX 4090 reports 24564 MiB). Interconnect bandwidth is the datasheet's total over both
directions. These are upper bounds no kernel reaches; `bench calibrate` measures what this machine reaches.

    python -m bench.measure.machine.hardware suite-for-gpu   # prints the suite file for the GPU detected here
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.table import Table

# bench/suites: in a checkout a link to suites/, in an installed package the copy its wheel carries
SUITES_DIR = Path(__file__).resolve().parents[2] / "suites"
GiB = 2**30
TERA = 1e12


@dataclass(frozen=True)
class HardwareSpec:
    key: str
    name: str
    memory_bytes: int
    memory_bandwidth: float  # bytes/s, device memory
    l2_bytes: int
    fp32_flops: float  # non-tensor FP32
    tf32_flops: float  # tensor cores, TF32 inputs, FP32 accumulate
    fp16_flops: float  # tensor cores, FP16 inputs, FP32 accumulate (what PyTorch uses)
    bf16_flops: float  # tensor cores, BF16 inputs, FP32 accumulate
    interconnect: str
    interconnect_bandwidth: float  # bytes/s per GPU, both directions together, as datasheets state
    source: str

    def peak_flops(self, dtype: str, tf32: bool = False) -> tuple[float, str]:
        """(FLOP/s, which unit) for matmuls on `dtype` inputs; float32 uses TF32 only when the impl does."""
        if dtype == "float16":
            return self.fp16_flops, "fp16 tensor"
        if dtype == "bfloat16":
            return self.bf16_flops, "bf16 tensor"
        if dtype == "float32":
            return (self.tf32_flops, "tf32 tensor") if tf32 else (self.fp32_flops, "fp32")
        raise ValueError(f"dtype {dtype!r}; allowed: float32, float16, bfloat16")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


HARDWARE: dict[str, HardwareSpec] = {}


def _add(spec: HardwareSpec) -> None:
    HARDWARE[spec.key] = spec


# NVIDIA Ada GPU Architecture whitepaper v1.03, Appendix A, "GeForce RTX 4090": FP32 82.6 TFLOPS; FP16 and
# BF16 tensor with FP32 accumulate 165.2 (330.3 with FP16 accumulate, which PyTorch does not use); TF32
# tensor 82.6; 24 GB GDDR6X at 1008 GB/s; L2 72 MB. No NVLink: PCIe 4.0 x16, 64 GB/s both directions.
_add(HardwareSpec("rtx4090", "NVIDIA GeForce RTX 4090", 24 * GiB, 1008e9, 72 * 2**20,
                  82.6 * TERA, 82.6 * TERA, 165.2 * TERA, 165.2 * TERA, "PCIe 4.0 x16 (no NVLink)", 64e9,
                  "NVIDIA Ada GPU Architecture whitepaper v1.03, appendix A"))
# NVIDIA A100 Tensor Core GPU datasheet (1758950-r4): FP32 19.5 TFLOPS; TF32 tensor 156; BF16/FP16 tensor
# 312; 40 GB HBM2 at 1,555 GB/s (SXM4); L2 40 MB (A100 whitepaper); NVLink 3 600 GB/s.
_add(HardwareSpec("a100_40gb", "NVIDIA A100-SXM4-40GB", 40 * GiB, 1555e9, 40 * 2**20,
                  19.5 * TERA, 156 * TERA, 312 * TERA, 312 * TERA, "NVLink 3 (12 links)", 600e9,
                  "NVIDIA A100 datasheet 1758950-r4"))
# Same datasheet, A100 80GB SXM4: HBM2e at 2,039 GB/s, same compute rates; NVLink 3 600 GB/s.
_add(HardwareSpec("a100_80gb", "NVIDIA A100-SXM4-80GB", 80 * GiB, 2039e9, 40 * 2**20,
                  19.5 * TERA, 156 * TERA, 312 * TERA, 312 * TERA, "NVLink 3 (12 links)", 600e9,
                  "NVIDIA A100 datasheet 1758950-r4"))
# NVIDIA H100 Tensor Core GPU datasheet (2023), H100 SXM: FP32 67 TFLOPS; TF32 tensor 989 and BF16/FP16
# 1,979 "with sparsity", so 494.7 and 989.4 dense; 80 GB HBM3 at 3.35 TB/s; L2 50 MB (H100 whitepaper);
# NVLink 4 900 GB/s.
_add(HardwareSpec("h100_sxm", "NVIDIA H100 80GB HBM3 (SXM5)", 80 * GiB, 3.35e12, 50 * 2**20,
                  67 * TERA, 494.7 * TERA, 989.4 * TERA, 989.4 * TERA, "NVLink 4 (18 links)", 900e9,
                  "NVIDIA H100 Tensor Core GPU datasheet (2023), SXM column"))
# Same datasheet, H100 PCIe: FP32 51 TFLOPS; TF32 756 and BF16/FP16 1,513 with sparsity (378 and 756.5
# dense); 80 GB HBM2e at 2 TB/s; PCIe Gen5 128 GB/s (an NVLink bridge joins pairs at 600 GB/s).
_add(HardwareSpec("h100_pcie", "NVIDIA H100 PCIe", 80 * GiB, 2.0e12, 50 * 2**20,
                  51 * TERA, 378 * TERA, 756.5 * TERA, 756.5 * TERA, "PCIe 5.0 x16 (NVLink bridge: pairs)", 128e9,
                  "NVIDIA H100 Tensor Core GPU datasheet (2023), PCIe column"))
# NVIDIA H200 Tensor Core GPU datasheet (2024), H200 SXM: FP32 67 TFLOPS; TF32 989 and BF16/FP16 1,979 with
# sparsity (494.7 and 989.4 dense); 141 GB HBM3e at 4.8 TB/s; the GH100 die's 50 MB L2; NVLink 4 900 GB/s.
_add(HardwareSpec("h200", "NVIDIA H200 (SXM)", 141 * GiB, 4.8e12, 50 * 2**20,
                  67 * TERA, 494.7 * TERA, 989.4 * TERA, 989.4 * TERA, "NVLink 4 (18 links)", 900e9,
                  "NVIDIA H200 Tensor Core GPU datasheet (2024), SXM column"))

# `bench model --gpu` accepts the keys above and these short names.
ALIASES = {"a100": "a100_80gb", "h100": "h100_sxm", "4090": "rtx4090"}
GPU_CHOICES = sorted(set(HARDWARE) | set(ALIASES))

# The suite sized for each card (docs/DESIGN.md "Layout"); H200 runs the H100 suite, which fits its 141 GB.
SUITE_FOR = {"rtx4090": "rtx4090.yaml", "a100_40gb": "a100.yaml", "a100_80gb": "a100.yaml",
             "h100_sxm": "h100.yaml", "h100_pcie": "h100.yaml", "h200": "h100.yaml"}

# Device names as the driver reports them (torch.cuda.get_device_name / nvidia-smi) -> key. Order matters.
_NAME_PATTERNS = [
    (r"RTX 4090(?! D)(?!.*Laptop)", "rtx4090"),
    (r"A100.*80\s*GB", "a100_80gb"),
    (r"A100", "a100_40gb"),  # A100-SXM4-40GB, A100-PCIE-40GB; an 80 GB board is caught above or by memory
    (r"H100.*PCIe", "h100_pcie"),
    (r"H100(?!.*NVL)", "h100_sxm"),  # "NVIDIA H100 80GB HBM3" is the SXM5 part
    (r"H200(?!.*NVL)", "h200"),
]


def resolve(key: str) -> HardwareSpec:
    """The spec for a key or alias; ValueError naming the allowed ones."""
    spec = HARDWARE.get(ALIASES.get(key, key))
    if spec is None:
        raise ValueError(f"unknown GPU {key!r}; allowed: {', '.join(GPU_CHOICES)}")
    return spec


def match_gpu(name: str, memory_bytes: int | None = None) -> HardwareSpec | None:
    """The datasheet entry for a device name as the driver reports it, or None for a card not in the table."""
    for pattern, key in _NAME_PATTERNS:
        if re.search(pattern, name, flags=re.IGNORECASE):
            if key == "a100_40gb" and memory_bytes is not None and memory_bytes > 48 * GiB:
                key = "a100_80gb"
            return HARDWARE[key]
    return None


def suite_for_gpu(name: str, memory_bytes: int | None) -> Path:
    """The suite sized for this GPU: by name, or for a card not in the table, by its memory."""
    spec = match_gpu(name, memory_bytes)
    if spec is not None:
        filename = SUITE_FOR[spec.key]
    elif memory_bytes is None or memory_bytes < 36 * GiB:  # unknown or up to 32 GB: the 24 GB suite
        filename = "rtx4090.yaml"
    elif memory_bytes < 90 * GiB:  # 40 to 80 GB cards (L40S, A6000, A100 PCIe...): the A100 suite
        filename = "a100.yaml"
    else:
        filename = "h100.yaml"
    return SUITES_DIR / filename


def detect_gpu() -> tuple[str, int] | None:
    """(name, memory bytes) of the first GPU torch sees, else of the first NVML sees; None without a GPU."""
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return props.name, int(props.total_memory)
    from bench.measure.machine.nvml import shared

    nvml = shared()
    if nvml.count():
        info = nvml.describe(nvml.handle(index=0))
        if info["name"]:
            return info["name"], info["memory_bytes"]
    return None


def _tflops(x: float) -> str:
    return f"{x / TERA:g}"


def hardware_table() -> Table:
    table = Table(title="GPU datasheet figures (dense, no 2:4 sparsity)")
    for column in ("key", "name", "memory GiB", "memory TB/s", "fp32 TFLOP/s", "tf32 TFLOP/s", "fp16 TFLOP/s",
                   "bf16 TFLOP/s", "L2 MiB", "interconnect", "GB/s", "suite"):
        numeric = "/s" in column or "iB" in column
        table.add_column(column, justify="right" if numeric else "left", no_wrap=column in ("key", "suite"))
    for spec in HARDWARE.values():
        table.add_row(spec.key, spec.name, f"{spec.memory_bytes / GiB:g}", f"{spec.memory_bandwidth / TERA:g}",
                      _tflops(spec.fp32_flops), _tflops(spec.tf32_flops), _tflops(spec.fp16_flops),
                      _tflops(spec.bf16_flops), f"{spec.l2_bytes / 2**20:g}", spec.interconnect,
                      f"{spec.interconnect_bandwidth / 1e9:g}", f"suites/{SUITE_FOR[spec.key]}")
    table.caption = ("sources: " + "; ".join(sorted({s.source for s in HARDWARE.values()}))
                     + ". `bench calibrate` measures this machine.")
    return table


def _display_path(path: Path) -> str:
    relative = os.path.relpath(path)
    return path.as_posix() if relative.startswith("..") else relative


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.measure.machine.hardware")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("suite-for-gpu", help="print the suite file sized for the GPU detected here")
    p.add_argument("--name", help="a device name instead of detecting one (e.g. 'NVIDIA H200')")
    p.add_argument("--memory-gib", type=float, help="its memory, for a card not in the table")
    args = parser.parse_args(argv)
    if args.name:
        gpu: tuple[str, int | None] | None = (args.name, int(args.memory_gib * GiB) if args.memory_gib else None)
    else:
        gpu = detect_gpu()
    if gpu is None:
        print("suite-for-gpu: no GPU detected (torch sees no CUDA device and NVML none)", file=sys.stderr)
        return 1
    path = suite_for_gpu(*gpu)
    spec = match_gpu(*gpu)
    how = f"datasheet entry {spec.key}" if spec else "not in the table; chosen by memory"
    print(f"suite-for-gpu: {gpu[0]} ({how})", file=sys.stderr)
    print(_display_path(path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
