"""Built-in implementations. Each module registers itself; importing one never requires another.

Optional dependencies are imported lazily inside the implementations, so a missing one makes that
implementation report itself unavailable instead of breaking `import impls`.
"""

from impls import (  # noqa: F401
    blocked,
    cp_allgather,
    cp_ring,
    cp_sparse,
    cp_ulysses,
    cp_usp,
    csr,
    dense,
    flex,
    naive_loop,
    sdpa,
    tp_heads,
    triton_block_sparse,
)
