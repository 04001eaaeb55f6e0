"""Built-in implementations. Each module registers itself; importing one never requires another.

Optional dependencies are imported lazily inside the implementations, so a missing one makes that
implementation report itself unavailable instead of breaking `import impls`.
"""

import impls.triton_block_sparse  # noqa: F401
from impls import dense, naive_loop, sdpa  # noqa: F401
