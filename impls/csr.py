"""`csr`: attention over torch sparse CSR tensors, O(nnz) memory, never an (N, N) buffer.

Scores exist only at the pattern's allowed pairs: `torch.sparse.sampled_addmm` evaluates Q K^T at the CSR
positions of the pattern's `csr()` view. Torch has no CSR softmax on CPU, so the row softmax is ours,
vectorised over rows: the row maxima by one `scatter_reduce`, broadcast back with `repeat_interleave`
(rows are contiguous in CSR), then exp. The row sums come out of the sparse x dense product for free:
V gets an extra column of ones, so E [V, 1] holds both the unnormalised output and each row's sum.

Backward is a custom autograd.Function with the same sparse kernels (the usual softmax-attention
gradients, every product at the pattern's pairs only):
dV = P^T dO, dP = (dO V^T) sampled at the pattern, dS = P * (dP - rowsum(dO * O)), dQ = dS K, dK = dS^T Q.
The transposed pattern (for P^T and dS^T) is a fixed permutation of the CSR values, found in prepare.

The matrix is the pattern's q_len x seq_len one (decode, chunked prefill: the last q_len positions are the
queries), its transpose seq_len x q_len. Query heads are independent steps sharing the pattern's index
arrays (stored once); on CPU they run side by side on threads (`impls.common.run_steps`), so the transient
memory is a few heads' nnz values. With grouped-query attention each query head reads its KV head's K and
V (h // G, views: never repeated), and the G heads of a KV head add their dK and dV into it in head order.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from bench.registry import Impl, register, setup_phase
from bench.selection import TakesSelections
from impls.common import InOrder, accum_dtype, run_steps, softmax_scale

# Torch warns once per process that CSR support is beta; the conformance tests are what we rely on.
warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")


@dataclass(frozen=True)
class CsrLayout:
    """The pattern's CSR index arrays, of the (q_len, N) matrix, and their transpose, shared by every head."""

    rows: int  # q_len
    cols: int  # N
    crow: Tensor  # int64 (q_len+1,)
    col: Tensor  # int64 (nnz,)
    row_lengths: Tensor  # int64 (q_len,) allowed keys per query row
    row: Tensor  # int64 (nnz,) the query row of each entry
    t_crow: Tensor  # int64 (N+1,) CSR of the transposed pattern, (N, q_len)
    t_col: Tensor  # int64 (nnz,)
    t_perm: Tensor  # int64 (nnz,): values of the transpose = values[t_perm]

    @property
    def nnz(self) -> int:
        return self.col.numel()

    @classmethod
    def of(cls, crow: Tensor, col: Tensor, rows: int, cols: int, device: torch.device) -> CsrLayout:
        lengths = crow.diff()
        row = torch.repeat_interleave(torch.arange(rows), lengths)
        # Stable sort by column keeps rows increasing inside each column: a valid CSR of the transpose.
        t_perm = torch.sort(col, stable=True).indices
        t_crow = torch.zeros(cols + 1, dtype=torch.int64)
        t_crow[1:] = torch.cumsum(torch.bincount(col, minlength=cols), 0)
        tensors = (crow, col, lengths, row, t_crow, row[t_perm], t_perm)
        return cls(rows, cols, *(t.to(device=device, dtype=torch.int64) for t in tensors))

    def matrix(self, values: Tensor, transposed: bool = False) -> Tensor:
        """The (q_len, N) CSR matrix holding `values` (nnz,) at the pattern's pairs, or its (N, q_len) transpose."""
        if transposed:
            return torch.sparse_csr_tensor(self.t_crow, self.t_col, values[self.t_perm], (self.cols, self.rows),
                                           check_invariants=False)
        return torch.sparse_csr_tensor(self.crow, self.col, values, (self.rows, self.cols), check_invariants=False)

    def sampled(self, a: Tensor, b: Tensor, scale: float) -> Tensor:
        """Values (nnz,) of scale * a @ b.T at the pattern's pairs; a (q_len, D), b (N, D)."""
        pattern = self.matrix(a.new_zeros(self.nnz))
        return torch.sparse.sampled_addmm(pattern, a, b.T, beta=0.0, alpha=scale).values()

    def expand_rows(self, per_row: Tensor) -> Tensor:
        """(q_len,) -> (nnz,): each row's value repeated over its entries."""
        return per_row.repeat_interleave(self.row_lengths, output_size=self.nnz)

    def row_max(self, values: Tensor) -> Tensor:
        """(nnz,) -> (q_len,): the maximum of each row; 0 for a row without entries."""
        peak = values.new_full((self.rows,), -math.inf).scatter_reduce_(0, self.row, values, "amax")
        return peak.nan_to_num_(0.0, posinf=0.0, neginf=0.0)


@dataclass(frozen=True)
class CsrScoreMod:
    """A built-in score modification at the pattern's pairs: softcap's cap, or an additive bias (H, nnz)."""

    cap: float | None = None
    bias: Tensor | None = None

    def apply(self, scores: Tensor, head: int) -> Tensor:
        """The modified scaled scores (nnz,) of query head `head` (of B*H)."""
        if self.cap is not None:
            return scores.div_(self.cap).tanh_().mul_(self.cap)
        if self.bias is not None:
            return scores.add_(self.bias[head % self.bias.shape[0]])
        return scores


def _head_forward(layout: CsrLayout, q: Tensor, k: Tensor, v1: Tensor, scale: float, mod: CsrScoreMod, h: int
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """One query head: q (q_len, D), its KV head's k (N, D) and [v, 1] (N, D + 1) -> (output (q_len, D),
    exp'd scores (nnz,), row sums (q_len,))."""
    scores = mod.apply(layout.sampled(q, k, scale), h)  # (nnz,)
    expd = scores.sub_(layout.expand_rows(layout.row_max(scores))).exp_()
    both = layout.matrix(expd) @ v1  # (q_len, D + 1): the last column is each row's sum of exp'd scores
    sums = both[:, -1].clone()
    out = both[:, :-1] / sums.clamp_min(torch.finfo(sums.dtype).tiny)[:, None]  # an empty row: 0 / tiny = 0
    return out, expd, sums


def _layout_of(layouts: CsrLayout | tuple[CsrLayout, ...], head: int) -> CsrLayout:
    """The CSR layout of query head `head` (of B*H): one shared by all, or one per head (a selection's)."""
    return layouts[head] if isinstance(layouts, tuple) else layouts


class CsrAttention(torch.autograd.Function):
    """Differentiable CSR attention: q (BH, q_len, D), k, v (BHkv, N, D); query head i reads KV head i // G and
    the pattern's layout, or its own of a tuple of B*H layouts (a selection per head)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, layout: CsrLayout | tuple[CsrLayout, ...],
                scale: float, mod: CsrScoreMod = CsrScoreMod()) -> Tensor:
        keep = any(ctx.needs_input_grad[:3])
        group = q.shape[0] // k.shape[0]
        # [V, 1] once per KV head: the sparse x dense product then also gives each row's sum
        v1 = torch.cat([v, v.new_ones(v.shape[0], v.shape[1], 1)], dim=2)  # (BHkv, N, D + 1)

        def head(h: int) -> tuple[Tensor, Tensor | None, Tensor | None]:
            out, expd, sums = _head_forward(_layout_of(layout, h), q[h], k[h // group], v1[h // group], scale,
                                            mod, h)
            return (out, expd, sums) if keep else (out, None, None)  # inference keeps no nnz-sized values

        heads = run_steps([lambda h=h: head(h) for h in range(q.shape[0])], q.device)
        out = torch.stack([o for o, _, _ in heads])
        if keep:  # per-head layouts hold different nnz: their values stay a list
            ctx.expds = [e for _, e, _ in heads]
            ctx.save_for_backward(q, k, v, out, torch.stack([s for _, _, s in heads]))  # type: ignore[misc]
        ctx.layout, ctx.scale, ctx.mod = layout, scale, mod
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):
        q, k, v, out, sums = ctx.saved_tensors
        expds = ctx.expds
        layouts: CsrLayout | tuple[CsrLayout, ...] = ctx.layout
        scale: float = ctx.scale
        group = q.shape[0] // k.shape[0]
        inv_sums = torch.where(sums > 0, 1.0 / sums, torch.zeros_like(sums))
        dq = torch.empty_like(q)
        # With G > 1 the query heads of a KV head add into its dK and dV, in head order (`InOrder`): the same
        # sums run to run whichever thread finishes first.
        dk, dv = (torch.empty_like(k), torch.empty_like(v)) if group == 1 else (torch.zeros_like(k),
                                                                               torch.zeros_like(v))
        in_order = InOrder()

        def grads(h: int, kv: int) -> tuple[Tensor, Tensor]:
            """Writes query head h's dQ; returns its (dK, dV) contributions (N, D) to KV head kv."""
            layout = _layout_of(layouts, h)
            probs = expds[h] * layout.expand_rows(inv_sums[h])  # (nnz,)
            d_out = grad_out[h]
            d_v = layout.matrix(probs, transposed=True) @ d_out  # (N, D)
            d_probs = layout.sampled(d_out, v[kv], 1.0)  # (nnz,)
            delta = (d_out * out[h]).sum(dim=1)  # (q_len,) = rowsum(P * dP)
            d_scores = probs.mul_(d_probs.sub_(layout.expand_rows(delta))).mul_(scale)
            if ctx.mod.cap is not None:  # d c tanh(s / c) / ds = 1 - tanh^2, tanh recomputed at the pairs
                capped = layout.sampled(q[h], k[kv], scale).div_(ctx.mod.cap).tanh_()
                d_scores.mul_(capped.square_().neg_().add_(1.0))
            dq[h] = layout.matrix(d_scores) @ k[kv]
            return layout.matrix(d_scores, transposed=True) @ q[h], d_v

        def head(h: int) -> None:
            kv = h // group
            if group == 1:
                dk[kv], dv[kv] = grads(h, kv)
                return
            try:
                d_k, d_v = grads(h, kv)
            except BaseException:
                with in_order.turn(h):  # pass the turn on, then fail
                    raise
            with in_order.turn(h):
                dk[kv] += d_k
                dv[kv] += d_v

        run_steps([lambda h=h: head(h) for h in range(q.shape[0])], q.device)
        return dq, dk, dv, None, None, None


def csr_score_mod(case, crow: Tensor, col: Tensor, dtype: torch.dtype, device: torch.device) -> CsrScoreMod:
    """The case's built-in modification at the pattern's pairs (an additive one as its bias (H, nnz))."""
    mod = case.make_score_mod()
    if mod is None:
        return CsrScoreMod()
    if mod.kind == "softcap":
        return CsrScoreMod(cap=mod.cap)
    rows = torch.repeat_interleave(torch.arange(len(crow) - 1), crow.diff()) + (case.seq_len - case.n_queries)
    # pair by pair (row k with column k), not an outer product
    bias = mod.apply(torch.zeros((), dtype=torch.float64), torch.arange(case.heads)[:, None], rows[None, :],
                     col[None, :])  # (H, nnz)
    return CsrScoreMod(bias=bias.to(device, dtype))


@register
class Csr(Impl):
    name = "csr"
    description = "torch sparse CSR: sampled_addmm scores at allowed pairs, our row softmax, CSR x dense"
    fwd_bwd = True
    score_mods = frozenset({"softcap", "alibi", "relative_bias"})  # at the pairs, with their derivatives
    selections: ClassVar[TakesSelections] = {"q_unit": (1, "block"), "kv_unit": ("token", "block", "page")}

    def prepare(self, case, pattern, q, k, v):
        b, h, nq, d = q.shape
        hkv, n = k.shape[1], k.shape[2]
        with setup_phase("mask"):
            crow, col = pattern.csr()
            layout = CsrLayout.of(crow, col, nq, n, q.device)
            mod = csr_score_mod(case, crow, col, accum_dtype(q.dtype), q.device)
        scale = softmax_scale(case.head_dim)
        acc = accum_dtype(q.dtype)  # CSR kernels on CPU take float32/float64 only
        self._nnz = layout.nnz

        def call():
            # (B*H, q_len, D) queries, (B*Hkv, N, D) keys and values: query head i reads KV head i // G
            out = CsrAttention.apply(q.reshape(b * h, nq, d).to(acc), k.reshape(b * hkv, n, d).to(acc),
                                     v.reshape(b * hkv, n, d).to(acc), layout, scale, mod)
            return out.view(q.shape).to(q.dtype)

        return call

    def prepare_selected(self, case, pattern, q, k, v):
        """Attention over a selection: a CSR layout per selection head from the effective mask, built in the
        call (a selection changes every call), then the same kernels."""
        b, h, nq, d = q.shape
        hkv, n = k.shape[1], k.shape[2]
        with setup_phase("mask"):
            base = pattern.dense_mask().to(q.device)  # (Nq, N)
        scale = softmax_scale(case.head_dim)
        acc = accum_dtype(q.dtype)
        self._nnz = None

        def attend(selection):
            heads_of = selection.head_index(h, hkv).tolist()  # query head -> selection head
            h_sel = selection.indices.shape[1]
            # one mask per selection head (as many heads as it has, each its own "group")
            mask = selection.dense_mask(base, h_sel, h_sel)  # (B, H_sel, Nq, N)
            layouts: list[CsrLayout] = []
            for bi in range(b):
                own: dict[int, CsrLayout] = {}
                for hh in range(h):
                    s = heads_of[hh]
                    if s not in own:
                        rows = mask[bi, s].cpu()  # (Nq, N)
                        crow = torch.zeros(nq + 1, dtype=torch.int64)
                        crow[1:] = rows.sum(dim=1).cumsum(0)
                        own[s] = CsrLayout.of(crow, rows.nonzero()[:, 1], nq, n, q.device)
                    layouts.append(own[s])
            out = CsrAttention.apply(q.reshape(b * h, nq, d).to(acc), k.reshape(b * hkv, n, d).to(acc),
                                     v.reshape(b * hkv, n, d).to(acc), tuple(layouts), scale)
            return out.view(q.shape).to(q.dtype)

        return attend

    def record_extras(self) -> dict[str, object]:
        # allowed pairs per query head of the q_len x seq_len matrix (none listed for selections: each differs)
        return {"nnz_per_head": self._nnz} if self._nnz is not None else {}
