"""`blocked`: dense matrix products over the pattern's block layout, pure PyTorch, the fast CPU path.

Queries are cut into blocks of `block_size` rows; each query block gets every key it may see in one batch
and is computed by dense GEMMs: sliding windows of K for banded patterns (Longformer's sliding chunks),
gathered key blocks otherwise (`plan`), masked only where blocks are partially allowed, with an exact
softmax over the batch (`compute`). Memory never grows as N^2: the forward holds one step's scores
per thread besides its output, and the backward (an autograd.Function walking the same steps) the saved
probabilities of the allowed blocks.
"""

from __future__ import annotations

from bench.registry import Impl, register
from impls.blocked.compute import blocked_attention
from impls.blocked.plan import make_plan
from impls.common import accum_dtype, fold_heads, softmax_scale, unfold_heads


@register
class Blocked(Impl):
    name = "blocked"
    description = "dense matmuls over the block layout: sliding windows for bands, gathered blocks otherwise"
    fwd_bwd = True

    def prepare(self, case, pattern, q, k, v):
        plan = make_plan(pattern, case.block_size, case.batch * case.heads, softmax_scale(case.head_dim),
                         q.device)
        acc = accum_dtype(q.dtype)
        self._extras = {"path": plan.path, "block_size": plan.block,
                        "computed_pairs_per_head": plan.computed_pairs,
                        "computed_over_allowed": plan.computed_pairs / max(1, pattern.nnz)}

        def call():
            folded = [fold_heads(t).to(acc) for t in (q, k, v)]  # (BH, N, D)
            return unfold_heads(blocked_attention(plan, *folded), q.shape).to(q.dtype)

        return call

    def record_extras(self) -> dict[str, object]:
        return dict(self._extras)
