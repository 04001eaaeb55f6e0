"""One task of a rank group that `bench submit --nodes-per-rank-group K` launches with srun across K nodes:
Slurm's task variables become the launcher variables torchrun would set, then `bench run` runs as under
torchrun (bench.run.torchrun: rank 0 leads, the others follow).

Usage (in the batch script, after MASTER_ADDR and MASTER_PORT are exported): srun python -m bench.run.cluster.slurm_rank
run SUITE --shard G/N --rank-group-shards --run-id ID --out DIR
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping


def launcher_env(slurm: Mapping[str, str]) -> dict[str, str]:
    """RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and GROUP_RANK (the node: bench.measure.machine.topology) from
    srun's SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, the tasks per node and SLURM_NODEID."""
    missing = [k for k in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID", "MASTER_ADDR",
                           "MASTER_PORT") if k not in slurm]
    if missing:
        raise SystemExit(f"bench.run.cluster.slurm_rank: {', '.join(missing)} not set; run it with srun inside the "
                         "batch script `bench submit` writes")
    tasks, nodes = int(slurm["SLURM_NTASKS"]), int(slurm.get("SLURM_JOB_NUM_NODES", slurm.get("SLURM_NNODES", "1")))
    return {"RANK": slurm["SLURM_PROCID"], "WORLD_SIZE": str(tasks), "LOCAL_RANK": slurm["SLURM_LOCALID"],
            "LOCAL_WORLD_SIZE": str(tasks // max(nodes, 1)), "GROUP_RANK": slurm["SLURM_NODEID"]}


def main() -> int:
    os.environ.update(launcher_env(os.environ))
    # `bench` itself in this process's place (bench.run sits below the command line it would import)
    os.execv(sys.executable, [sys.executable, "-m", "bench", *sys.argv[1:]])
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
