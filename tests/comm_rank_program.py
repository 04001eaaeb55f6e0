"""One rank of tests/test_comm.py: run every counted collective once on gloo, print what was counted.

Usage: python -m tests.comm_rank_program RANK WORLD_SIZE STORE_PORT. Prints one JSON line: for each op the
values it produced (checked here against what the op must give) and the counters' snapshot; then the same
for the differentiable ops in bench.comm_autograd, forward and backward.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from bench.comm import P2P, Communicator, use
from bench.comm_autograd import all_gather, all_to_all, copy_to_ranks, reduce_from_ranks, ring_shift


def counted(comm: Communicator, fn) -> tuple[bool, dict]:
    comm.reset()
    ok = bool(fn())
    return ok, comm.snapshot()


def two_shifts_in_flight(comm: Communicator) -> bool:
    """Two shifts in flight at once (tags tell them apart), compute in between, under a level."""
    r, p = comm.rank, comm.world_size
    a, b = torch.full((4,), float(r)), torch.full((6,), float(10 * r))
    got_a, got_b = torch.empty(4), torch.empty(6)
    with comm.level("ring"):
        first = comm.start_batch_isend_irecv([P2P("send", a, (r + 1) % p, 1), P2P("recv", got_a, (r - 1) % p, 1)])
        second = comm.start_batch_isend_irecv([P2P("send", b, (r + 1) % p, 2),
                                               P2P("recv", got_b, (r - 1) % p, 2)])
    x = torch.randn(200, 200)
    for _ in range(20):
        x = torch.tanh(x @ x)
    second.wait()
    first.wait()
    first.wait()  # twice: harmless
    return (torch.equal(got_a, torch.full((4,), float((r - 1) % p)))
            and torch.equal(got_b, torch.full((6,), float(10 * ((r - 1) % p)))) and bool(torch.isfinite(x).all()))


def collectives(comm: Communicator) -> dict:
    r, p = comm.rank, comm.world_size
    out = {}

    def all_reduce():
        x = torch.full((10,), float(r + 1))  # 10 elements: uneven ring chunks for P = 4
        return torch.equal(comm.all_reduce(x), torch.full((10,), p * (p + 1) / 2))

    def gather():
        got = comm.all_gather_into_tensor(torch.empty(3 * p), torch.full((3,), float(r)))
        return torch.equal(got, torch.arange(p).float().repeat_interleave(3))

    def scatter():
        got = comm.reduce_scatter_tensor(torch.empty(2), torch.arange(2 * p).float() * (r + 1))
        return torch.equal(got, torch.arange(2 * r, 2 * r + 2).float() * (p * (p + 1) / 2))

    def a2a():  # uneven: rank r sends d + 1 rows (of 2 values) to rank d, receives r + 1 rows from each
        send = torch.cat([torch.full((d + 1, 2), float(100 * r + d)) for d in range(p)])
        got = comm.all_to_all_single(torch.empty((r + 1) * p, 2), send, [r + 1] * p, [d + 1 for d in range(p)])
        return torch.equal(got, torch.cat([torch.full((r + 1, 2), float(100 * s + r)) for s in range(p)]))

    def bcast():
        return torch.equal(comm.broadcast(torch.full((5,), float(r)), src=1), torch.ones(5))

    def point_to_point():
        if r == 0:
            comm.send(torch.full((7,), 3.0), dst=1)
            return True
        if r == 1:
            return torch.equal(comm.recv(torch.empty(7), src=0), torch.full((7,), 3.0))
        return True

    def shift():
        got = torch.empty(4)
        comm.batch_isend_irecv([P2P("send", torch.full((4,), float(r)), (r + 1) % p),
                                P2P("recv", got, (r - 1) % p)])
        return torch.equal(got, torch.full((4,), float((r - 1) % p)))

    for name, fn in [("all_reduce", all_reduce), ("all_gather_into_tensor", gather),
                     ("reduce_scatter_tensor", scatter), ("all_to_all_single", a2a), ("broadcast", bcast),
                     ("send_recv", point_to_point), ("batch_isend_irecv", shift)]:
        out[name] = counted(comm, fn)
    comm.reset()
    ok = two_shifts_in_flight(comm)
    out["started"] = (ok, comm.snapshot(), comm.levels_snapshot())
    comm.reset()
    with comm.paused():
        comm.all_reduce(torch.ones(8))
        out["paused"] = comm.snapshot()
    return out


def differentiable(comm: Communicator) -> dict:
    r, p = comm.rank, comm.world_size
    out = {}

    def gather_grad():
        x = torch.full((2, 3), float(r), requires_grad=True)
        y = all_gather(x)  # (P, 2, 3)
        (y * (torch.arange(p).float() + 1)[:, None, None]).sum().backward()  # d/dx_r = P * (r + 1)
        return torch.equal(y.detach()[:, 0, 0], torch.arange(p).float()) and torch.equal(
            x.grad, torch.full((2, 3), float(p * (r + 1))))

    def shift_grad():
        x = torch.full((4,), float(r), requires_grad=True)
        y = ring_shift(x)  # rank r - 1's x
        (y * (r + 1)).sum().backward()  # x_r reaches rank r + 1, weighted (r + 2)
        return torch.equal(y.detach(), torch.full((4,), float((r - 1) % p))) and torch.equal(
            x.grad, torch.full((4,), float((r + 1) % p + 1)))

    def a2a_grad():
        x = torch.full((p * 2, 1), float(r), requires_grad=True)  # 2 rows to each rank
        y = all_to_all(x, [2] * p, [2] * p)  # rows from each source, in rank order
        (y * (r + 1)).sum().backward()  # rows sent to rank d come back weighted (d + 1)
        return torch.equal(x.grad[:, 0], (torch.arange(p).float() + 1).repeat_interleave(2))

    def tp_grad():  # copy_to_ranks: one all-reduce of both gradients; reduce_from_ranks: identity backward
        a = torch.ones(3, requires_grad=True)
        b = torch.ones(2, requires_grad=True)
        a2, b2 = copy_to_ranks(a, b)
        total = reduce_from_ranks(a2 * (r + 1)).sum() + (b2 * (r + 1)).sum()
        total.backward()
        s = p * (p + 1) / 2
        return torch.equal(a.grad, torch.full((3,), s)) and torch.equal(b.grad, torch.full((2,), s))

    for name, fn in [("all_gather", gather_grad), ("ring_shift", shift_grad), ("all_to_all", a2a_grad),
                     ("copy_reduce", tp_grad)]:
        out[name] = counted(comm, fn)
    return out


def main() -> None:
    rank, world, port = (int(a) for a in sys.argv[1:4])
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    comm = Communicator.from_group(dist.group.WORLD)
    with use(comm):
        result = {"rank": rank, "backend": comm.backend, "ops": collectives(comm), "autograd": differentiable(comm)}
    print(json.dumps(result), flush=True)
    # Every rank waits for the others before tearing down: a rank that leaves while a peer's last gloo op is
    # still in flight makes that peer abort at exit ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
