"""The CPU kernel of `blocked` for inference (kernel.cpp), built on first use, and its block table.

torch ops alone leave the fast CPU paths on the table: a gather plan copies each query block's key and value
blocks before its products (aten::index was a third of a bfloat16 call), every step's scores make a round
trip through memory for the softmax and the masks, and the low-precision products run as many small oneDNN
calls. The kernel walks the pattern's block table (the view FlexAttention gets) per (KV head, query block):
batch-reduce GEMMs from torch's CPU BLAS on key and value blocks packed once per call, the softmax online in
float32 between them, scores kept in the thread's buffers.

It is compiled with torch's C++ extension builder (a C++ compiler and ninja; about a minute, once per machine:
the build is cached under the torch extensions directory, named by the source's digest and the CPU's vector
ISA).
On a CPU without bfloat16 products (AVX2, AVX512 without BF16) bfloat16 runs on float32 operands, widened as the
blocks are packed (`widened`). Where the kernel cannot be built or the case is one it does not take
(`unavailable_reason`), `blocked` keeps its torch-op paths and says so in its record (`config.fallback`).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from bench.registry import artifact_path

# float16: oneDNN's ukernel here takes it unpacked (pack() refuses: "No need to pack"), a layout not written yet.
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
# head_dim and block_size are multiples of this: oneDNN packs 16-bit B operands in whole 16-column groups
# (head_dim 24 at block_size 16 failed to pack).
SHAPE_MULTIPLE = 16
_SOURCE = Path(__file__).with_name("kernel.cpp")
# torch's CPU capability -> compiler flags of its vector code (at::vec picks its Vectorized<float> by them).
_ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mfma", "-DCPU_CAPABILITY_AVX512",
               "-DCPU_CAPABILITY=AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"],
}

_lock = threading.Lock()
_module: Any = None
_unavailable: str | None = None


# What a CPU needs for each variant (its /proc/cpuinfo flags), for the test that runs the variants a machine has.
ISA_NEEDS = {"DEFAULT": (), "AVX2": ("avx2", "fma", "f16c"),
             "AVX512": ("avx512f", "avx512dq", "avx512vl", "avx512bw", "fma")}


def isa_flags(isa: str) -> list[str]:
    """The compiler flags of torch's CPU capability `isa` (DEFAULT, AVX2, AVX512)."""
    return _ISA_FLAGS.get(isa, ["-DCPU_CAPABILITY=DEFAULT"])


def compile_object(source: Path, isa: str, out: Path) -> None:
    """Compile one of blocked's sources for `isa` to an object file, unoptimised and not loaded: what a build for a
    CPU this machine is not would meet in the compiler (the test of every variant). Raises CalledProcessError."""
    import subprocess
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    includes = [arg for path in [*include_paths(), sysconfig.get_paths()["include"]] for arg in ("-isystem", path)]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    subprocess.run([os.environ.get("CXX", "c++"), "-O0", "-c", "-fPIC", "-std=c++17", "-fopenmp",
                    f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-DTORCH_EXTENSION_NAME=variant",
                    "-DTORCH_API_INCLUDE_EXTENSION_H", *includes, *isa_flags(isa), str(source), "-o", str(out)],
                   check=True, capture_output=True, text=True)


def build_extension(source: Path, stem: str) -> Any:
    """Compile and load one of blocked's C++ sources with torch's extension builder (cached per digest and ISA)."""
    from torch.utils.cpp_extension import get_default_build_root, load

    try:  # the ninja package's binary, which an unactivated virtual environment does not have on PATH
        import ninja

        if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass

    isa = torch.backends.cpu.get_cpu_capability()
    flags = isa_flags(isa)
    # The source's digest in the name: two checkouts with different kernels (`bench ab` of two revisions) each
    # keep their own build instead of rebuilding over each other's in the shared extensions directory.
    text = source.read_bytes()
    digest = hashlib.sha256(text).hexdigest()[:10]
    name = f"{stem}_{isa.lower()}_{digest}"
    build_dir = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / name
    build_dir.mkdir(parents=True, exist_ok=True)
    # Compiled from a copy inside the build directory: ninja's rule names the source's path, so the same source
    # in another checkout (each side of `bench ab`, a fresh clone) would otherwise rebuild it, ~1 minute each.
    staged = build_dir / f"{name}.cpp"
    # torch's own build lock is a file that outlives a process killed mid-build (a pair's timeout, a test that
    # kills its worker), and every later build then waits on it forever. An flock dies with its holder: whoever
    # holds ours is the only builder, so a torch lock file found then is a dead builder's and is removed.
    # A failed build is kept beside the builds: every later process (each worker of a run, each run) reads it instead
    # of failing the same way again after a minute; deleting the file tries again.
    failed = build_dir.parent / f"{name}.failed"
    stamp = f"torch {torch.__version__}, C++11 ABI {int(torch._C._GLIBCXX_USE_CXX11_ABI)}, flags {' '.join(flags)}\n"
    with open(build_dir.parent / f"{name}.flock", "w") as baton:
        fcntl.flock(baton, fcntl.LOCK_EX)
        if failed.is_file() and failed.read_text().startswith(stamp):
            raise RuntimeError(f"{failed.read_text()[len(stamp):]}\n(this source failed to build on this machine "
                               f"before and is not tried again: delete {failed} to retry)")
        (build_dir / "lock").unlink(missing_ok=True)
        if not staged.exists() or staged.read_bytes() != text:
            staged.write_bytes(text)
        # A library built from this source with this torch and these flags is loaded as it is: torch's builder
        # would rebuild it for another virtual environment (its ninja file names that environment's include
        # paths), though the headers of one torch version are the same everywhere.
        built, library = build_dir / "built-with", build_dir / f"{name}.so"
        if library.is_file() and built.is_file() and built.read_text() == stamp:
            return _load_library(name, library)
        # -fopenmp: at::parallel_for is OpenMP pragmas in torch's headers; without it the kernel ran on one
        # thread. It links libgomp.so.1, which resolves to the copy torch has already loaded (one runtime).
        try:
            module = load(name=name, sources=[str(staged)], build_directory=str(build_dir),
                          extra_cflags=["-O3", "-fopenmp", *flags], extra_ldflags=["-fopenmp"], verbose=False)
        except Exception as exc:
            failed.write_text(stamp + str(exc))
            raise
        built.write_text(stamp)
        return module


def _load_library(name: str, library: Path) -> Any:
    """The Python module of an extension library already built (what torch's loader does after a build)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"{library} is not a loadable extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build() -> Any:
    return build_extension(_SOURCE, "blocked_cpu_kernel")


def build_failure(what: str, stem: str, exc: Exception) -> str:
    """The reason a build failed, short enough for a record: its first error line, and where the whole compiler
    log is kept (the run directory under `bench run`): the last few hundred characters rarely held the cause."""
    log = artifact_path(f"{stem}-build-error.log")
    log.write_text(f"{type(exc).__name__} while building {what} with torch {torch.__version__}\n\n{exc}\n")
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    first = next((ln for ln in lines if "error" in ln.lower() and ln != lines[0]), lines[0] if lines else "")
    return f"{what} could not be built ({type(exc).__name__}: {first[:200]}); the whole compiler log: {log}"


def kernel_module() -> Any:
    """The compiled kernel, or None when it could not be built (`unavailable_reason` says why)."""
    global _module, _unavailable
    with _lock:
        if _module is None and _unavailable is None:
            try:
                _module = _build()
            except Exception as exc:  # no compiler, no ninja, a build error: the torch-op paths remain
                _unavailable = build_failure("the CPU kernel", "blocked_cpu_kernel", exc)
    return _module


def kernel_wanted(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether inference goes to the kernel (where it is available and takes the shape): on CPU in float32 and
    bfloat16, for every plan, as measured fastest.

    Interleaved with compiled flex in one process (2-core Xeon with AMX, 2 threads, B=1, N=4096, x flex's speed):
    block_random p=0.1 H8 D64 bfloat16 1.33x against 0.51x for the torch-op gather steps, float32 2.56x against
    1.47x; causal_local W=1024 bfloat16 1.50x against 1.11x for the fused band path, float32 2.10x against 1.48x
    for the window steps; local W=256 bfloat16 1.11x against 0.97x, float32 2.09x against 1.68x; at 32 query
    heads on 8 KV heads, D=128, bfloat16: local W=256 1.05x against 0.76x, causal_local W=1024 1.20x against
    0.89x. float32 local W=256 at N=16384: 1.65x against 1.67x (alike). On a 2-core AMD EPYC (Zen 4,
    AVX512-BF16, no AMX), in the committed cpu run at d4170a9: 1.64x to 2.54x flex in float32 and 3.86x to
    5.65x in bfloat16 over the same cases.
    """
    return device.type == "cpu" and dtype in KERNEL_DTYPES


def unavailable_reason(q: Tensor, block_size: int) -> str | None:
    """Why inference on q (B, H, q_len, D) in blocks of `block_size` cannot use the kernel; None when it can."""
    if q.device.type != "cpu":
        return "not a CPU tensor"
    if q.dtype not in KERNEL_DTYPES:
        return f"{q.dtype} (the kernel takes float32 and bfloat16)"
    if q.shape[-1] % SHAPE_MULTIPLE or block_size % SHAPE_MULTIPLE:
        return (f"head_dim {q.shape[-1]} and block_size {block_size}: the kernel takes multiples of "
                f"{SHAPE_MULTIPLE} (the GEMM's packed operands)")
    module = kernel_module()
    if module is None:
        return _unavailable
    return None


def widened(dtype: torch.dtype) -> bool:
    """Whether the kernel computes `dtype` on float32 operands: bfloat16 on a CPU with neither AMX (oneDNN's packer)
    nor AVX512-BF16, where a bfloat16 GEMM would emulate its products. The blocks are widened as they are packed
    (kernel.cpp, BlockPacker), as llama.cpp's CPU path widens its 16-bit blocks; the stored inputs and the output
    stay bfloat16."""
    if dtype != torch.bfloat16:
        return False
    module = kernel_module()
    return module is not None and not (module.library_packs(dtype) or has_bf16_dot_products())


def gemm_engine(dtype: torch.dtype, kernel: bool = False) -> str:
    """The instructions this machine's GEMMs run for `dtype` (the record's config.gemm, in prefill and over
    selections; `kernel`: the kernel's, else the torch steps'; `kernel_products` says whether the kernel's ran
    through oneDNN or its own tiles): amx_bf16 (AMX tiles), avx512_bf16 (AVX512-BF16 dot products), emulated
    (16-bit products without either, in torch's steps), or fp32 at torch's CPU capability (e.g. fp32_avx512; the
    kernel's bfloat16 where it widens it)."""
    if dtype not in (torch.bfloat16, torch.float16) or (kernel and widened(dtype)):
        return f"fp32_{torch.backends.cpu.get_cpu_capability().lower()}"
    features = getattr(torch._C._cpu, "_get_cpu_capability", dict)()
    if dtype == torch.bfloat16 and features.get("amx_bf16", False):
        return "amx_bf16"
    if dtype == torch.float16 and features.get("amx_fp16", False):
        return "amx_fp16"
    if dtype == torch.bfloat16 and has_bf16_dot_products():
        return "avx512_bf16"
    return "emulated"


def kernel_products(dtype: torch.dtype, block_size: int, head_dim: int, modified: bool) -> str:
    """Which code runs the CPU kernel's two products (the record's config.products on the kernel path):
    dot_tiles (the kernel's own register tiles, a tile's rows through the whole softmax at a time: float32 on
    AVX512 FMAs, bfloat16 on AVX512-BF16 without AMX; blocks and heads of whole 16-column vectors, no score
    modification) or onednn_brgemm."""
    module = kernel_module()
    if module is not None and widened(dtype):
        return "onednn_brgemm_widened"  # float32 GEMMs on bfloat16 widened as the blocks are packed
    taken = module is not None and module.dot_products(dtype, block_size, head_dim, modified,
                                                       dot_tiles_allowed(dtype))
    return "dot_tiles" if taken else "onednn_brgemm"


def dot_tile_rows(dtype: torch.dtype) -> int:
    """Query rows per register tile of the kernel's dot tiles in `dtype` (kernel.cpp, TileShape)."""
    module = kernel_module()
    assert module is not None, "dot_tile_rows needs the built kernel"
    return int(module.dot_tile_rows(dtype))


def dot_tiles_allowed(dtype: torch.dtype) -> bool:
    """Whether the kernel may run its own dot-product tiles in `dtype`: bfloat16 needs AVX512-BF16's instruction,
    float32 AVX512's FMAs (the module, built for AVX512, checks that)."""
    return dtype != torch.bfloat16 or has_bf16_dot_products()


def has_bf16_dot_products() -> bool:
    """AVX512-BF16 (Zen 4, Cooper Lake and later): oneDNN's batch-reduce GEMM runs bfloat16 on its dot-product
    instruction, on B operands this module packs itself."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return False
    features = getattr(torch._C._cpu, "_get_cpu_capability", dict)()
    return bool(features.get("avx512_bf16", False))


@dataclass(frozen=True)
class BlockTable:
    """The pattern's block-sparse view as the kernel reads it (int32 and bool, contiguous)."""

    block: int
    kv_index: Tensor  # (nqb, max_kv) key block per slot (padding slots: 0, never read)
    kv_count: Tensor  # (nqb,)
    mask_slot: Tensor  # (nqb, max_kv): index into masks of a partial block, -1 for a full one
    masks: Tensor  # (P, bs, bs) allowed pairs inside partial blocks

    path = "kernel"

    @property
    def computed_pairs(self) -> int:
        """(query, key) products per query head: every listed block whole."""
        return int(self.kv_count.sum()) * self.block * self.block

    def dot_tile_pairs(self, q_len: int, seq_len: int, group: int, tile_rows: int) -> int:
        """(query, key) products per query head through the dot tiles (`kernel_products` "dot_tiles"): a task
        holds the `group` query heads' rows of a query block one after the other, and each `tile_rows` of those
        rows (`dot_tile_rows`) compute a listed block over the 16-key vectors that hold a key one of them may see
        (kernel.cpp, dot_rows)."""
        bs, nqb = self.block, self.kv_index.shape[0]
        listed = torch.arange(self.kv_index.shape[1]) < self.kv_count[:, None]
        valid = (seq_len - self.kv_index.long() * bs).clamp(max=bs)  # keys in each listed block
        rows = (q_len - torch.arange(nqb) * bs).clamp(0, bs)  # query rows of each query block, per head
        full = listed & (self.mask_slot < 0)
        pairs = int(((valid + 15) // 16 * 16 * rows[:, None])[full].sum()) * group
        qb, entry = torch.nonzero(listed & (self.mask_slot >= 0), as_tuple=True)  # the partial blocks listed
        if qb.numel():
            keys = torch.arange(bs)
            allowed = self.masks[self.mask_slot[qb, entry].long()]
            lo = torch.where(allowed, keys, bs).amin(-1)  # (E, bs): each mask row's keys [lo, hi), cut at N
            hi = torch.minimum(torch.where(allowed, keys + 1, 0).amax(-1), valid[qb, entry][:, None])
            lo = torch.where(lo < hi, lo, bs)
            # row i of the task: head i // rows, row i % rows of the block; padded to whole register tiles
            task_rows = torch.arange(-(-group * bs // tile_rows) * tile_rows)
            t = task_rows % rows[qb][:, None].clamp(min=1)
            real = task_rows < group * rows[qb][:, None]
            lo = torch.where(real, lo.gather(1, t), bs).reshape(len(qb), -1, tile_rows)
            hi = torch.where(real, hi.gather(1, t), 0).reshape(len(qb), -1, tile_rows)
            width = ((hi.amax(-1) + 15) // 16 * 16).clamp(max=bs) - lo.amin(-1) // 16 * 16
            pairs += int((width.clamp(min=0) * real.reshape(len(qb), -1, tile_rows).sum(-1)).sum())
        return pairs // group


def block_table(pattern, bs: int) -> BlockTable:
    sparse = pattern.block_sparse(bs)
    masks = sparse.masks if sparse.masks.numel() else torch.zeros(1, bs, bs, dtype=torch.bool)
    return BlockTable(bs, sparse.kv_indices.clamp(min=0).to(torch.int32).contiguous(),
                      sparse.kv_counts.to(torch.int32).contiguous(), sparse.mask_index.to(torch.int32).contiguous(),
                      masks.contiguous())


@dataclass(frozen=True)
class KernelScoreMod:
    """A score modification as the kernel applies it: softcap's cap (0: none), or an additive bias by query head
    and distance, dist_bias (H, 2N - 1) float32 with entry i - j + N - 1, and the first query row's position."""

    softcap: float = 0.0
    dist_bias: Tensor | None = None
    q_offset: int = 0


def kernel_score_mod(case) -> KernelScoreMod | None:
    """The case's modification for the kernel; None when it has none or it is not one the kernel applies (a
    custom one, which may depend on more than the head and the distance)."""
    mod = case.make_score_mod()
    if mod is None or mod.kind == "custom":
        return None
    q_offset = case.seq_len - case.n_queries
    if mod.kind == "softcap":
        return KernelScoreMod(softcap=float(mod.cap), q_offset=q_offset)
    bias = mod.distance_bias(case.heads, case.seq_len)
    return KernelScoreMod(dist_bias=bias.to(torch.float32).contiguous(), q_offset=q_offset)


def kernel_attention(table: BlockTable, q: Tensor, k: Tensor, v: Tensor, scale: float,
                     own_pairs: bool = False, mod: KernelScoreMod | None = None) -> Tensor:
    """q (B*Hkv, G, q_len, D), k, v (B*Hkv, N, D) -> (B*Hkv, G, q_len, D); rows without an allowed key zero.

    own_pairs: bfloat16 operands packed by the kernel's own VNNI code even where oneDNN has a packer (a test
    compares the two layouts). `mod`: a score modification of the scaled scores, applied before the masks."""
    return kernel_attention_lse(table, q, k, v, scale, own_pairs, mod)[0]


def kernel_attention_lse(table: BlockTable, q: Tensor, k: Tensor, v: Tensor, scale: float,
                         own_pairs: bool = False, mod: KernelScoreMod | None = None) -> tuple[Tensor, Tensor]:
    """`kernel_attention`'s output and the rows' log-sum-exp (B*Hkv, G, q_len) float32, -inf on empty rows."""
    module = kernel_module()
    assert module is not None, "kernel_attention needs the built kernel (see unavailable_reason)"
    mod = mod or _NO_MOD
    return module.block_attention(q.contiguous(), k.contiguous(), v.contiguous(), table.kv_index[None],
                                    table.kv_count[None], table.mask_slot[None], table.masks, scale, table.block,
                                    own_pairs, 1, _NO_BITS, 0, mod.softcap,
                                    _NO_BIAS if mod.dist_bias is None else mod.dist_bias, mod.q_offset,
                                    dot_tiles_allowed(q.dtype), widened(q.dtype))


_NO_BITS = torch.empty(0, dtype=torch.int64)
_NO_BIAS = torch.empty(0, dtype=torch.float32)
_NO_MOD = KernelScoreMod()


@dataclass(frozen=True)
class HeadTables:
    """Block tables per task head (a selection's) and query tile: kv_index, mask_slot (T, tiles, max_kv), kv_count
    (T, tiles), the partial blocks' masks, and row_bits (T, tiles, max_kv) int64 where rows of a tile select
    apart."""

    block: int
    kv_index: Tensor
    kv_count: Tensor
    mask_slot: Tensor
    masks: Tensor
    row_bits: Tensor
    tile_rows: int  # query rows per table row (a divisor of block)


def kernel_attention_tables(tables: HeadTables, q: Tensor, k: Tensor, v: Tensor, scale: float,
                            heads_per_kv: int) -> tuple[Tensor, Tensor]:
    """q (T, G, q_len, D), k, v (T / heads_per_kv, N, D) -> (out (T, G, q_len, D), lse (T, G, q_len) float32)."""
    module = kernel_module()
    assert module is not None, "kernel_attention_tables needs the built kernel (see unavailable_reason)"
    return module.block_attention(q.contiguous(), k.contiguous(), v.contiguous(), tables.kv_index, tables.kv_count,
                                  tables.mask_slot, tables.masks, scale, tables.block, False, heads_per_kv,
                                  tables.row_bits, tables.tile_rows, _NO_MOD.softcap, _NO_BIAS, _NO_MOD.q_offset,
                                  dot_tiles_allowed(q.dtype), widened(q.dtype))
