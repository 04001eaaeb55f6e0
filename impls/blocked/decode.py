"""The decode path of `blocked` (decode.cpp): q_len <= DECODE_ROWS query rows over a KV cache read in place.

What the kernel reads is a list of key blocks per (sequence, KV head), each full or partial, and for partial
blocks a boolean mask of the rows' allowed keys: for a static pattern one list and one (q_len, N) mask for every
head (`pattern_plan`), for a selection one list and mask per (sequence, KV head) built in the call
(`selection_plan`), and for sequences of their own lengths (a paged cache's `kv_lens`) one per sequence. Blocks
are the case's block_size in a contiguous cache, pages in a paged one.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from impls.blocked.kernel import KERNEL_DTYPES, build_extension, build_failure, has_bf16_dot_products

DECODE_ROWS = 16  # q_len the decode path takes (a few queries: decode, speculative decoding)
HEAD_DIM_MULTIPLE = 32  # the loops read two float vectors of the head dimension at a time (2 x 16 on AVX512)
_SOURCE = Path(__file__).with_name("decode.cpp")
_lock = threading.Lock()
_module: Any = None
_unavailable: str | None = None


def decode_module() -> Any:
    """The compiled decode kernel, or None (`decode_unavailable` says why)."""
    global _module, _unavailable
    with _lock:
        if _module is None and _unavailable is None:
            try:
                _module = build_extension(_SOURCE, "blocked_decode_kernel")
            except Exception as exc:  # no compiler, no ninja, a build error: the other paths remain
                _unavailable = build_failure("the decode kernel", "blocked_decode_kernel", exc)
    return _module


def decode_unavailable(q: Tensor, mode: str) -> str | None:
    """Why q (B, H, q_len, D) cannot take the decode path; None when it can."""
    if mode != "fwd":
        return "mode fwd_bwd: the decode path is inference only"
    if q.device.type != "cpu" or q.dtype not in KERNEL_DTYPES:
        return f"{q.dtype} on {q.device.type} (the decode kernel takes float32 and bfloat16 on CPU)"
    if q.shape[2] > DECODE_ROWS:
        return f"q_len {q.shape[2]} > {DECODE_ROWS}"
    if q.shape[-1] % HEAD_DIM_MULTIPLE:
        return f"head_dim {q.shape[-1]} is not a multiple of {HEAD_DIM_MULTIPLE} (two vectors of the loop)"
    if decode_module() is None:
        return _unavailable
    return None


@dataclass(frozen=True)
class DecodePlan:
    """What the decode kernel reads: blocks int32 (B * Hkv, max_blocks) and their counts, full bool (same shape), or
    blocks and full of one row that every list shares (a page table's entries in order); mask bool (T, M, N) of the
    rows' allowed keys (T in {1, B, B * Hkv}; M = q_len, or G * q_len rows)."""

    blocks: Tensor
    counts: Tensor
    full: Tensor
    mask: Tensor
    block: int

    @property
    def listed_keys(self) -> int:
        return int(self.counts.sum()) * self.block


def _lists(allowed: Tensor, block: int, n: int) -> tuple[Tensor, Tensor, Tensor]:
    """allowed bool (L, M, N) per list -> (blocks (L, max), counts (L,), full (L, max)): the key blocks some row
    allows, and which of them every row allows whole."""
    lists, rows = allowed.shape[:2]
    nkb = math.ceil(n / block)
    padded = torch.nn.functional.pad(allowed, (0, nkb * block - n)).view(lists, rows, nkb, block)
    keys_in = torch.nn.functional.pad(torch.ones(n, dtype=torch.bool), (0, nkb * block - n)).view(nkb, block)
    anyone = padded.any(dim=(1, 3))  # (L, nkb)
    whole = (padded | ~keys_in).all(dim=(1, 3))  # every row, every real key of the block
    counts = anyone.sum(dim=-1)
    width = max(int(counts.max()) if counts.numel() else 0, 1)
    order = torch.argsort((~anyone).to(torch.int8), dim=-1, stable=True)[:, :width]
    kept = torch.arange(width) < counts[:, None]
    blocks = torch.where(kept, order, 0).to(torch.int32)
    full = torch.gather(whole, -1, order) & kept
    return blocks.contiguous(), counts.to(torch.int32).contiguous(), full.contiguous()


def pattern_plan(mask: Tensor, lists: int, block: int) -> DecodePlan:
    """A static pattern: its (q_len, N) mask, the same list for the `lists` (sequence, KV head) pairs."""
    blocks, counts, full = _lists(mask[None], block, mask.shape[-1])
    expand = lambda t: t.expand(lists, *t.shape[1:]).contiguous()  # noqa: E731
    return DecodePlan(expand(blocks), expand(counts), expand(full), mask[None].contiguous(), block)


def masks_plan(masks: Tensor, block: int) -> DecodePlan:
    """One mask per (sequence, KV head): masks bool (B * Hkv, M, N) (a selection, or sequences of their own
    lengths)."""
    blocks, counts, full = _lists(masks, block, masks.shape[-1])
    return DecodePlan(blocks, counts, full, masks.contiguous(), block)


def splits_for(lists: int, max_blocks: int) -> int:
    """Key-range splits per (sequence, KV head), flash-decoding: enough tasks for every thread twice over."""
    threads = torch.get_num_threads()
    return max(1, min(max_blocks, math.ceil(2 * threads / max(lists, 1))))


def decode_attention(plan: DecodePlan, q: Tensor, k: Tensor, v: Tensor, scale: float,
                     page_table: Tensor | None = None, lens: Tensor | None = None,
                     key_rows: tuple[Tensor, Tensor] | None = None, pages_reread: bool = False
                     ) -> tuple[Tensor, Tensor]:
    """q (B, H, q_len, D); k, v contiguous (B, Hkv, N, D) or a pool of pages (P, Hkv, page, D) with page_table
    (B, max_pages) -> (out (B, H, q_len, D), lse (B, H, q_len) float32). `key_rows` (rows int32 (B * Hkv or B,
    max_keys), base int64 (B * Hkv,)): instead of the plan's blocks, (sequence, KV head) bh reads the plan's
    counts[bh] keys, rows[list][t] of k and v counted from element base[bh], all allowed (a token selection;
    impls/blocked/tokens.py); a list per (sequence, KV head), or per sequence for all its KV heads.
    `pages_reread`: sequences read the same pages one after the other (Quest's page rows), which are then in cache
    with their translations: no load of each group's first byte ahead of its prefetch (decode.cpp, prefetch_group)."""
    module = decode_module()
    assert module is not None, "decode_attention needs the built kernel (see decode_unavailable)"
    b, h, nq, d = q.shape
    hkv = k.shape[1]
    rows = q.reshape(b, hkv, (h // hkv) * nq, d)  # a KV head's G heads' rows: row gi * q_len + t
    if lens is None:
        lens = torch.full((b,), k.shape[2], dtype=torch.int32)
    table = page_table if page_table is not None else torch.empty(0, dtype=torch.int32)
    # a paged task walks one sequence's KV heads together (decode.cpp): the threads share sequences, not heads
    splits = splits_for(b if page_table is not None else b * hkv, plan.blocks.shape[1])
    out, lse = module.decode_attention(rows.contiguous(), k, v, table, plan.blocks, plan.counts, plan.full,
                                       plan.mask, lens.to(torch.int32), plan.block, scale, splits,
                                       _bf16_dot(q.dtype), *(key_rows if key_rows is not None else _NO_ROWS),
                                       not pages_reread)
    return out.view(b, h, nq, d), lse.view(b, h, nq)


_NO_ROWS = (torch.empty(0, dtype=torch.int32), torch.empty(0, dtype=torch.int64))


def _bf16_dot(dtype: torch.dtype) -> bool:
    """Whether bfloat16 products run on AVX512-BF16's dot-product instruction (detected at run time: the CPU
    changes between machines that share a build)."""
    return dtype == torch.bfloat16 and has_bf16_dot_products()


def decode_engine(dtype: torch.dtype) -> str:
    """The products' engine the decode kernel runs for `dtype` here (the record's config.decode_engine):
    avx512_bf16_dot, avx512_fma or portable."""
    module = decode_module()
    return "unbuilt" if module is None else str(module.engine_name(dtype, _bf16_dot(dtype)))
