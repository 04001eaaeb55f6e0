"""`flex`'s inputs to FlexAttention, checked without compiling: the predicate with tensor fields is the
pattern's own, and the BlockMask lists exactly the pattern's partial and full key blocks."""

from __future__ import annotations

import math

import pytest
import torch

from impls.flex import block_mask_for, tensor_fields
from tests.pattern_zoo import BUILTIN, zoo_pattern


def _pattern(name: str, n: int = 150, block_size: int = 16):
    window = 15 if name == "axial" else 24  # axial: N = R*C, 150 = 10 x 15
    return zoo_pattern(name, n, window=window, block_size=block_size, global_tokens=5, seed=7)


@pytest.mark.parametrize("name", BUILTIN)
def test_tensor_fields_give_the_same_predicate(name):
    pattern = _pattern(name)
    params = tensor_fields(pattern, torch.device("cpu"))
    for field in pattern.fields:
        assert isinstance(getattr(params, "p" if field == "density" else field), torch.Tensor)
    i = torch.arange(pattern.seq_len)[:, None]
    j = torch.arange(pattern.seq_len)[None, :]
    assert torch.equal(params.allowed(i, j), pattern.dense_mask())


@pytest.mark.parametrize("name", BUILTIN)
def test_block_mask_holds_the_pattern_blocks(name):
    pattern = _pattern(name)
    bs = pattern.block_size
    mask = block_mask_for(pattern, bs, torch.device("cpu"))
    nb = math.ceil(pattern.seq_len / bs)
    dense = torch.zeros(nb * bs, nb * bs, dtype=torch.bool)
    dense[: pattern.seq_len, : pattern.seq_len] = pattern.dense_mask()
    blocks = dense.view(nb, bs, nb, bs).permute(0, 2, 1, 3)  # (query block, key block, bs, bs)
    in_range = torch.zeros_like(dense)
    in_range[: pattern.seq_len, : pattern.seq_len] = True
    in_range_blocks = in_range.view(nb, bs, nb, bs).permute(0, 2, 1, 3)
    any_allowed = blocks.flatten(2).any(-1)
    full = (blocks | ~in_range_blocks).flatten(2).all(-1) & any_allowed
    for r in range(nb):
        partial_got = set(mask.kv_indices[0, 0, r, : mask.kv_num_blocks[0, 0, r]].tolist())
        full_got = set(mask.full_kv_indices[0, 0, r, : mask.full_kv_num_blocks[0, 0, r]].tolist())
        assert full_got == set(torch.nonzero(full[r]).flatten().tolist()), r
        assert partial_got == set(torch.nonzero(any_allowed[r] & ~full[r]).flatten().tolist()), r
    assert mask.seq_lengths == (pattern.seq_len, pattern.seq_len)


def test_blocks_under_128_set_the_forward_tiles_on_a_gpu_only():
    """Inductor's one default forward tile on Hopper is 128 query rows, which must divide the BlockMask's block:
    a 64-token block passes its own size as the tiles (else FlexAttention falls back to uncompiled)."""
    from impls.flex import kernel_options

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert kernel_options(64, cuda, 4096) == {"BLOCK_M": 64, "BLOCK_N": 64}
    assert kernel_options(128, cuda, 4096) is None  # the default tiles divide it
    assert kernel_options(64, cpu, 4096) is None  # Inductor's CPU template tiles on its own
    assert kernel_options(64, cuda, 1) is None  # decode: FlexAttention's decoding kernel
