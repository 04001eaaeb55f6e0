"""`triton_block_sparse`: our Triton block-sparse FlashAttention-style kernel, registered as an Impl."""

from __future__ import annotations

import importlib.util

from bench.registry import Impl, register
from impls.common import apply_sinks
from impls.triton_block_sparse import decode, launch, mode
from impls.triton_block_sparse.score_mods import mod_args


@register
class TritonBlockSparse(Impl):
    name = "triton_block_sparse"
    description = "Triton block-sparse FlashAttention-2 (tile lookup table); on CPU via the Triton interpreter"
    fwd_bwd = True
    score_mods = frozenset({"softcap", "alibi", "relative_bias"})  # in the kernels, forward and backward
    applies_sinks = True  # in inference, through the forward kernel's log-sum-exp (`unsupported`)

    def __init__(self) -> None:
        self._extras: dict[str, object] = {}

    def unavailable(self) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (pip install triton)"
        return None

    def unsupported(self, case) -> str | None:
        reason = super().unsupported(case)
        if reason:
            return reason
        if case.sinks is not None and case.mode == "fwd_bwd":
            return (f"{self.name} applies learned sinks in inference only: its backward kernels take no gradient "
                    "of the log-sum-exp the sinks merge through")
        if not launch.MIN_HEAD_DIM <= case.head_dim <= launch.MAX_HEAD_DIM:
            return (f"{self.name} supports head_dim {launch.MIN_HEAD_DIM}..{launch.MAX_HEAD_DIM} "
                    f"(got {case.head_dim})")
        if case.batch * case.heads > launch.MAX_GRID_Y:
            return f"{self.name} launches B*H programs on grid axis y, at most {launch.MAX_GRID_Y} " \
                   f"(got {case.batch * case.heads})"
        # No limit on kv_heads, q_len, documents or custom patterns: programs read KV head h // G through the
        # strides, the tables are of the q_len x seq_len matrix, and what has no exact formula gets bitmasks.
        if case.device == "cpu" and not mode.uses_interpreter():
            return (f"{self.name} runs compiled kernels on CUDA tensors in this process; for CPU tensors set "
                    "TRITON_INTERPRET=1 (the Triton interpreter: correctness only, not kernel speed)")
        return None

    def tf32(self, case) -> bool:
        # Compiled tl.dot takes float32 operands as TF32 (its default input_precision); the interpreter
        # multiplies in full float32.
        return case.dtype == "float32" and not mode.uses_interpreter()

    def prepare(self, case, pattern, q, k, v):
        needs_grad = any(t.requires_grad for t in (q, k, v))
        mod = mod_args(case, q.device)
        sinks = case.sink_logits()
        if sinks is not None:  # through the forward kernel's log-sum-exp (inference only: `unsupported`)
            plan = launch.plan_attention(pattern, q, k, v, False, mod)
            self._extras = plan.describe()
            return lambda: apply_sinks(*launch.forward_with_lse(q, k, v, plan), sinks)
        if decode.takes(pattern, q, k, needs_grad, mod):  # a few query rows over a long cache: split the keys
            split = decode.plan_decode(pattern, q, k, v, mod)
            self._extras = split.describe()
            return decode.call_for(q, k, v, split)
        plan = launch.plan_attention(pattern, q, k, v, needs_grad, mod)
        self._extras = plan.describe()

        def call():
            return launch.BlockSparseAttention.apply(q, k, v, plan)

        return call

    def record_extras(self) -> dict[str, object]:
        return dict(self._extras)
