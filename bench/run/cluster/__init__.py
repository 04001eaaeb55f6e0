"""Scaling a run out: the split of a run's pairs into shards (`shards`), `bench submit` and its watcher
(`submit`), the executors that start shards (`executors`: local processes, Slurm) and the Slurm task wrapper of
a rank group (`slurm_rank`)."""
