"""Patterns: every view agrees exactly with the others and with the table's formula (docs/DESIGN.md)."""

from __future__ import annotations

import math
import re

import pytest
import torch

from bench.patterns import PATTERNS, make_pattern

N_VALUES = [1, 37, 97, 130]
FIELDS = dict(window=12, density=0.3, block_size=16, dilation=3, global_tokens=2, seed=5, prefix=9)


def table_formula(name: str, n: int, f: dict) -> torch.Tensor:
    """The table of docs/DESIGN.md written out pair by pair (deterministic patterns)."""
    w, d, g = f["window"], f["dilation"], f["global_tokens"]
    rule = {
        "dense": lambda i, j: True,
        "causal": lambda i, j: j <= i,
        "local": lambda i, j: abs(i - j) <= w // 2,
        "causal_local": lambda i, j: 0 <= i - j < w,
        "dilated": lambda i, j: abs(i - j) <= w // 2 and (i - j) % d == 0,
        "strided": lambda i, j: i // w == j // w or j % w == w - 1,
        "longformer": lambda i, j: abs(i - j) <= w // 2 or i < g or j < g,
        "axial": lambda i, j: i // w == j // w or i % w == j % w,
        "prefix_lm": lambda i, j: j < f["prefix"] or j <= i,
        "sink": lambda i, j: 0 <= i - j < w or (j < g and j <= i),
        "neighborhood": lambda i, j: natten_pair(i, j, n, f["image_width"], w),
    }[name]
    return torch.tensor([[bool(rule(i, j)) for j in range(n)] for i in range(n)], dtype=torch.bool).reshape(n, n)


def natten_pair(i: int, j: int, n: int, c: int, k: int) -> bool:
    """NATTEN written out: the k x k window around the query, shifted inwards at the image's borders."""
    rows, h = n // c, k // 2
    ri, ci, rj, cj = i // c, i % c, j // c, j % c
    ri, ci = min(max(ri, h), rows - 1 - h), min(max(ci, h), c - 1 - h)
    return abs(ri - rj) <= h and abs(ci - cj) <= h


def fields_for(name: str, n: int) -> dict:
    f = dict(FIELDS, prefix=min(FIELDS["prefix"], n))
    if name in ("axial", "neighborhood"):
        width = next(c for c in range(max(1, math.isqrt(n)), n + 1) if n % c == 0)
        f["window"] = width
        if name == "neighborhood":
            f["image_width"] = width
            f["window"] = max(k for k in (1, 3, 5) if k <= min(width, n // width))
    return f


def csr_to_dense(crow: torch.Tensor, col: torch.Tensor, n: int) -> torch.Tensor:
    mask = torch.zeros(n, n, dtype=torch.bool)
    rows = torch.repeat_interleave(torch.arange(n), crow.diff())
    mask[rows, col] = True
    return mask


def layout_from_mask(mask: torch.Tensor, bs: int) -> torch.Tensor:
    n = mask.shape[0]
    nb = -(-n // bs)
    padded = torch.zeros(nb * bs, nb * bs, dtype=torch.bool)
    padded[:n, :n] = mask
    return padded.reshape(nb, bs, nb, bs).any(dim=3).any(dim=1)


DETERMINISTIC = ["dense", "causal", "local", "causal_local", "dilated", "strided", "longformer", "axial", "prefix_lm",
                 "sink", "neighborhood"]


BUILTIN = sorted(name for name, cls in PATTERNS.items() if cls.source == "built-in")


def test_table_covers_every_pattern():
    assert set(BUILTIN) == set(DETERMINISTIC) | {"block_random", "bigbird", "random"}


@pytest.mark.parametrize("n", N_VALUES)
@pytest.mark.parametrize("name", DETERMINISTIC)
def test_views_match_table_formula(name, n):
    f = fields_for(name, n)
    pattern = make_pattern(name, n, **f)
    expected = table_formula(name, n, f)
    assert torch.equal(pattern.dense_mask(), expected)
    crow, col = pattern.csr()
    assert crow.dtype == torch.int64 and col.dtype == torch.int64
    assert torch.equal(csr_to_dense(crow, col, n), expected)
    assert pattern.nnz == int(expected.sum())
    assert pattern.density == int(expected.sum()) / n**2


@pytest.mark.parametrize("n", N_VALUES)
@pytest.mark.parametrize("name", BUILTIN)
def test_views_agree_with_each_other(name, n):
    pattern = make_pattern(name, n, **fields_for(name, n))
    mask = pattern.dense_mask()
    i = torch.arange(n)
    assert torch.equal(mask, pattern.allowed(i[:, None], i[None, :]))
    scanned = make_pattern(name, n, **fields_for(name, n))  # nnz and used keys from their own scan, no csr
    assert scanned.nnz == int(mask.sum()) and torch.equal(scanned.used_keys(), mask.any(dim=0))
    crow, col = pattern.csr()
    assert torch.equal(csr_to_dense(crow, col, n), mask)
    for r in range(n):  # columns sorted within each row
        row = col[crow[r] : crow[r + 1]]
        assert torch.all(row[1:] > row[:-1])
    for bs in (1, 7, 16, 64):
        layout = pattern.block_layout(bs)
        assert torch.equal(layout, layout_from_mask(mask, bs))
        assert pattern.block_density(bs) == float(layout.sum()) / layout.numel()


@pytest.mark.parametrize("name", BUILTIN)
def test_block_sparse_view_rebuilds_the_mask(name):
    n, bs = 97, 16
    pattern = make_pattern(name, n, **fields_for(name, n))
    view = pattern.block_sparse(bs)
    mask = pattern.dense_mask()
    rebuilt = torch.zeros(view.num_blocks * bs, view.num_blocks * bs, dtype=torch.bool)
    for r in range(view.num_blocks):
        count = int(view.kv_counts[r])
        assert torch.all(view.kv_indices[r, count:] == -1)
        cols = view.kv_indices[r, :count]
        assert torch.all(cols[1:] > cols[:-1])
        for t in range(count):
            c = int(cols[t])
            full = bool(view.full[r, t])
            block = torch.ones(bs, bs, dtype=torch.bool) if full else view.masks[int(view.mask_index[r, t])]
            rebuilt[r * bs : (r + 1) * bs, c * bs : (c + 1) * bs] = block
    assert torch.equal(rebuilt[:n, :n], mask)
    layout = pattern.block_layout(bs)
    assert torch.equal(view.kv_counts, layout.sum(1).to(torch.int32))


@pytest.mark.parametrize("name", ["random", "block_random", "bigbird"])
def test_random_patterns_depend_only_on_their_seed(name):
    n = 256
    f = dict(FIELDS, global_tokens=0, window=1)
    a = make_pattern(name, n, **f).dense_mask()
    b = make_pattern(name, n, **f).dense_mask()
    c = make_pattern(name, n, **dict(f, seed=6)).dense_mask()
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert bool(a.diagonal().all())  # the diagonal (or diagonal blocks) is always kept


def test_random_density_is_near_p():
    n, p = 512, 0.2
    pattern = make_pattern("random", n, density=p, seed=1)
    expected = p + (1 - p) / n  # the diagonal is always kept
    sigma = math.sqrt(p * (1 - p) / (n * n))
    assert abs(pattern.density - expected) < 6 * sigma


def test_block_random_keeps_whole_blocks_with_probability_p():
    n, bs, p = 64 * 40, 64, 0.25
    pattern = make_pattern("block_random", n, density=p, block_size=bs, seed=3)
    layout = pattern.block_layout(bs)
    off_diag = layout[~torch.eye(40, dtype=torch.bool)].float().mean().item()
    assert abs(off_diag - p) < 0.05
    mask = pattern.dense_mask().reshape(40, bs, 40, bs)
    per_block = mask.sum(dim=(1, 3))
    assert set(per_block.unique().tolist()) <= {0, bs * bs}  # kept blocks are whole


def test_large_banded_pattern_views_are_cheap():
    # The views scan only candidate blocks; a dense scan of 65536^2 would not finish in a test.
    pattern = make_pattern("local", 65536, window=256)
    layout = pattern.block_layout(128)
    assert layout.shape == (512, 512)
    assert int(layout.sum()) == 512 * 3 - 2
    assert pattern.nnz == sum(min(65535, i + 128) - max(0, i - 128) + 1 for i in range(65536))


@pytest.mark.parametrize("bad, message", [
    # other tests in the same worker may register more patterns; the built-ins are listed in order among them
    (dict(name="nope"), r"unknown pattern 'nope'; known patterns: .*axial, bigbird, block_random, causal"),
    (dict(name="local", window=0), "window: got 0; must be >= 1"),
    (dict(name="random"), "density: not set; pattern random needs a density"),
    (dict(name="axial", window=10), "axial needs seq_len = R*C"),
])
def test_bad_fields_are_named(bad, message):
    name = bad.pop("name")
    with pytest.raises(ValueError, match=message if name == "nope" else re.escape(message)):
        make_pattern(name, 97, **bad)


def test_labels_carry_parameters():
    assert make_pattern("local", 64, window=64).label == "local_w64"
    assert make_pattern("block_random", 64, density=0.1, block_size=64).label == "block_random_p0.1_b64_s0"


# --- query rows (q_len) and packed documents ----------------------------------------------------------------

def structured_formula(name: str, n: int, f: dict, q_len: int, lengths: list[int] | None) -> torch.Tensor:
    """Bool (q_len, n) from the table: rows are the last q_len positions; inside documents the formula of a
    sequence of the document's length applies on positions relative to its start, and no pair crosses."""
    spans = [(0, n)] if lengths is None else [(sum(lengths[:d]), sum(lengths[: d + 1])) for d in range(len(lengths))]
    out = torch.zeros(q_len, n, dtype=torch.bool)
    for a, b in spans:
        inner = table_formula(name, b - a, f)
        for r in range(q_len):
            i = r + n - q_len
            if a <= i < b:
                out[r, a:b] = inner[i - a]
    return out


STRUCTURES = [  # (n, q_len, documents)
    (97, 1, None), (97, 40, None), (130, 130, [1, 40, 89]), (130, 37, [60, 70]), (96, 96, [24, 36, 36]),
]
# Axial and neighborhood need whole image rows in every document (rows of 4 tokens here: fields_for(name, 12)).
GRID_STRUCTURES = [(96, 1, None), (96, 40, None), (96, 96, [24, 36, 36]), (96, 37, [48, 48]), (144, 144, [36, 108])]
STRUCTURED = [(name, *s) for name in DETERMINISTIC
              for s in (GRID_STRUCTURES if name in ("axial", "neighborhood") else STRUCTURES)]


@pytest.mark.parametrize("name, n, q_len, documents", STRUCTURED)
def test_query_rows_and_documents_follow_the_table(name, n, q_len, documents):
    f = fields_for(name, 12 if name in ("axial", "neighborhood") else n)
    pattern = make_pattern(name, n, q_len=q_len, documents=documents, **f)
    expected = structured_formula(name, n, f, q_len, documents)
    assert torch.equal(pattern.dense_mask(), expected)
    crow, col = pattern.csr()
    assert crow.shape == (q_len + 1,)
    rows = torch.repeat_interleave(torch.arange(q_len), crow.diff())
    rebuilt = torch.zeros(q_len, n, dtype=torch.bool)
    rebuilt[rows, col] = True
    assert torch.equal(rebuilt, expected)
    assert pattern.nnz == int(expected.sum())
    assert pattern.density == int(expected.sum()) / (q_len * n)
    for bs in (1, 7, 16):
        nqb, nkb = -(-q_len // bs), -(-n // bs)
        padded = torch.zeros(nqb * bs, nkb * bs, dtype=torch.bool)
        padded[:q_len, :n] = expected
        assert torch.equal(pattern.block_layout(bs), padded.reshape(nqb, bs, nkb, bs).any(dim=3).any(dim=1))


@pytest.mark.parametrize("n, q_len, documents", STRUCTURES)
@pytest.mark.parametrize("name", ["block_random", "bigbird", "random", "longformer", "sink", "prefix_lm"])
def test_block_sparse_view_of_rectangles_and_documents(name, n, q_len, documents):
    pattern = make_pattern(name, n, q_len=q_len, documents=documents, **FIELDS)
    mask, bs = pattern.dense_mask(), 16
    view = pattern.block_sparse(bs)
    nqb, nkb = -(-q_len // bs), -(-n // bs)
    assert view.num_blocks == nqb and view.rows == q_len
    rebuilt = torch.zeros(nqb * bs, nkb * bs, dtype=torch.bool)
    for r in range(nqb):
        for t in range(int(view.kv_counts[r])):
            c = int(view.kv_indices[r, t])
            block = torch.ones(bs, bs, dtype=torch.bool) if view.full[r, t] else view.masks[int(view.mask_index[r, t])]
            rebuilt[r * bs : (r + 1) * bs, c * bs : (c + 1) * bs] = block
    assert torch.equal(rebuilt[:q_len, :n], mask)


def test_documents_from_a_count_are_seeded_and_sum_to_the_sequence():
    a = make_pattern("causal", 8192, documents=64, seed=3)
    b = make_pattern("causal", 8192, documents=64, seed=3)
    c = make_pattern("causal", 8192, documents=64, seed=4)
    assert a.documents == b.documents != c.documents
    assert len(a.documents) == 64 and sum(a.documents) == 8192 and min(a.documents) >= 1
    assert a.label == "causal_docs64"


def test_documents_never_build_a_full_mask_for_views():
    # 64 documents in 65536 tokens: the block views scan only blocks inside documents.
    pattern = make_pattern("causal", 65536, documents=[1024] * 64)
    layout = pattern.block_layout(128)
    assert int(layout.sum()) == 64 * (8 * 9 // 2)
    assert pattern.nnz == 64 * 1024 * 1025 // 2


@pytest.mark.parametrize("name, fields, message", [
    ("causal", dict(q_len=98), "q_len: got 98; allowed: 1 to seq_len (97)"),
    ("causal", dict(documents=[50, 40]), "documents: lengths [50, 40] sum to 90; they must sum to seq_len (97)"),
    ("causal", dict(documents=[97, 0]), "documents: document 1 has length 0"),
    ("causal", dict(documents=98), "documents: got a count of 98; allowed: 1 to seq_len (97)"),
    ("neighborhood", dict(window=5), "image_width: not set; neighborhood needs image_width"),
    ("neighborhood", dict(window=4, image_width=10), "window: got 4; the neighbourhood kernel size must be odd"),
    ("neighborhood", dict(window=5, image_width=7), "neighborhood needs seq_len = R * image_width"),
    ("neighborhood", dict(window=13, image_width=10), "window: got 13; the kernel may not be larger than the image "
                                                      "(10 rows x 10 columns)"),
    ("neighborhood", dict(window=5, image_width=10, documents=[30, 70]), "documents: a document of length 30: "
                                                                         "got 5; the kernel may not be larger"),
    ("prefix_lm", dict(prefix=101), "prefix: got 101; allowed: 0 to seq_len"),
])
def test_bad_structure_is_named(name, fields, message):
    n = 100 if name == "neighborhood" or "prefix" in fields else 97
    with pytest.raises(ValueError, match=re.escape(message)):
        make_pattern(name, n, **fields)


# --- peers as oracles: attention-gym's mask_mods (an optional extra) ------------------------------------------

def _mask_of_mod(mask_mod, q_len: int, n: int) -> torch.Tensor:
    q = torch.arange(q_len)[:, None]
    kv = torch.arange(n)[None, :]
    zero = torch.zeros((), dtype=torch.int64)
    return mask_mod(zero, zero, q, kv).expand(q_len, n)


def test_attention_gym_masks_agree_with_our_patterns():
    masks = pytest.importorskip("attn_gym.masks", reason="attention-gym is an optional extra (pip install attn-gym)")
    n = 144
    ours = {
        "causal": make_pattern("causal", n).dense_mask(),
        "sliding_window": make_pattern("causal_local", n, window=17).dense_mask(),  # q - kv <= 16, causal
        "prefix_lm": make_pattern("prefix_lm", n, prefix=20).dense_mask(),
        "natten_square": make_pattern("neighborhood", n, window=5, image_width=12).dense_mask(),
    }
    theirs = {
        "causal": _mask_of_mod(masks.causal_mask, n, n),
        "sliding_window": _mask_of_mod(masks.generate_sliding_window(16), n, n),
        "prefix_lm": _mask_of_mod(masks.generate_prefix_lm_mask(20), n, n),
        "natten_square": _mask_of_mod(masks.generate_natten(12, 12, 5, 5), n, n),
    }
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    lengths = [10, 50, 84]
    offsets = torch.tensor([0, 10, 60, 144])
    doc_causal = masks.generate_doc_mask_mod(masks.causal_mask, offsets)
    assert torch.equal(make_pattern("causal", n, documents=lengths).dense_mask(), _mask_of_mod(doc_causal, n, n))


def test_attention_gym_natten_differs_on_non_square_images():
    """attention-gym's generate_natten clamps the row index (idx // canvas_w) with the canvas *width* and the
    column (idx % canvas_w) with the *height*, so on a non-square image its windows sit at the wrong place:
    on a 12-wide, 6-high image column centres are clamped to 2..3 instead of 2..9. Ours follow NATTEN."""
    masks = pytest.importorskip("attn_gym.masks", reason="attention-gym is an optional extra (pip install attn-gym)")
    width, height, k = 12, 6, 5
    n = width * height
    ours = make_pattern("neighborhood", n, window=k, image_width=width).dense_mask()
    theirs = _mask_of_mod(masks.generate_natten(width, height, k, k), n, n)
    assert bool((ours.sum(1) == k * k).all())  # NATTEN: every query sees exactly k*k keys
    differ = torch.nonzero(ours != theirs)
    assert len(differ) > 0, "attention-gym's natten now agrees on non-square images: drop this test"
    # query 4 (row 0, column 4): NATTEN's window is columns 2..6; attention-gym's is columns 1..5
    assert torch.nonzero(ours[4]).flatten()[:5].tolist() == [2, 3, 4, 5, 6]
    assert torch.nonzero(theirs[4]).flatten()[:5].tolist() == [1, 2, 3, 4, 5]
    assert len(differ) == 1800  # the pairs that differ on this image
