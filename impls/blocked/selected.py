"""`blocked` over a selection of key blocks: the block tables a selection makes, for the CPU kernel or torch ops.

A selection keeps key blocks per (batch, selection head, query unit). For a query block, the blocks its rows
keep (one set for a block query unit; the union over its rows for a selection per row, with a bit per row
saying which rows kept each block) intersected with the base pattern's block view (full blocks, and partial
ones with their masks) make its table row. Tables are built inside the timed call: a selection changes every
call, and turning it into tables is part of what attending over it costs.

- The kernel (inference in float32 and bfloat16 on CPU): one table per task. With a selection shared by a KV
  group (or by all heads) a task is a KV head with its G query heads as one tile, as for patterns; with one per
  query head, a task is a query head (G = 1) reading its KV head's packed blocks (`heads_per_kv` = G).
- torch ops (backward, float16, where the kernel cannot run): per query head, its rows' key blocks gathered
  (blocks of queries at a time), the scores masked by the base pattern and the rows' own selections, softmax,
  products. Autograd differentiates it; the selection is not differentiated.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from bench.selection import Selection
from impls.blocked.kernel import HeadTables
from impls.common import accum_dtype, masked_lse_softmax

GATHER_ELEMENTS = 1 << 24  # gathered key elements (per chunk of query blocks) the torch path holds at once
# Query rows per kernel tile for selections per row: a tile runs over the union of its rows' blocks, and rows
# of one head keep different blocks (MoBA at 16K, budget 1/16: 8.5 blocks a row, 58 in the union of 16 rows'),
# so one row a tile computes nothing it drops; fewer rows were faster for MoBA and NSA (docs/performance.md,
# "Measured choices", P2).
ROW_TILE = 1


def base_slots(pattern, bs: int) -> tuple[Tensor, Tensor]:
    """(slot (QB, KB) int32: -2 not allowed, -1 a full block, p >= 0 partial with masks[p]; masks (P, bs, bs))."""
    sparse = pattern.block_sparse(bs)
    nqb, nkb = sparse.num_blocks, math.ceil(pattern.seq_len / bs)
    slot = torch.full((nqb, nkb), -2, dtype=torch.int32)
    used = torch.arange(sparse.kv_indices.shape[1])[None, :] < sparse.kv_counts[:, None].to(torch.int64)
    rows = torch.arange(nqb)[:, None].expand_as(sparse.kv_indices)[used]
    cols = sparse.kv_indices[used].to(torch.int64)
    slot[rows, cols] = torch.where(sparse.full[used], -1, sparse.mask_index[used].to(torch.int32))
    masks = sparse.masks if sparse.masks.numel() else torch.zeros(1, bs, bs, dtype=torch.bool)
    return slot, masks.contiguous()


def chosen_blocks(selection: Selection, nq: int, nkb: int, tile: int) -> Tensor:
    """blocks (B, H_sel, tiles, KB) bool: kept by some row of each query tile of `tile` rows.

    Built from the indices by one scatter: never a tensor of every row's key blocks, which at 128K keys and
    per-row units is N x N / bs booleans per head (gigabytes)."""
    if selection.q_unit == tile:
        return selection.unit_mask(nkb)
    idx = selection.indices.to(torch.int64)  # (B, H_sel, U, K)
    b, h_sel, _, k = idx.shape
    tiles = math.ceil(nq / tile)
    if selection.q_unit != 1:
        idx = idx[:, :, torch.arange(nq, device=idx.device) // selection.q_unit]  # (B, H_sel, nq, K): each row's
    idx = torch.where(idx < 0, nkb, idx)  # padding lands in a spare column
    idx = torch.nn.functional.pad(idx, (0, 0, 0, tiles * tile - nq), value=nkb).view(b, h_sel, tiles, tile * k)
    blocks = torch.zeros(b, h_sel, tiles, nkb + 1, dtype=torch.bool, device=idx.device)
    return blocks.scatter_(-1, idx, True)[..., :nkb]


def head_tables(selection: Selection, slot: Tensor, masks: Tensor, nq: int, n: int, bs: int,
                task_heads: Tensor) -> HeadTables:
    """Tables of the tasks whose selection heads are `task_heads` (T,), over batch-major tasks (B*T)."""
    if selection.q_unit != bs:
        return row_tables(selection, slot, masks, nq, n, bs, task_heads)
    nkb = math.ceil(n / bs)
    blocks = selection.unit_mask(nkb)[:, task_heads] & (slot >= -1)  # (B, T, QB, KB): the base allows them too
    b, tasks_per_batch = blocks.shape[:2]
    counts = blocks.sum(dim=-1)
    width = max(int(counts.max()) if counts.numel() else 0, 1)
    # The kept blocks of each query block, ascending, from the nonzeros (row-major: sorted within a row),
    # padded with block 0.
    where = blocks.nonzero()  # (kept, 4)
    row = (where[:, 0] * tasks_per_batch + where[:, 1]) * blocks.shape[2] + where[:, 2]
    flat_counts = counts.flatten()
    starts = torch.cumsum(flat_counts, 0) - flat_counts
    order = torch.zeros(flat_counts.numel(), width, dtype=torch.int64, device=blocks.device)
    order[row, torch.arange(row.numel(), device=blocks.device) - starts[row]] = where[:, 3]
    order = order.view(*blocks.shape[:3], width)
    mask_slot = torch.gather(slot.expand(b, tasks_per_batch, *slot.shape), -1, order)
    flat = lambda t: t.reshape(b * tasks_per_batch, *t.shape[2:]).contiguous()  # noqa: E731
    return HeadTables(bs, flat(order.to(torch.int32)), flat(counts.to(torch.int32)), flat(mask_slot.to(torch.int32)),
                      masks, torch.empty(0, dtype=torch.int64), bs)


def row_tables(selection: Selection, slot: Tensor, masks: Tensor, nq: int, n: int, bs: int,
               task_heads: Tensor) -> HeadTables:
    """Tables of a selection per row (or per unit of fewer rows than a block), in tiles of ROW_TILE rows: each
    tile's table row is the union of its rows' kept blocks the base allows, ascending, with a bit per row saying
    which rows kept each (`row_bits`, where a tile has more than one row).

    Made from the indices alone, sorted within each tile: its memory is the indices' (B, T, nq, K), never a
    (tiles, key blocks) map, which per row at 128K keys is gigabytes per head."""
    nkb = math.ceil(n / bs)
    tile = min(bs, ROW_TILE)
    idx = selection.indices[:, task_heads].to(torch.int64)  # (B, T, U, K)
    device = idx.device
    rows = torch.arange(nq, device=device)
    if selection.q_unit != 1:
        idx = idx[:, :, rows // selection.q_unit]  # (B, T, nq, K): each row's own
    b, tasks_per_batch, _, k = idx.shape
    idx = torch.where(idx < 0, nkb, idx)  # padding: the spare key block nkb, sorted last
    spare = torch.full((slot.shape[0], 1), -2, dtype=slot.dtype, device=slot.device)
    row_slots = torch.cat([slot, spare], dim=1)[(rows // bs)[:, None], idx]  # (B, T, nq, K)
    idx = torch.where(row_slots >= -1, idx, nkb)  # blocks the base pattern does not allow the row: dropped
    tiles = math.ceil(nq / tile)
    idx = torch.nn.functional.pad(idx, (0, 0, 0, tiles * tile - nq), value=nkb).view(b, tasks_per_batch, tiles,
                                                                                     tile * k)
    block, entry = idx.sort(dim=-1)
    valid = block < nkb
    first = valid.clone()  # the first entry of each distinct block of the tile
    first[..., 1:] &= block[..., 1:] != block[..., :-1]
    counts = first.sum(dim=-1)  # (B, T, tiles)
    width = max(int(counts.max()) if counts.numel() else 0, 1)
    column = torch.where(valid, torch.cumsum(first, dim=-1) - 1, width)  # each entry's place; width: dropped
    kv_index = torch.zeros(b, tasks_per_batch, tiles, width + 1, dtype=torch.int64, device=device)
    kv_index = kv_index.scatter_(-1, column, torch.where(valid, block, 0))[..., :width]  # a block's entries agree
    row_bits = torch.empty(0, dtype=torch.int64)
    if tile > 1:  # a block's rows hold distinct bits, so their sum is their OR
        bit = torch.where(valid, torch.ones_like(entry) << (entry // k), 0)
        row_bits = torch.zeros(b, tasks_per_batch, tiles, width + 1, dtype=torch.int64, device=device)
        row_bits = row_bits.scatter_add_(-1, column, bit)[..., :width]
    tile_block = torch.arange(tiles, device=device) * tile // bs  # the query block each tile's rows lie in
    mask_slot = slot[tile_block[:, None], kv_index]  # (B, T, tiles, width)
    flat = lambda t: t.reshape(b * tasks_per_batch, *t.shape[2:]).contiguous()  # noqa: E731
    return HeadTables(bs, flat(kv_index.to(torch.int32)), flat(counts.to(torch.int32)),
                      flat(mask_slot.to(torch.int32)), masks, flat(row_bits) if tile > 1 else row_bits, tile)


def tasks_of(selection: Selection, heads: int, kv_heads: int) -> tuple[Tensor, bool]:
    """(the selection head of each task of a batch element, whether a task is a query head); module docstring."""
    if selection.shared == "head" and heads != kv_heads:
        return selection.head_index(heads, kv_heads), True
    if selection.shared == "all":
        return torch.zeros(kv_heads, dtype=torch.int64), False
    return torch.arange(kv_heads), False  # kv_group, or head without GQA: one task per KV head


def gathered_attention(selection: Selection, pattern, q: Tensor, k: Tensor, v: Tensor, scale: float, bs: int
                       ) -> tuple[Tensor, Tensor]:
    """The torch path: (out (B, H, q_len, D), lse (B, H, q_len) float32); module docstring."""
    b, h, nq, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    nqb, nkb = math.ceil(nq / bs), math.ceil(n / bs)
    slot, _ = base_slots(pattern, bs)
    blocks = chosen_blocks(selection, nq, nkb, bs)  # per query block: the union of its rows' blocks
    heads_of = selection.head_index(h, hkv).to(blocks.device)
    blocks = blocks[:, heads_of] & (slot >= -1).to(blocks.device)  # (B, H, QB, KB)
    width = max(int(blocks.sum(dim=-1).max()) if blocks.numel() else 0, 1)
    order = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True)[..., :width]
    kept = torch.gather(blocks, -1, order)  # (B, H, QB, W)
    acc = accum_dtype(q.dtype)
    rows_all = torch.arange(nq, device=q.device)
    unit_of_row = rows_all // selection.q_unit
    kv_units = selection.unit_mask(nkb)  # (B, H_sel, U, KB)
    group = h // hkv
    kb_heads = torch.arange(h, device=q.device) // group  # the KV head each query head reads
    k_blocks = torch.nn.functional.pad(k, (0, 0, 0, nkb * bs - n)).view(b, hkv, nkb, bs, d)[:, kb_heads]
    v_blocks = torch.nn.functional.pad(v, (0, 0, 0, nkb * bs - n)).view(b, hkv, nkb, bs, d)[:, kb_heads]
    q_blocks = torch.nn.functional.pad(q, (0, 0, 0, nqb * bs - nq)).view(b, h, nqb, bs, d)
    chunk = max(1, GATHER_ELEMENTS // max(1, b * h * width * bs * d))
    outs, lses = [], []
    for start in range(0, nqb, chunk):
        qbs = slice(start, min(start + chunk, nqb))
        idx = order[:, :, qbs]  # (B, H, c, W)
        pick = idx[..., None, None].expand(*idx.shape, bs, d).reshape(b, h, -1, bs, d)
        keys = torch.gather(k_blocks, 2, pick).view(b, h, idx.shape[2], width * bs, d)
        values = torch.gather(v_blocks, 2, pick).view(b, h, idx.shape[2], width * bs, d)
        rows = torch.arange(qbs.start * bs, qbs.stop * bs, device=q.device).view(-1, bs)  # (c, bs)
        key_pos = (idx[..., None] * bs + torch.arange(bs, device=q.device)).reshape(b, h, idx.shape[2], 1, -1)
        allowed = pattern.mask(rows.clamp(max=nq - 1)[None, None, :, :, None].cpu(), key_pos.clamp(max=n - 1).cpu())
        allowed = allowed.to(q.device) & (key_pos < n) & (rows < nq)[None, None, :, :, None]
        allowed &= kept[:, :, qbs].repeat_interleave(bs, dim=-1)[:, :, :, None, :]
        # each row's own selection (the union of its block's rows was gathered)
        units = unit_of_row[rows.clamp(max=nq - 1)]  # (c, bs)
        own = kv_units[:, heads_of.cpu() if kv_units.device.type == "cpu" else heads_of]  # (B, H, U, KB)
        own = own[:, :, units]  # (B, H, c, bs, KB)
        own = torch.gather(own, -1, idx[:, :, :, None, :].expand(-1, -1, -1, bs, -1))  # (B, H, c, bs, W)
        allowed &= own.repeat_interleave(bs, dim=-1)
        scores = (q_blocks[:, :, qbs].to(acc) @ keys.to(acc).transpose(-1, -2)) * scale  # (B, H, c, bs, W*bs)
        probs, lse = masked_lse_softmax(scores, allowed)
        outs.append((probs.to(v.dtype) @ values).to(acc))
        lses.append(lse)
    out = torch.cat(outs, dim=2).reshape(b, h, nqb * bs, d)[:, :, :nq]
    lse = torch.cat(lses, dim=2).reshape(b, h, nqb * bs)[:, :, :nq]
    return out.to(q.dtype), lse.float()
