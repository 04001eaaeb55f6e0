"""Differentiable collectives over `bench.comm`: what a distributed implementation needs for fwd_bwd.

Each op is an autograd Function whose forward and backward both go through the current `Communicator`,
so the bytes of the backward pass are counted like the forward's. The pairs are the usual ones (Megatron-LM's
tensor-parallel "mappings"): an op's backward is its adjoint.

    reduce_from_ranks   forward all-reduce (sum)          backward identity
    copy_to_ranks       forward identity                  backward one all-reduce of every gradient
    all_gather          forward all-gather along dim 0    backward reduce-scatter
    ring_shift          forward send to rank+1, recv from rank-1   backward the reverse shift
    all_to_all          forward all_to_all_single (uneven splits)  backward the transposed exchange

The backward of each op is counted under the communication level its forward ran in (`Communicator.level`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from bench.comm.communicator import P2P, Communicator, current


def _remember(ctx: Any) -> Communicator:
    """The current communicator and its level, kept on ctx for the backward."""
    comm = current()
    ctx.comm, ctx.level = comm, comm.active_level
    return comm


class _ReduceFromRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return current().all_reduce(x.clone())

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad


def reduce_from_ranks(x: Tensor) -> Tensor:
    """Sum of x over ranks (every rank gets it); the gradient passes through unchanged (Megatron's g)."""
    return _ReduceFromRanks.apply(x)


class _CopyToRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, *xs: Tensor) -> tuple[Tensor, ...]:
        ctx.shapes = [x.shape for x in xs]
        _remember(ctx)
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor, ...]:
        filled = [torch.zeros(s, dtype=_dtype(grads), device=_device(grads)) if g is None else g
                  for g, s in zip(grads, ctx.shapes, strict=True)]
        flat = torch.cat([g.reshape(-1) for g in filled])  # one all-reduce for all of them
        with ctx.comm.level(ctx.level):
            ctx.comm.all_reduce(flat)
        parts = flat.split([g.numel() for g in filled])
        return tuple(part.view(s) for part, s in zip(parts, ctx.shapes, strict=True))


def _dtype(grads: Sequence[Tensor | None]) -> torch.dtype:
    return next(g.dtype for g in grads if g is not None)


def _device(grads: Sequence[Tensor | None]) -> torch.device:
    return next(g.device for g in grads if g is not None)


def copy_to_ranks(*xs: Tensor) -> tuple[Tensor, ...]:
    """Replicated inputs entering a tensor-parallel region (Megatron's f): identity forward; backward sums
    the ranks' partial gradients with ONE all-reduce over all the inputs' gradients concatenated."""
    return _CopyToRanks.apply(*xs)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        comm = _remember(ctx)
        out = x.new_empty((comm.world_size, *x.shape))
        return comm.all_gather_into_tensor(out, x.contiguous())

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        comm: Communicator = ctx.comm
        out = grad.new_empty(grad.shape[1:])
        with comm.level(ctx.level):
            return comm.reduce_scatter_tensor(out, grad.contiguous())


def all_gather(x: Tensor) -> Tensor:
    """(P, *x.shape): every rank's x stacked in rank order. Backward: reduce-scatter of the gradient."""
    return _AllGather.apply(x)


class _RingShift(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        comm = _remember(ctx)
        return _shift(comm, x.contiguous(), +1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        with ctx.comm.level(ctx.level):
            return _shift(ctx.comm, grad.contiguous(), -1)


def _shift(comm: Communicator, x: Tensor, direction: int) -> Tensor:
    p, r = comm.world_size, comm.rank
    if p == 1:
        return x.clone()
    out = torch.empty_like(x)
    comm.batch_isend_irecv([P2P("send", x, (r + direction) % p), P2P("recv", out, (r - direction) % p)])
    return out


def ring_shift(x: Tensor) -> Tensor:
    """The x of rank - 1 (rank 0 gets rank P-1's). Backward sends the gradient the other way round."""
    return _RingShift.apply(x)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, send_splits: list[int], recv_splits: list[int]) -> Tensor:
        comm = _remember(ctx)
        ctx.send_splits, ctx.recv_splits = send_splits, recv_splits
        out = x.new_empty((sum(recv_splits), *x.shape[1:]))
        return comm.all_to_all_single(out, x.contiguous(), recv_splits, send_splits)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        comm: Communicator = ctx.comm
        out = grad.new_empty((sum(ctx.send_splits), *grad.shape[1:]))
        with comm.level(ctx.level):
            comm.all_to_all_single(out, grad.contiguous(), ctx.send_splits, ctx.recv_splits)
        return out, None, None


def all_to_all(x: Tensor, send_splits: Sequence[int], recv_splits: Sequence[int]) -> Tensor:
    """Rows of x (dim 0) go to ranks in order, send_splits[r] to rank r; rows arrive in rank order,
    recv_splits[r] from rank r. Backward sends each gradient row back where its row came from."""
    return _AllToAll.apply(x, list(send_splits), list(recv_splits))


class _KeepInGraph(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, out: Tensor, *tied: Tensor) -> Tensor:
        ctx.tied = [(t.shape, t.dtype, t.device) for t in tied]
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, ...]:
        return (grad, *(torch.zeros(s, dtype=d, device=dev) for s, d, dev in ctx.tied))


def keep_in_graph(out: Tensor, *tied: Tensor) -> Tensor:
    """`out` unchanged, with `tied` made part of its graph (their gradient is zero).

    Every rank must run the same collectives in backward. Autograd skips the backward of any op whose result
    does not reach the output - for instance a ring shift whose K/V chunk a rank had no use for - and its
    peers would then wait forever for the matching send. Tying such results to the output keeps every
    rank's backward collectives in step.
    """
    return _KeepInGraph.apply(out, *tied)
