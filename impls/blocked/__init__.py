"""`blocked`: dense matrix products over the pattern's block layout, pure PyTorch, the fast CPU path.

Query rows (the pattern's q_len x seq_len matrix) are cut into blocks of `block_size` rows; each query
block gets every key it may see in one batch and is computed by dense GEMMs: sliding windows of K for
banded patterns (Longformer's sliding chunks), gathered key blocks otherwise (`plan`), masked only where
blocks are partially allowed, with an exact softmax over the batch (`compute`). Grouped-query attention
stacks the G query heads of a KV head as rows of the same products (K and V are never repeated). Memory
never grows as N^2: the forward holds one step's scores per thread besides its output, and the backward
(an autograd.Function walking the same steps) the saved probabilities of the allowed blocks. bfloat16 and
float16 inputs are computed in their own dtype: the products on the low-precision GEMMs (float32
accumulation inside), the softmax statistics and the key-gradient sums in float32 (`compute`, `backward`).
Inference on CPU in float32 and bfloat16 goes through a C++ kernel over the pattern's block table (`kernel`,
measured fastest on every plan); where it cannot (float16, float64, shapes it does not take, no compiler),
through torch's fused flash kernel on low-precision bands (`fused`), else through the steps above.
"""

from __future__ import annotations

from typing import ClassVar

from bench.registry import Impl, register, setup_phase
from bench.selection import TakesSelections
from impls.blocked.attention import blocked_attention
from impls.blocked.fused import FUSED_ROWS, fused_available
from impls.blocked.kernel import (
    BlockTable,
    block_table,
    kernel_attention,
    kernel_attention_tables,
    kernel_wanted,
    unavailable_reason,
)
from impls.blocked.plan import BandPlan, GatherPlan, make_plan
from impls.blocked.selected import base_slots, gathered_attention, head_tables, tasks_of
from impls.common import softmax_scale


@register
class Blocked(Impl):
    name = "blocked"
    description = "dense matmuls over the block layout: sliding windows for bands, gathered blocks otherwise"
    fwd_bwd = True
    selections: ClassVar[TakesSelections] = {"q_unit": (1, "block"), "kv_unit": ("block",)}

    def prepare(self, case, pattern, q, k, v):
        b, h, nq, d = q.shape
        hkv, n = k.shape[1], k.shape[2]
        group = h // hkv
        scale = softmax_scale(case.head_dim)
        table: BlockTable | None = None  # inference through the CPU kernel (`kernel`): the pattern's block table
        kernel_missing: str | None = None  # why the kernel, wanted, cannot run
        if case.mode == "fwd" and kernel_wanted(q.dtype, q.device):
            with setup_phase("compile"):  # built on first use on this machine, then loaded from its cache
                kernel_missing = unavailable_reason(q, case.block_size)
            if kernel_missing is None:
                with setup_phase("mask"):
                    table = block_table(pattern, case.block_size)
        plan: BandPlan | GatherPlan | None = None  # the torch-op steps, where the kernel does not run
        fused = None  # inference in low precision on a band: the fused kernel's plan, of FUSED_ROWS rows
        if table is None:
            with setup_phase("mask"):  # the plan: which keys each step reads, and its masks
                plan = make_plan(pattern, case.block_size, b * hkv, group, scale, q.device, q.dtype)
                if case.mode == "fwd" and isinstance(plan, BandPlan) and fused_available(q):
                    wide = plan if plan.rows >= FUSED_ROWS else \
                        make_plan(pattern, FUSED_ROWS, b * hkv, group, scale, q.device, q.dtype)
                    fused = wide if isinstance(wide, BandPlan) else None  # wider blocks may fit the gather plan
        # computed pairs per query head (of the q_len x seq_len matrix), padding included
        shown = table if table is not None else fused if fused is not None else plan
        self._extras = {"path": "band_fused" if shown is fused else shown.path, "block_size": case.block_size,
                        "query_block_rows": case.block_size if shown is table else shown.rows,
                        "group_size": group, "computed_pairs_per_head": shown.computed_pairs,
                        "computed_over_allowed": shown.computed_pairs / max(1, pattern.nnz)}
        if kernel_missing is not None:
            self._extras["kernel_unavailable"] = kernel_missing

        def call():
            # (B, H, q_len, D) -> (B*Hkv, G, q_len, D): the G query heads of each KV head together, and
            # (B, Hkv, N, D) -> (B*Hkv, N, D); views, products in the inputs' dtype
            grouped = q.reshape(b * hkv, group, nq, d)
            keys, values = (t.reshape(b * hkv, n, d) for t in (k, v))
            if table is not None:
                return kernel_attention(table, grouped, keys, values, scale).reshape(q.shape)
            return blocked_attention(plan, grouped, keys, values, fused).reshape(q.shape)

        return call

    def prepare_selected(self, case, pattern, q, k, v):
        """Attention over a selection of key blocks (impls/blocked/selected.py): the CPU kernel over per-task
        block tables in inference, the gathered torch steps elsewhere."""
        b, h, nq, d = q.shape
        hkv, n = k.shape[1], k.shape[2]
        group = h // hkv
        bs = case.block_size
        scale = softmax_scale(case.head_dim)
        kernel_missing: str | None = "mode fwd_bwd: the kernel is inference only"
        if case.mode == "fwd" and kernel_wanted(q.dtype, q.device):
            with setup_phase("compile"):
                kernel_missing = unavailable_reason(q, bs)
        elif case.mode == "fwd":
            kernel_missing = f"{q.dtype} on {q.device.type}"
        with setup_phase("mask"):
            slot, masks = base_slots(pattern, bs)
        self._extras = {"path": "kernel_selected" if kernel_missing is None else "gather_selected",
                        "block_size": bs, "group_size": group}
        if kernel_missing is not None:
            self._extras["kernel_unavailable"] = kernel_missing

        def attend(selection):
            if kernel_missing is not None:
                return gathered_attention(selection, pattern, q, k, v, scale, bs)
            task_heads, per_query_head = tasks_of(selection, h, hkv)
            tables = head_tables(selection, slot, masks, nq, n, bs, task_heads)
            tiles = q.reshape(b * h, 1, nq, d) if per_query_head else q.reshape(b * hkv, group, nq, d)
            keys, values = (t.reshape(b * hkv, n, d) for t in (k, v))
            out, lse = kernel_attention_tables(tables, tiles, keys, values, scale, group if per_query_head else 1)
            return out.reshape(q.shape), lse.reshape(b, h, nq)

        return attend

    def record_extras(self) -> dict[str, object]:
        return dict(self._extras)
