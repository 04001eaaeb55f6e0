"""Built-in implementations. Each module registers itself; importing one never requires another.

Optional dependencies are imported lazily inside the implementations, so a missing one makes that
implementation report itself unavailable instead of breaking `import impls`.
"""

from impls import dense, naive_loop, sdpa  # noqa: F401

# isort: split
from impls import cp_allgather, cp_ring, cp_sparse, tp_heads  # noqa: F401
