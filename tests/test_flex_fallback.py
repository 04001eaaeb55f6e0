"""flex falls back to the tabulated mask_mod wherever compiling the predicate fails, whichever way the failure
comes (wrapped by Dynamo as InductorError, or a raw CppCompileError when the compiled module is loaded, as an
attention-gym mask_mod gave on an AMD CPU), and says so in the record's config; the tabulated mask_mod is the
pattern's matrix, for q_len < seq_len and a seq_len that is not a multiple of the block."""

from __future__ import annotations

import pytest
import torch

import impls.flex as flex_module
from bench.patterns import make_pattern, register_mask_mod
from bench.spec.case import Case


def agym_dilated(window: int, dilation: int):
    """attention-gym's generate_dilated_sliding_window(W, d), written out (the package may be absent)."""
    def mask_mod(b, h, q_idx, kv_idx):
        diff = torch.abs(q_idx - kv_idx)
        return (diff <= window) & (diff % dilation == 0)

    return mask_mod


register_mask_mod("test_agym_dilated", lambda p: agym_dilated(p.window, p.dilation), fields=("window", "dilation"))


def raising(kind: str):
    from torch._inductor.exc import CppCompileError, InductorError

    calls = []

    def compiled(q, k, v, block_mask, scale, enable_gqa):
        calls.append(block_mask)
        if len(calls) == 1:
            if kind == "cpp":
                raise CppCompileError(["g++", "flex.cpp"], "error: 'tmp3' was not declared in this scope")
            raise InductorError(RuntimeError("undeclared tmp3"), None)
        return torch.zeros_like(q)

    return compiled, calls


@pytest.mark.parametrize("kind", ["cpp", "inductor"])
def test_a_predicate_that_does_not_compile_falls_back_to_the_table(monkeypatch, kind):
    compiled, calls = raising(kind)
    monkeypatch.setattr(flex_module, "compiled_flex", lambda: compiled)
    case = Case(pattern="test_agym_dilated", window=33, dilation=2, seq_len=200, q_len=77, block_size=64,
                heads=2, head_dim=16, device="cpu")
    pattern = case.make_pattern()
    q = torch.randn(1, 2, 77, 16)
    k = v = torch.randn(1, 2, 200, 16)
    impl = flex_module.Flex()
    call = impl.prepare(case, pattern, q, k, v)
    assert call().shape == q.shape and len(calls) == 2
    assert impl._extras["mask_mod"].startswith("tabulated (the predicate did not compile: ")
    assert call().shape == q.shape and len(calls) == 3  # compiled once: no second fallback


def test_the_tabulated_mask_mod_is_the_patterns_matrix():
    pattern = make_pattern("test_agym_dilated", 200, q_len=77, window=33, dilation=2)
    mask_mod = flex_module.tabulated_mask_mod(pattern, 64, torch.device("cpu"))
    rows, cols = torch.arange(77)[:, None], torch.arange(200)[None, :]
    zero = torch.zeros((), dtype=torch.int64)
    assert torch.equal(mask_mod(zero, zero, rows, cols), pattern.dense_mask())
