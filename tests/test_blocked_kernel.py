"""The CPU kernel of `blocked` (impls/blocked/kernel.cpp): inference in float32 and bfloat16 over the pattern's
block table, against the float64 oracle on the shapes it takes (gather patterns, wide bands, packed
documents, grouped-query attention at head_dim 128, decode and chunked prefill, N not a multiple of the block,
other block sizes, rows without an allowed key), and the fallback to the torch-op paths, with its reason, where
it cannot run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import impls.blocked.kernel as kernel
from bench import registry
from bench.api import case_for
from bench.measure.oracle.reference import compare, reference_attention, tolerance_for
from bench.patterns import make_pattern
from impls.blocked.decode import DECODE_ROWS

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# (pattern, seq_len, fields, heads, kv_heads, head_dim)
CASES = [
    ("block_random", 640, dict(density=0.2, seed=3, block_size=64), 2, 2, 64),
    ("block_random", 300, dict(density=0.3, seed=1, block_size=64), 2, 1, 64),  # N % bs != 0, GQA
    ("causal_local", 2048, dict(window=1024, block_size=64), 2, 2, 64),  # a band wider than the 8-block chunk
    ("local", 512, dict(window=64, block_size=64, documents=3), 2, 2, 64),  # windows cut by documents
    ("causal", 300, dict(q_len=40, block_size=64), 8, 2, 128),  # chunked prefill, 4 query heads per KV head
    ("causal", 257, dict(q_len=1, block_size=64), 4, 4, 64),  # decode: one query row
    ("block_random", 512, dict(density=0.3, seed=2, block_size=32), 2, 2, 32),
    ("block_random", 512, dict(density=0.3, seed=2, block_size=128), 2, 2, 64),
    ("dilated", 384, dict(window=96, dilation=3, block_size=64), 2, 2, 64),  # partial blocks with holes
    # 24 bfloat16 pairs a key row: K's packing transposes 16 of its words in vector tiles and the other 8 one by one
    ("block_random", 200, dict(density=0.4, seed=4, block_size=32), 2, 2, 48),
]


def _inputs(pattern, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, pattern.q_len, head_dim, generator=gen).to(dtype)
    k, v = (torch.randn(1, kv_heads, pattern.seq_len, head_dim, generator=gen).to(dtype) for _ in range(2))
    return q, k, v


def _inference(pattern, q, k, v) -> tuple[torch.Tensor, dict]:
    impl = registry.get("blocked")
    with torch.no_grad():
        out = impl.prepare(case_for(q, pattern, "fwd", k), pattern, q, k, v)()
    return out, impl.record_extras()


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name, n, fields, heads, kv_heads, head_dim", CASES,
                         ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(CASES)])
def test_kernel_matches_the_oracle(name, n, fields, heads, kv_heads, head_dim, dtype):
    pattern = make_pattern(name, n, **fields)
    q, k, v = _inputs(pattern, heads, kv_heads, head_dim, DTYPES[dtype])
    out, extras = _inference(pattern, q, k, v)
    # a few query rows go to the decode kernel (impls/blocked/decode.cpp), the rest to the block kernel
    expected = "decode" if pattern.q_len <= DECODE_ROWS else "kernel"
    assert extras["path"] == expected and "kernel_unavailable" not in extras, extras
    assert out.dtype == DTYPES[dtype] and out.shape == q.shape
    stats = compare(out, reference_attention(q.double(), k.double(), v.double(), pattern), tolerance_for(dtype))
    assert stats.nonfinite == 0 and stats.passed, f"{name} {dtype}: rel_l2 {stats.rel_l2}"


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_kernel_gives_zero_rows_where_no_key_is_allowed(dtype):
    pattern = make_pattern("block_random", 256, density=0.5, seed=0, block_size=64)
    table = kernel.block_table(pattern, 64)
    emptied = kernel.BlockTable(64, table.kv_index, table.kv_count.clone(), table.mask_slot, table.masks)
    emptied.kv_count[1] = 0  # query block 1 sees nothing
    q, k, v = _inputs(pattern, 2, 2, 64, DTYPES[dtype])
    assert kernel.unavailable_reason(q, 64) is None
    grouped = q[0][:, None]  # (Hkv, G=1, q_len, D)
    out = kernel.kernel_attention(emptied, grouped, k[0], v[0], 0.125)
    full = kernel.kernel_attention(table, grouped, k[0], v[0], 0.125)
    assert torch.count_nonzero(out[:, :, 64:128]) == 0
    assert torch.equal(out[:, :, :64], full[:, :, :64]) and torch.equal(out[:, :, 128:], full[:, :, 128:])


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_large_calls_packed_as_the_tasks_need_them_with_streamed_outputs_match_the_oracle(dtype):
    # Past the threads' L2 the kernel packs each block of K and V where a task first needs it, inside the tasks'
    # region, and writes its output with streaming stores. One thread keeps that bound at one core's L2; N is
    # taken past it for the packed copy and for the output, with a ragged last block.
    torch_dtype = DTYPES[dtype]
    if kernel.unavailable_reason(torch.zeros(1, 1, 16, 64, dtype=torch_dtype), 64) is not None:
        pytest.skip(f"the kernel does not take {dtype} here")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cache = kernel.kernel_module().cache_bytes()
        heads, kv_heads, head_dim, size = 4, 2, 64, torch_dtype.itemsize
        n = (cache // (heads * head_dim * size) // 64 + 1) * 64 + 40
        assert heads * n * head_dim * size > cache and 2 * kv_heads * n * head_dim * size > cache
        pattern = make_pattern("local", n, window=200, block_size=64)
        q, k, v = _inputs(pattern, heads, kv_heads, head_dim, torch_dtype)
        out, extras = _inference(pattern, q, k, v)
    finally:
        torch.set_num_threads(threads)
    assert extras["path"] == "kernel", extras
    stats = compare(out, reference_attention(q.double(), k.double(), v.double(), pattern), tolerance_for(dtype))
    assert stats.nonfinite == 0 and stats.passed, f"{dtype}: rel_l2 {stats.rel_l2}"


def test_kernel_unavailable_falls_back_to_the_torch_ops_and_says_why(monkeypatch):
    monkeypatch.setattr(kernel, "_module", None)
    monkeypatch.setattr(kernel, "_unavailable", "the CPU kernel could not be built (no compiler)")
    pattern = make_pattern("block_random", 320, density=0.3, seed=0, block_size=64)
    q, k, v = _inputs(pattern, 2, 2, 64, torch.float32)
    out, extras = _inference(pattern, q, k, v)
    assert extras["path"] == "gather"
    assert extras["kernel_unavailable"] == "the CPU kernel could not be built (no compiler)"
    stats = compare(out, reference_attention(q.double(), k.double(), v.double(), pattern), tolerance_for("float32"))
    assert stats.passed


def test_a_failed_build_is_reported_not_raised(monkeypatch):
    def fail():
        raise RuntimeError("Error building extension: c++ not found")

    monkeypatch.setattr(kernel, "_module", None)
    monkeypatch.setattr(kernel, "_unavailable", None)
    monkeypatch.setattr(kernel, "_build", fail)
    q = torch.zeros(1, 2, 128, 64)
    assert kernel.kernel_module() is None
    reason = kernel.unavailable_reason(q, 64)
    assert reason is not None and "could not be built" in reason and "c++ not found" in reason


def test_a_dead_builders_lock_does_not_stop_the_next_build(tmp_path, monkeypatch):
    """torch's build lock outlives a builder killed mid-build; the next build removes it instead of waiting."""
    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    source = tmp_path / "tiny.cpp"
    source.write_text("// a source\n")
    seen: dict = {}

    def fake_load(name, sources, build_directory, **_):
        seen["lock_left"] = (tmp_path / name / "lock").exists()
        seen["directory"] = build_directory
        return "module"

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    isa = torch.backends.cpu.get_cpu_capability().lower()
    digest = __import__("hashlib").sha256(source.read_bytes()).hexdigest()[:10]
    stale = tmp_path / f"tiny_{isa}_{digest}" / "lock"
    stale.parent.mkdir(parents=True)
    stale.write_text("")  # what a killed build leaves
    assert kernel.build_extension(source, "tiny") == "module"
    assert seen == {"lock_left": False, "directory": str(stale.parent)}


def test_the_same_source_in_two_checkouts_is_built_from_one_path(tmp_path, monkeypatch):
    """ninja's rule names the source's path: each side of `bench ab` (another worktree) would rebuild the kernel
    over the other's build. Both compile the copy inside the content-addressed build directory."""
    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    sources_seen: list = []
    monkeypatch.setattr(cpp_extension, "load", lambda name, sources, **_: sources_seen.append(sources) or "module")
    for checkout in ("base", "new"):
        source = tmp_path / checkout / "kernel.cpp"
        source.parent.mkdir()
        source.write_text("// the same kernel\n")
        assert kernel.build_extension(source, "tiny") == "module"
    (first,), (second,) = sources_seen
    assert first == second and Path(first).parent.parent == tmp_path / "ext"
    assert Path(first).read_text() == "// the same kernel\n"
    changed = tmp_path / "changed.cpp"
    changed.write_text("// another kernel\n")
    kernel.build_extension(changed, "tiny")
    assert Path(sources_seen[-1][0]).parent != Path(first).parent  # another digest, another build


@pytest.mark.parametrize("head_dim, block_size, dtype, words", [
    (24, 64, torch.float32, "multiples of 16"),
    (64, 24, torch.bfloat16, "multiples of 16"),
    (64, 64, torch.float64, "float32 and bfloat16"),
    (64, 64, torch.float16, "float32 and bfloat16"),
])
def test_shapes_and_dtypes_the_kernel_does_not_take_are_named(head_dim, block_size, dtype, words):
    reason = kernel.unavailable_reason(torch.zeros(1, 2, 128, head_dim, dtype=dtype), block_size)
    assert reason is not None and words in reason


@pytest.mark.parametrize("mode", ["fwd", "fwd_bwd"])
def test_strided_inputs_give_what_contiguous_ones_give(mode):
    # q, k, v as views of a (B, N, H, D) layout (B=1: the grouped views stay strided): the gather steps read
    # them through their strides instead of copying all of them per step; the kernel copies once per call
    pattern = make_pattern("block_random", 320, density=0.3, seed=0, block_size=64)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 320, 4, 64, generator=gen).transpose(1, 2) for _ in range(3))
    assert not q.is_contiguous()
    impl = registry.get("blocked")
    results = []
    for inputs in ((q, k, v), tuple(t.contiguous() for t in (q, k, v))):
        leaves = [t.detach().requires_grad_(mode == "fwd_bwd") for t in inputs]
        out = impl.prepare(case_for(leaves[0], pattern, mode, leaves[1]), pattern, *leaves)()
        grads = torch.autograd.grad(out, leaves, torch.ones_like(out)) if mode == "fwd_bwd" else ()
        results.append((out.detach(), *grads))
    for strided, contiguous in zip(*results, strict=True):
        torch.testing.assert_close(strided, contiguous, rtol=0, atol=0)


def test_bfloat16_runs_the_kernel_on_widened_operands_where_the_cpu_has_no_fast_bfloat16_products(monkeypatch):
    built = kernel.kernel_module()
    if built is None:
        pytest.skip(f"the kernel is not built here: {kernel.unavailable_reason(torch.zeros(1, 1, 16, 16), 16)}")

    class WithoutAmx:  # the built module as it answers on a CPU whose oneDNN has no bfloat16 packer
        def __getattr__(self, name):
            return getattr(built, name)

        def library_packs(self, dtype):
            return False

    monkeypatch.setattr(kernel, "_module", WithoutAmx())
    monkeypatch.setattr(kernel, "has_bf16_dot_products", lambda: False)
    pattern = make_pattern("block_random", 320, density=0.3, seed=0, block_size=64)
    q, k, v = _inputs(pattern, 2, 2, 64, torch.bfloat16)
    assert kernel.unavailable_reason(q, 64) is None and kernel.widened(torch.bfloat16)
    assert not kernel.widened(torch.float32)
    out, extras = _inference(pattern, q, k, v)
    assert extras["path"] == "kernel" and extras["products"] == "onednn_brgemm_widened", extras
    assert "fallback" not in extras and out.dtype == torch.bfloat16
    stats = compare(out, reference_attention(q.double(), k.double(), v.double(), pattern), tolerance_for("bfloat16"))
    assert stats.passed
    # float32 products on the widened bfloat16 values: what the float32 kernel gives on the same values, to the
    # output's rounding (bfloat16 keeps 8 bits)
    table = kernel.block_table(pattern, 64)
    grouped = q[0].reshape(2, 1, pattern.q_len, 64)
    widened = kernel.kernel_attention(table, grouped, k[0], v[0], 64**-0.5)
    in_float32 = kernel.kernel_attention(table, grouped.float(), k[0].float(), v[0].float(), 64**-0.5)
    torch.testing.assert_close(widened.float(), in_float32, rtol=2**-7, atol=1e-3)


def test_the_kernels_own_vnni_pairs_are_the_layout_onednn_packs():
    # On CPUs without AMX the kernel writes the bfloat16 pairs itself (the oracle tests above check that path
    # there); where oneDNN has a packer, the same call with the kernel's own pairs must give the same output.
    q = torch.zeros(1, 2, 64, 64, dtype=torch.bfloat16)
    reason = kernel.unavailable_reason(q, 64)
    if reason is not None:
        pytest.skip(f"the kernel does not take bfloat16 here: {reason}")
    if not kernel.kernel_module().library_packs(torch.bfloat16):
        pytest.skip("oneDNN has no bfloat16 packer on this CPU (no AMX): the kernel's own pairs are its only layout")
    pattern = make_pattern("causal_local", 512, window=200, block_size=64)
    q, k, v = _inputs(pattern, 4, 2, 128, torch.bfloat16)
    table = kernel.block_table(pattern, 64)
    grouped = q[0].reshape(2, 2, pattern.q_len, 128)
    packed_by_onednn = kernel.kernel_attention(table, grouped, k[0], v[0], 128**-0.5)
    packed_here = kernel.kernel_attention(table, grouped, k[0], v[0], 128**-0.5, own_pairs=True)
    assert torch.equal(packed_by_onednn, packed_here)


def _dot_tiles_or_skip(dtype: torch.dtype, block_size: int = 64, head_dim: int = 64) -> None:
    if kernel.unavailable_reason(torch.zeros(1, 1, 16, head_dim, dtype=dtype), block_size) is not None:
        pytest.skip(f"the kernel does not take {dtype} here")
    if kernel.kernel_products(dtype, block_size, head_dim, False) != "dot_tiles":
        pytest.skip("the dot tiles run on AVX512 (bfloat16: with AVX512-BF16, without AMX); oneDNN's GEMMs run here")


def _both_products(q, k, v, kv_index, kv_count, mask_slot, masks, bs, heads_per_kv=1, row_bits=None, tile_rows=0):
    """block_attention's (out, lse) through the dot tiles and through oneDNN's GEMMs, on the same operands."""
    module = kernel.kernel_module()
    bits = row_bits if row_bits is not None else torch.empty(0, dtype=torch.int64)
    return [module.block_attention(q, k, v, kv_index, kv_count, mask_slot, masks, q.shape[-1] ** -0.5, bs, False,
                                   heads_per_kv, bits, tile_rows, 0.0, torch.empty(0), 0, dot)
            for dot in (True, False)]


def _close(dot, gemm, dtype):
    (out, lse), (out_gemm, lse_gemm) = dot, gemm
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.float(), out_gemm.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(lse, lse_gemm, rtol=1e-3 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)


PREFILL_CASES = [c for c in CASES if make_pattern(c[0], c[1], **c[2]).q_len > DECODE_ROWS]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name, n, fields, heads, kv_heads, head_dim", PREFILL_CASES,
                         ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(PREFILL_CASES)])
def test_the_dot_tiles_give_what_onednns_gemms_give(name, n, fields, heads, kv_heads, head_dim, dtype):
    # Each register tile computes only the 16-key vectors one of its rows may see: a vector skipped that a row
    # needed, a row's mask applied to another's, or a ragged block read past N would move these outputs.
    _dot_tiles_or_skip(DTYPES[dtype], fields["block_size"], head_dim)
    pattern = make_pattern(name, n, **fields)
    q, k, v = _inputs(pattern, heads, kv_heads, head_dim, DTYPES[dtype])
    table = kernel.block_table(pattern, fields["block_size"])
    grouped = q[0].reshape(kv_heads, heads // kv_heads, pattern.q_len, head_dim)
    dot, gemm = _both_products(grouped, k[0], v[0], table.kv_index[None], table.kv_count[None],
                               table.mask_slot[None], table.masks, fields["block_size"])
    _close(dot, gemm, DTYPES[dtype])
    extras = _inference(pattern, q, k, v)[1]
    assert extras["products"] == "dot_tiles" and extras["path"] == "kernel"


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("tile_rows, heads_per_kv", [(16, 1), (8, 2), (64, 1)])
def test_the_dot_tiles_keep_each_rows_own_selection(tile_rows, heads_per_kv, dtype):
    # A selection per query row (row_bits): rows of one tile keep different blocks, rows that keep none of a
    # chunk's blocks, tiles smaller than the block, the query heads of a KV head in one task.
    _dot_tiles_or_skip(DTYPES[dtype])
    bs, n, kv_heads, d = 64, 448, 2, 64
    heads = kv_heads * heads_per_kv
    pattern = make_pattern("causal", n, block_size=bs)
    table = kernel.block_table(pattern, bs)
    tiles = n // tile_rows
    base = torch.arange(tiles) * tile_rows // bs  # each tile's base query block
    gen = torch.Generator().manual_seed(5)
    kv_index = table.kv_index[base].expand(heads, -1, -1).contiguous()
    mask_slot = table.mask_slot[base].expand(heads, -1, -1).contiguous()
    kv_count = table.kv_count[base].expand(heads, -1).contiguous()
    row_bits = torch.randint(0, 2**62, kv_index.shape, generator=gen, dtype=torch.int64)
    row_bits[:, :, 0] = 0  # no row keeps the first block
    q = torch.randn(heads, 1, n, d, generator=gen).to(DTYPES[dtype])
    k, v = (torch.randn(kv_heads, n, d, generator=gen).to(DTYPES[dtype]) for _ in range(2))
    dot, gemm = _both_products(q, k, v, kv_index, kv_count, mask_slot, table.masks, bs, heads_per_kv, row_bits,
                               tile_rows)
    _close(dot, gemm, DTYPES[dtype])
    lse = dot[1]
    assert torch.isinf(lse).any() and torch.isfinite(lse).any()  # rows with and without a kept key


@pytest.mark.parametrize("tile_rows", [8, 6])  # bfloat16's register tiles, float32's
@pytest.mark.parametrize("name, n, fields, group", [
    ("local", 4096, dict(window=256), 1),
    ("causal_local", 1000, dict(window=300), 4),  # a last query block of 40 rows: a register tile spans two heads
    ("dilated", 384, dict(window=96, dilation=3), 2),
])
def test_the_dot_tiles_computed_pairs_count_what_each_register_tile_computes(name, n, fields, group, tile_rows):
    pattern = make_pattern(name, n, block_size=64, **fields)
    table = kernel.block_table(pattern, 64)
    allowed = pattern.dense_mask()
    expected = 0  # each task's rows, a register tile at a time: per listed block, the 16-key vectors one may see
    for qb in range(table.kv_index.shape[0]):
        rows = min(64, n - qb * 64)
        task = [qb * 64 + i % rows for i in range(group * rows)]
        for r0 in range(0, len(task), tile_rows):
            tile = task[r0:r0 + tile_rows]
            for j in table.kv_index[qb, :table.kv_count[qb]].tolist():
                seen = allowed[tile, j * 64:(j + 1) * 64].any(0)
                if table.mask_slot[qb, table.kv_index[qb].tolist().index(j)] < 0:
                    seen[:] = True  # a full block: every key to N
                padded = torch.zeros(64, dtype=torch.bool)
                padded[:len(seen)] = seen
                vectors = padded.reshape(4, 16).any(-1).nonzero().flatten()
                if vectors.numel():
                    expected += (int(vectors.max()) + 1 - int(vectors.min())) * 16 * len(tile)
    assert table.dot_tile_pairs(n, n, group, tile_rows) * group == expected
    assert pattern.nnz <= table.dot_tile_pairs(n, n, group, tile_rows) <= table.computed_pairs
    if kernel.kernel_module() is not None:  # the counts above take the tile sizes the kernel runs
        assert {kernel.dot_tile_rows(torch.bfloat16), kernel.dot_tile_rows(torch.float32)} == {8, 6}
