"""Compile the kernels for NVIDIA GPUs ahead of time, on any machine, without a GPU.

Usage: `TRITON_INTERPRET=0 python -m impls.triton_block_sparse.compile_check [--arch 90] [--head-dim 128]
[--dtype bfloat16]` (TRITON_INTERPRET=0 keeps a machine without CUDA from choosing the interpreter).

The interpreter proves the kernels' arithmetic; this proves what it cannot - that they pass Triton's compiler
(types, layouts, pipelining) down to a cubin for a GPU architecture, for every candidate tile configuration,
and how much shared memory each needs against that architecture's per-block limit. Nothing runs on a GPU,
so no speed comes out of it. It must run in a process of its own: the kernels are built compiled here,
while a process without CUDA builds them for the interpreter (mode.kernels()).

Arguments are specialised the way a real launch specialises them (tools/compile.py in Triton does the
same): strides of 1 are constants, pointers and the row strides of (B, H, N, D) tensors are 16-divisible.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

# Per-block shared memory a kernel may opt into, bytes (CUDA C Programming Guide, "Technical Specifications
# per Compute Capability"): 8.0 (A100) 163 KB, 8.6 / 8.9 (RTX 30xx / RTX 4090) 99 KB, 9.0 (H100, H200) 227 KB.
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
_DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
_TENSORS = {"Q", "K", "V", "O", "DO", "DK", "DV", "DQ"}  # in the input dtype; LSE / DELTA are float32
_FLOATS = {"qk_scale", "sm_scale", "cap2"}


def _signature(fn, dtype: str, constexprs: dict) -> tuple[dict, dict]:
    """(signature, attrs) for ASTSource: types per argument, 16-divisibility hints by argument index."""
    sig, attrs = {}, {}
    for index, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in _TENSORS:
            sig[name] = f"*{_DTYPES[dtype]}"
        elif name in ("LSE", "DELTA", "BIAS", "O_PART", "LSE_PART"):
            sig[name] = "*fp32"
        elif name.startswith(("row_", "col_", "mask_")):
            sig[name] = "*i32"
        elif name in _FLOATS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
        if sig[name].startswith("*") or (name.startswith("stride_") and name[-1] in "bhn"):
            attrs[(index,)] = [["tt.divisibility", 16]]
    return sig, attrs


def compile_kernel(kernel: str, config, arch: int, head_dim: int, dtype: str, mask_kind: int,
                   mod_kind: int = 0, packed_rows: int = 16) -> dict:
    """Compile one kernel for sm_<arch>; returns its shared memory, or the compiler's error."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from impls.triton_block_sparse import kernels, launch

    fn = getattr(kernels, kernel)
    constexprs: dict = {"D": head_dim, "HEAD_DIM": launch.padded_head_dim(head_dim)}
    if kernel == "attn_bwd_preprocess":
        constexprs["BLOCK_M"] = launch.PREPROCESS_BLOCK
    elif kernel == "attn_decode_combine":
        constexprs["BLOCK_S"] = 64
    else:
        constexprs.update(MASK_KIND=mask_kind, HAS_DILATION=mask_kind == 1, HAS_GLOBAL=mask_kind == 1,
                          WORDS=-(-config.block_n // 32), BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                          DOT_F32=False, MOD_KIND=mod_kind)
        constexprs.update({name: 1 for name in fn.arg_names if name.startswith("stride_") and name.endswith("d")})
        if kernel == "attn_fwd_decode":  # the table's query tile, and the packed rows of a GQA group
            constexprs.update(TILE_M=config.block_m, BLOCK_M=packed_rows)
    sig, attrs = _signature(fn, dtype, constexprs)
    target = GPUTarget("cuda", arch, 32)
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    result = {"kernel": kernel, "arch": arch, "config": config.label, "head_dim": head_dim, "dtype": dtype,
              "mask_kind": mask_kind, "mod_kind": mod_kind, "shared_limit": SHARED_LIMIT.get(arch)}
    if kernel == "attn_fwd_decode":
        result["packed_rows"] = packed_rows
    t0 = time.perf_counter()
    try:
        compiled = triton.compile(ASTSource(fn, sig, constexprs, attrs), target=target, options=options)
    except Exception as exc:
        result.update(ok=False, error=f"{type(exc).__name__}: {str(exc).strip()[:400]}")
    else:
        result.update(ok=True, shared=compiled.metadata.shared, has_cubin="cubin" in compiled.asm)
    result["compile_s"] = round(time.perf_counter() - t0, 2)
    return result


def check(archs: list[int], head_dim: int, dtype: str, mask_kinds: list[int], mod_kinds: list[int] | None = None
          ) -> list[dict]:
    """Every candidate configuration of every kernel, for each architecture, mask kind and score modification."""
    from impls.triton_block_sparse import launch

    plan = [("attn_fwd", launch.FWD_CONFIGS), ("attn_bwd_dkdv", launch.DKDV_CONFIGS),
            ("attn_bwd_dq", launch.DQ_CONFIGS)]
    from impls.triton_block_sparse import decode

    results = []
    for arch in archs:
        results.append(compile_kernel("attn_bwd_preprocess", launch.TileConfig(64, 64, 4, 1), arch, head_dim,
                                      dtype, 0))
        results.append(compile_kernel("attn_decode_combine", launch.TileConfig(64, 64, 4, 1), arch, head_dim,
                                      dtype, 0))
        for kernel, configs in plan:
            for mask_kind in mask_kinds:
                for mod_kind in mod_kinds or [0]:
                    for config in configs:
                        results.append(compile_kernel(kernel, config, arch, head_dim, dtype, mask_kind, mod_kind))
        # decode: one GQA group's packed rows (G * q_len: 4 x 1 at Llama-3-8B, the most allowed), no bias
        for mask_kind in mask_kinds:
            for mod_kind in [m for m in mod_kinds or [0] if m != 2]:
                for config in decode.DECODE_CONFIGS:
                    for packed in (16, decode.DECODE_MAX_PACKED):
                        results.append(compile_kernel("attn_fwd_decode", config, arch, head_dim, dtype, mask_kind,
                                                      mod_kind, packed))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, action="append", choices=sorted(SHARED_LIMIT),
                        help="compute capability x10 (repeatable; default 90)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16")
    parser.add_argument("--mask-kind", type=int, action="append", choices=range(5),
                        help="tables.MASK_* value (repeatable; default 4, the bitmask, the largest kernel)")
    parser.add_argument("--mod-kind", type=int, action="append", choices=range(3),
                        help="score_mods.MOD_* value (repeatable; default all: none, softcap, bias)")
    args = parser.parse_args(argv)
    from impls.triton_block_sparse import mode

    if mode.uses_interpreter():
        print("compile_check needs compiled kernels: run it with TRITON_INTERPRET=0", file=sys.stderr)
        return 2
    results = check(args.arch or [90], args.head_dim, args.dtype, args.mask_kind or [4], args.mod_kind or [0, 1, 2])
    print(json.dumps(results, indent=1))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
