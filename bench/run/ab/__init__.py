"""`bench ab`: two checkouts measured side by side in interleaved blocks (`command`), the pairs measured on both
sides (`pairs`), each side's worker and its protocol (`side`, `suite`), and the temporary git worktrees with the
janitor that removes them (`worktrees`, `janitor`). The verdicts are `bench.analysis.ab`'s."""
