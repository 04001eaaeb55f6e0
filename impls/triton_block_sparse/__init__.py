"""`triton_block_sparse`: block-sparse attention in Triton, forward and backward.

kernels.py holds the Triton kernels, tables.py the lookup tables and masks they read, launch.py the launches,
autotuning and autograd, impl.py the registered implementation. Importing this package never imports
triton: that happens on first use, which is when interpreter or compiled mode is chosen.
"""

from impls.triton_block_sparse import impl  # noqa: F401 - registers the implementation
