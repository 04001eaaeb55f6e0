"""The callables of a dataset: a definition's reference `run()` and a Solution's entry point.

A Solution carries its sources in its JSON; they are written once into a directory named by their content
(under the system's temporary directory, so every process of a run - the worker, the fresh memory processes -
finds the same files) and the entry file is imported from there as a module of its own, with that directory on
sys.path so that the solution's other files import as it expects. Only python and triton solutions load:
cpp, cuda and tilelang need a build step that is FlashInfer-Bench's.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import tempfile
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.interop.flashinfer.schema import Definition, Language, Solution

LOADABLE = (Language.PYTHON, Language.TRITON)
_REFERENCES: dict[str, Callable[..., Any]] = {}
_ENTRIES: dict[str, Callable[..., Any]] = {}


class EntryError(Exception):
    """A definition's reference or a solution's entry point that cannot be loaded: `field` names where."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.message, self.field = message, field


def reference_run(definition: Definition) -> Callable[..., Any]:
    """The definition's reference `run`, its code executed once per process in a module of its own."""
    key = hashlib.sha1(f"{definition.name}\0{definition.reference}".encode()).hexdigest()
    if key not in _REFERENCES:
        module = types.ModuleType(f"flashinfer_reference_{key[:12]}")
        try:
            exec(compile(definition.reference, f"<reference of {definition.name}>", "exec"), module.__dict__)
        except Exception as exc:
            raise EntryError(f"the reference code raised {type(exc).__name__}: {exc}", "reference") from None
        _REFERENCES[key] = module.__dict__["run"]
    return _REFERENCES[key]


def solution_key(solution: Solution) -> str:
    """A digest of what a solution runs: its name, definition, entry point and sources."""
    digest = hashlib.sha1()
    for part in (solution.name, solution.definition, solution.spec.entry_point,
                 *(p for s in solution.sources for p in (s.path, s.content))):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()


def sources_dir(solution: Solution) -> Path:
    """The directory holding the solution's sources (written if absent)."""
    directory = Path(tempfile.gettempdir()) / "sparse-attention-bench" / "flashinfer-solutions" / solution_key(solution)
    for source in solution.sources:
        path = directory / source.path
        if not path.is_file() or path.read_text(encoding="utf-8") != source.content:
            path.parent.mkdir(parents=True, exist_ok=True)
            staged = path.with_name(f".{path.name}.{id(source)}.tmp")
            staged.write_text(source.content, encoding="utf-8")
            staged.replace(path)  # whole files only: another process may be importing it
    return directory


def solution_run(solution: Solution) -> Callable[..., Any]:
    """The solution's entry function, imported once per process. Raises EntryError naming the field."""
    key = solution_key(solution)
    if key in _ENTRIES:
        return _ENTRIES[key]
    if solution.spec.language not in LOADABLE:
        raise EntryError(f"language {solution.spec.language.value}: only python and triton solutions load here "
                         "(the others need FlashInfer-Bench's build)", "spec.language")
    directory = sources_dir(solution)
    path = directory / solution.entry_file
    if path.suffix != ".py":
        raise EntryError(f"got {solution.spec.entry_point!r}; a python or triton entry point is a .py file",
                         "spec.entry_point")
    name = f"flashinfer_solution_{key[:12]}"
    loader = importlib.util.spec_from_file_location(name, path)
    assert loader is not None and loader.loader is not None
    module = importlib.util.module_from_spec(loader)
    if str(directory) not in sys.path:
        sys.path.insert(0, str(directory))
    sys.modules[name] = module
    try:
        loader.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise EntryError(f"{solution.entry_file} failed to import: {type(exc).__name__}: {exc}",
                         "sources") from None
    fn = getattr(module, solution.entry_symbol, None)
    if not callable(fn):
        defined = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise EntryError(f"got {solution.spec.entry_point!r}; {solution.entry_file} defines no function "
                         f"{solution.entry_symbol!r} (it defines {', '.join(defined) or 'none'})", "spec.entry_point")
    _ENTRIES[key] = fn
    return fn
