"""Interpreter or compiled, decided once per process.

Without CUDA (or with TRITON_INTERPRET=1 already set) the kernels are built as Triton interpreter functions, which
run on CPU tensors. Triton reads TRITON_INTERPRET when `@triton.jit` runs - for its own library functions
(tl.zeros, ...) when triton.language is first imported - and its interpreter reads it again while launching, so in
interpreter mode it is set for the rest of the process, as early as the package import
(`choose_mode_before_triton_imports`).
"""

from __future__ import annotations

import os
import sys
from types import ModuleType

import torch

_kernels: ModuleType | None = None


def uses_interpreter() -> bool:
    """Whether this process runs (or will run) the kernels in the Triton interpreter."""
    if _kernels is not None:
        return _is_interpreted(_kernels)
    interpret_env = os.environ.get("TRITON_INTERPRET", "").strip().lower()
    if interpret_env in ("0", "false", "off", "no"):  # compiled kernels asked for (compile_check without a GPU)
        return False
    return interpret_env in ("1", "true", "on", "yes") or not torch.cuda.is_available()


def choose_mode_before_triton_imports() -> None:
    """Set TRITON_INTERPRET=1 now when this process will need the interpreter and triton is not yet imported."""
    if "triton" not in sys.modules and uses_interpreter():
        os.environ["TRITON_INTERPRET"] = "1"


def kernels() -> ModuleType:
    """The kernels module, imported on first use as interpreter functions when `uses_interpreter()`."""
    global _kernels
    if _kernels is None:
        if uses_interpreter():
            os.environ["TRITON_INTERPRET"] = "1"
            _require_interpreted_library()
        from impls.triton_block_sparse import kernels as module

        _kernels = module
    return _kernels


def _require_interpreted_library() -> None:
    """Triton imported before TRITON_INTERPRET=1 was set has compiled-mode library functions the interpreter
    cannot call ("Cannot call @triton.jit'd outside of the scope of a kernel"): say so instead."""
    if "triton.language" not in sys.modules:
        return
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.zeros, InterpretedFunction):
        raise RuntimeError("triton was imported in this process before TRITON_INTERPRET=1 was set, so its library "
                           "functions are compiled-mode and the interpreter cannot run them: import impls (or set "
                           "TRITON_INTERPRET=1) before anything imports triton")


def _is_interpreted(module: ModuleType) -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(module.attn_fwd, InterpretedFunction)
