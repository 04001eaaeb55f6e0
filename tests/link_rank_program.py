"""One rank of tests/test_links.py: every distributed scheme's timed step once on gloo, the bytes sent per peer.

Usage: python -m tests.link_rank_program RANK WORLD_SIZE STORE_PORT NODES. NODES: this world's node of each
rank, comma-separated (a placement declared by hand: the counting does not depend on where ranks really run;
cp_usp reads it to place its groups). Prints one JSON line: {case label: {impl: {peer: bytes}}}.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch.distributed as dist

import impls  # noqa: F401 - registers the implementations
from bench import registry
from bench.comm import Communicator, use
from bench.measure.case.steps import call_inputs, timed_step
from bench.spec.case import Case

SCHEMES = ("tp_heads", "cp_ring", "cp_allgather", "cp_sparse", "cp_ulysses", "cp_usp")


def cases(world: int) -> dict[str, Case]:
    base = {"batch": 1, "heads": 4, "head_dim": 8, "seq_len": 32 * world // 2, "window": 8, "block_size": 4,
            "pattern": "local", "device": "cpu", "world_size": world}
    return {"fwd": Case(**base), "fwd_bwd": Case(**base, mode="fwd_bwd"),
            "zigzag": Case(**{**base, "pattern": "causal"}, mode="fwd_bwd", cp_layout="zigzag"),
            "gqa": Case(**{**base, "heads": 8}, kv_heads=world if world <= 4 else 4)}


def main() -> None:
    rank, world, port = (int(a) for a in sys.argv[1:4])
    nodes = [int(n) for n in sys.argv[4].split(",")]
    store = dist.TCPStore("127.0.0.1", port, world + 1, False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    comm = Communicator.from_group(dist.group.WORLD)
    comm.node_of_rank = nodes
    out: dict[str, dict[str, dict[str, int]]] = {}
    for label, case in cases(world).items():
        out[label] = {}
        for name in SCHEMES:
            impl = registry.get(name)
            with use(comm):
                if impl.unsupported(case):
                    continue
                q, k, v, grad_out = call_inputs(case)
                fn = impl.prepare(case, case.make_pattern(), q, k, v)
                shard = impl.shard(case, rank)
                step = timed_step(fn, q, k, v, grad_out,
                                  lambda r, g=grad_out, s=shard: g if r.shape == g.shape else s.take(g))
                comm.reset()
                step()
                out[label][name] = {str(p): b for p, b in comm.peers_snapshot().items()}
    dist.barrier()  # no rank tears down while a peer's last gloo op is in flight (it would abort at exit)
    dist.destroy_process_group()
    print(json.dumps({"rank": rank, "cases": out}))


if __name__ == "__main__":
    main()
