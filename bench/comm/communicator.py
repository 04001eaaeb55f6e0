"""Counted collectives: every byte a distributed implementation moves goes through a `Communicator`.

Each wrapper performs the torch.distributed op and records, per op kind, the calls, the bytes THIS rank
sends, the op's "size" as nccl-tests defines it, and the op's time. The bytes are logical: what a ring
(or, for point-to-point ops, a direct send) moves, counted the way nccl-tests counts them, whatever the
backend does inside. Gloo, for instance, implements reduce_scatter as an all-reduce; we still count a
reduce-scatter's bytes and record that the backend was gloo, so no gloo figure passes for an NCCL one.

Ring accounting (per rank, for a buffer of S bytes over P ranks):
    all_reduce              2 (P-1)/P * S   (ring reduce-scatter then ring all-gather, P chunks)
    all_gather_into_tensor  (P-1) * s_in    (s_in: this rank's input; the output is P * s_in)
    reduce_scatter_tensor   (P-1) * s_out   (s_out: this rank's output; the input is P * s_out)
    all_to_all_single       the rows sent to the other ranks (uneven splits allowed; nothing to itself)
    broadcast               S, except the rank just before the root in the ring (pipelined ring)
    send / batch_isend_irecv the tensors sent; recv sends nothing (blocking or started with
                            `start_batch_isend_irecv`, whose transfers overlap what the rank computes meanwhile)

Bandwidth as nccl-tests reports it (nccl-tests doc/PERFORMANCE.md): algbw = size / time, busbw = algbw *
factor, with size and factor per op below. For every op busbw equals the ring bytes a rank sends divided by
the time, which is what makes busbw comparable with the link's peak.

Overlap. A blocking op's time is all exposed: the rank waits for it. `start_batch_isend_irecv` posts the
transfers and returns a `Pending` at once; the rank computes, then calls `Pending.wait()`; how the time in
flight and its hidden part are measured is in `bench.comm.timing`.

Levels. Ops inside `with comm.level("ring"):` are also counted under that label (`levels_snapshot()`), so a
scheme with two levels of communication (cp_usp: Ulysses all-to-alls inside groups, ring shifts across them)
reports each level's bytes. The differentiable ops of `bench.comm.autograd` count their backward under the
level their forward ran in.

Peers. Each op also counts the bytes this rank sends to each peer (`peers_snapshot()`, ranks of the group): a
ring op's bytes all go to the next rank of the ring ((rank + 1) % P, the logical ring nccl-tests counts), an
all-to-all's split j to rank j, a send to its peer. With the ranks' nodes these give the bytes over each kind of
link (`link_bytes`: intra_node, inter_node).

With one rank (no process group) every op is the local identity it reduces to and counts nothing, so a
distributed implementation also runs in a single process (`bench.api.attention` with world_size 1).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from bench.comm.timing import LevelStats, OpStats, Pending, start_waiter

__all__ = ["OPS", "P2P", "Communicator", "LevelStats", "OpStats", "Pending", "all_reduce_sent", "broadcast_sent",
           "bus_factor", "current", "link_bytes", "nbytes", "ring_chunks", "use"]

OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "broadcast",
       "send", "recv", "batch_isend_irecv")


def bus_factor(op: str, world_size: int) -> float:
    """nccl-tests' bus-bandwidth factor: busbw = algbw * factor (doc/PERFORMANCE.md in NVIDIA/nccl-tests)."""
    n = world_size
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"):
        return (n - 1) / n
    return 1.0  # broadcast, reduce, send/recv: every byte crosses one link once


# --- ring accounting: bytes one rank sends --------------------------------------------------------------

def ring_chunks(numel: int, parts: int) -> list[int]:
    """Element counts of the P chunks a ring splits a buffer into (the first numel % P one longer)."""
    base, extra = divmod(numel, parts)
    return [base + (1 if c < extra else 0) for c in range(parts)]


def all_reduce_sent(numel: int, elem_bytes: int, rank: int, world_size: int) -> int:
    """Bytes `rank` sends in a ring all-reduce of numel elements.

    Reduce-scatter step s sends chunk (rank - s) % P, s = 0..P-2: every chunk but (rank + 1) % P, which
    the rank ends up owning reduced. All-gather step s sends chunk (rank + 1 - s) % P: every chunk but
    (rank + 2) % P. Summed over ranks this is exactly 2 (P-1) * S.
    """
    p = world_size
    if p == 1:
        return 0
    chunks = ring_chunks(numel, p)
    return elem_bytes * (2 * numel - chunks[(rank + 1) % p] - chunks[(rank + 2) % p])


def broadcast_sent(nbytes: int, rank: int, src: int, world_size: int) -> int:
    """Bytes `rank` sends in a pipelined ring broadcast from `src`: all but the ring's last rank forward S."""
    if world_size == 1 or rank == (src - 1) % world_size:
        return 0
    return nbytes


def nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def link_bytes(sent: Sequence[Sequence[int]], node_of_rank: Sequence[int]) -> dict[str, int]:
    """{intra_node, inter_node}: the bytes of a traffic matrix (sent[src][dst]) between ranks on one node and
    between ranks on different nodes."""
    intra = inter = 0
    for src, row in enumerate(sent):
        for dst, b in enumerate(row):
            if node_of_rank[src] == node_of_rank[dst]:
                intra += b
            else:
                inter += b
    return {"intra_node": intra, "inter_node": inter}


# --- the counters ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class P2P:
    """One point-to-point transfer for `batch_isend_irecv`: send `tensor` to `peer`, or recv into it."""

    kind: Literal["send", "recv"]
    tensor: Tensor
    peer: int
    tag: int = 0  # matches a send with its recv where several transfers between two ranks are in flight


class Communicator:
    """Counted collectives over one process group. `Communicator()` is the single-process one."""

    def __init__(self, group: Any = None, rank: int = 0, world_size: int = 1, backend: str = "none") -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.counting = True
        self.stats: dict[str, OpStats] = {}
        self.level_stats: dict[str, LevelStats] = {}
        self.active_level: str | None = None
        self.peer_bytes: dict[int, int] = {}  # group rank -> bytes this rank sent it
        self.node_of_rank: list[int] | None = None  # the group's topology, where the harness knows it

    @classmethod
    def from_group(cls, group: Any) -> Communicator:
        import torch.distributed as dist

        return cls(group, dist.get_rank(group), dist.get_world_size(group), str(dist.get_backend(group)))

    # --- counters ---

    def reset(self) -> None:
        self.stats = {}
        self.level_stats = {}
        self.peer_bytes = {}

    @contextlib.contextmanager
    def level(self, name: str | None) -> Iterator[None]:
        """Ops inside are also counted under the level `name` (None: no level)."""
        before, self.active_level = self.active_level, name
        try:
            yield
        finally:
            self.active_level = before

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Ops inside run uncounted (the harness's check and gathers)."""
        before, self.counting = self.counting, False
        try:
            yield
        finally:
            self.counting = before

    def snapshot(self) -> dict[str, dict[str, float | int]]:
        """{op: {calls, bytes_sent, size_bytes, time_s, hidden_s}} since the last reset, CUDA op times resolved."""
        out = {}
        for op, s in self.stats.items():
            s.resolve()
            out[op] = {"calls": s.calls, "bytes_sent": s.bytes_sent, "size_bytes": s.size_bytes,
                       "time_s": s.time_s, "hidden_s": s.hidden_s}
        return out

    def levels_snapshot(self) -> dict[str, dict[str, int]]:
        """{level: {calls, bytes_sent}} of the ops counted under a level since the last reset."""
        return {name: {"calls": s.calls, "bytes_sent": s.bytes_sent} for name, s in self.level_stats.items()}

    def peers_snapshot(self) -> dict[int, int]:
        """{group rank: bytes this rank sent it} since the last reset."""
        return dict(self.peer_bytes)

    def _to(self, peer: int, sent: int) -> None:
        if self.counting and self.world_size > 1 and sent:
            self.peer_bytes[peer] = self.peer_bytes.get(peer, 0) + sent

    def _next(self) -> int:
        return (self.rank + 1) % self.world_size

    def _count(self, op: str, sent: int, size: int) -> OpStats:
        s = self.stats.setdefault(op, OpStats())
        s.calls += 1
        s.bytes_sent += sent
        s.size_bytes += size
        if self.active_level is not None:
            level = self.level_stats.setdefault(self.active_level, LevelStats())
            level.calls += 1
            level.bytes_sent += sent
        return s

    @contextlib.contextmanager
    def _op(self, op: str, sent: int, size: int, device: torch.device) -> Iterator[None]:
        if not self.counting or self.world_size == 1:
            yield
            return
        s = self._count(op, sent, size)
        if device.type == "cuda":
            # Device events on the current stream: no host synchronisation inside the timed call.
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            s.pending.append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            s.time_s += time.perf_counter() - t0  # gloo ops block until done

    # --- the ops (all blocking: they return when the data is in place) ---

    def all_reduce(self, t: Tensor) -> Tensor:
        """Sum `t` over ranks, in place; returns `t`."""
        import torch.distributed as dist

        if self.world_size == 1:
            return t
        sent = all_reduce_sent(t.numel(), t.element_size(), self.rank, self.world_size)
        self._to(self._next(), sent)
        with self._op("all_reduce", sent, nbytes(t), t.device):
            dist.all_reduce(t, group=self.group)
        return t

    def all_gather_into_tensor(self, out: Tensor, inp: Tensor) -> Tensor:
        """out (P * n, ...) = the ranks' inp (n, ...) concatenated along dim 0 in rank order."""
        import torch.distributed as dist

        if out.numel() != inp.numel() * self.world_size:
            raise ValueError(f"all_gather_into_tensor: output has {out.numel()} elements, expected "
                             f"{self.world_size} x {inp.numel()}")
        if self.world_size == 1:
            return out.copy_(inp.reshape(out.shape))
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._to(self._next(), (self.world_size - 1) * nbytes(inp))
        with self._op("all_gather_into_tensor", (self.world_size - 1) * nbytes(inp), nbytes(out), out.device):
            # flat views: gloo wants the output as the inputs concatenated, not stacked
            gather(out.view(-1), inp.contiguous().view(-1), group=self.group)
        return out

    def reduce_scatter_tensor(self, out: Tensor, inp: Tensor) -> Tensor:
        """out (n, ...) = this rank's part of the sum over ranks of inp (P * n, ...), split along dim 0."""
        import torch.distributed as dist

        if inp.numel() != out.numel() * self.world_size:
            raise ValueError(f"reduce_scatter_tensor: input has {inp.numel()} elements, expected "
                             f"{self.world_size} x {out.numel()}")
        if self.world_size == 1:
            return out.copy_(inp.reshape(out.shape))
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        self._to(self._next(), (self.world_size - 1) * nbytes(out))
        with self._op("reduce_scatter_tensor", (self.world_size - 1) * nbytes(out), nbytes(inp), out.device):
            scatter(out.view(-1), inp.contiguous().view(-1), group=self.group)
        return out

    def all_to_all_single(self, out: Tensor, inp: Tensor, output_split_sizes: Sequence[int] | None = None,
                          input_split_sizes: Sequence[int] | None = None) -> Tensor:
        """Rows (dim 0) of inp go to the ranks in order of `input_split_sizes`; out receives in rank order."""
        import torch.distributed as dist

        p = self.world_size
        rows = inp.shape[0]
        splits = list(input_split_sizes) if input_split_sizes is not None else [rows // p] * p
        if len(splits) != p or sum(splits) != rows:
            raise ValueError(f"all_to_all_single: input_split_sizes {splits} must be {p} sizes summing to {rows}")
        if p == 1:
            return out.copy_(inp)
        row_bytes = nbytes(inp) // rows if rows else 0
        sent = row_bytes * (rows - splits[self.rank])  # the rank's own split stays local
        for peer, count in enumerate(splits):
            if peer != self.rank:
                self._to(peer, row_bytes * count)
        with self._op("all_to_all_single", sent, nbytes(inp), inp.device):
            dist.all_to_all_single(out, inp.contiguous(), output_split_sizes=output_split_sizes,
                                   input_split_sizes=input_split_sizes, group=self.group)
        return out

    def broadcast(self, t: Tensor, src: int) -> Tensor:
        """Copy rank `src`'s t to every rank, in place."""
        import torch.distributed as dist

        if self.world_size == 1:
            return t
        sent = broadcast_sent(nbytes(t), self.rank, src, self.world_size)
        self._to(self._next(), sent)
        with self._op("broadcast", sent, nbytes(t), t.device):
            dist.broadcast(t, self._global(src), group=self.group)
        return t

    def send(self, t: Tensor, dst: int) -> None:
        import torch.distributed as dist

        self._to(dst, nbytes(t))
        with self._op("send", nbytes(t), nbytes(t), t.device):
            dist.send(t.contiguous(), self._global(dst), group=self.group)

    def recv(self, t: Tensor, src: int) -> Tensor:
        import torch.distributed as dist

        with self._op("recv", 0, nbytes(t), t.device):
            dist.recv(t, self._global(src), group=self.group)
        return t

    def batch_isend_irecv(self, ops: Sequence[P2P]) -> None:
        """Post every send and receive at once (no ordering deadlock), return when all are done."""
        if not ops:
            return
        sent = sum(nbytes(o.tensor) for o in ops if o.kind == "send")
        device = ops[0].tensor.device
        self._to_peers(ops)
        with self._op("batch_isend_irecv", sent, sent, device):
            for request in self._post(ops):
                request.wait()

    def start_batch_isend_irecv(self, ops: Sequence[P2P]) -> Pending:
        """Post every send and receive at once and return without waiting: the rank computes while they are
        in flight, then calls `wait()` on the result. Counted as batch_isend_irecv; its time in flight and the
        part of it hidden behind compute are measured (module docstring, "Overlap")."""
        if not ops or self.world_size == 1:
            return Pending([])
        sent = sum(nbytes(o.tensor) for o in ops if o.kind == "send")
        device = ops[0].tensor.device
        if not self.counting:
            return Pending(self._post(ops))
        self._to_peers(ops)
        stats = self._count("batch_isend_irecv", sent, sent)
        if device.type == "cuda":
            issue = torch.cuda.Event(enable_timing=True)
            issue.record()
            return Pending(self._post(ops), stats, events=(issue, None))
        t_issue = time.perf_counter()
        works = self._post(ops)
        t_post = time.perf_counter()
        return Pending(works, stats, t_issue=t_issue, t_post=t_post, waiter=start_waiter(works))

    def _to_peers(self, ops: Sequence[P2P]) -> None:
        for o in ops:
            if o.kind == "send":
                self._to(o.peer, nbytes(o.tensor))

    def _post(self, ops: Sequence[P2P]) -> list[Any]:
        import torch.distributed as dist

        p2p = [dist.P2POp(dist.isend if o.kind == "send" else dist.irecv, o.tensor, self._global(o.peer),
                          group=self.group, tag=o.tag) for o in ops]
        return list(dist.batch_isend_irecv(p2p))

    def _global(self, group_rank: int) -> int:
        """Rank numbers in ops are group ranks; torch.distributed wants global ones."""
        if self.group is None:
            return group_rank
        import torch.distributed as dist

        return dist.get_global_rank(self.group, group_rank)


# --- the communicator implementations use ----------------------------------------------------------------

_CURRENT = Communicator()


def current() -> Communicator:
    """The communicator of the case being measured (single-process outside a distributed measurement)."""
    return _CURRENT


@contextlib.contextmanager
def use(comm: Communicator) -> Iterator[Communicator]:
    """Make `comm` the current communicator inside the block."""
    global _CURRENT
    before, _CURRENT = _CURRENT, comm
    try:
        yield comm
    finally:
        _CURRENT = before
