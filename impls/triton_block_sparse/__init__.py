"""`triton_block_sparse`: block-sparse attention in Triton, forward and backward.

kernels.py holds the Triton kernels, tables.py the lookup tables and masks they read, mode.py the choice of
interpreter or compiled kernels, launch.py the launches, autotuning and autograd, impl.py the registered
implementation. Importing this package never imports triton, but it sets TRITON_INTERPRET=1 on a machine without
CUDA: Triton fixes the mode of its own library functions (tl.zeros, ...) when it is first imported, so the mode
must be set before anything in the process (FlexAttention's compiler, the environment capture) imports it.
"""

from impls.triton_block_sparse import mode

mode.choose_mode_before_triton_imports()

from impls.triton_block_sparse import impl  # noqa: E402, F401 - registers the implementation
