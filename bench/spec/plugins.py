"""Plugins: modules a suite names under `plugins:`, imported before implementations and patterns are resolved.

A plugin is an importable module name or a `.py` file relative to the suite file. Whatever it registers
(implementations with `bench.registry.register`, patterns with `bench.patterns.register_pattern` or
`register_mask_mod`) remembers where it came from, so that `bench list` can say so: `source_of(module)`.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path

from bench.errors import BadInput

# Module name -> how the user named it ("plugin tests/plugins/faulty.py", "plugin my_kernels").
_PLUGIN_MODULES: dict[str, str] = {}


def source_of(module: str) -> str:
    """Where code defined in `module` comes from: built-in, a plugin the suite names, or another module."""
    if module == "impls" or module.startswith(("impls.", "bench.")):
        return "built-in"
    top = module.split(".")[0]
    for name in (module, top):
        if name in _PLUGIN_MODULES:
            return _PLUGIN_MODULES[name]
    return f"module {module}"


def load_plugin(spec: str, *, base_dir: Path | None, file: str, field: str) -> None:
    """Import one plugin: a `.py` file relative to the suite file, or an importable module name.

    Raises BadInput naming the file and field when the plugin is missing or fails to import (a clash of
    names with a registered implementation or pattern is such a failure).
    """
    if spec.endswith(".py"):
        base = base_dir if base_dir is not None else Path.cwd()
        target = (base / spec).resolve()
        if not target.is_file():
            raise BadInput(f"got {spec!r}; no such file relative to {base}", file=file, field=field)
        # One module per file, whatever the suite that names it, so a plugin is imported once per process.
        module_name = "bench_plugin_" + hashlib.sha1(str(target).encode()).hexdigest()[:12]
        if module_name in sys.modules:
            return
        loader_spec = importlib.util.spec_from_file_location(module_name, target)
        if loader_spec is None or loader_spec.loader is None:
            raise BadInput(f"got {spec!r}; not a loadable Python file", file=file, field=field)
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[module_name] = module
        _PLUGIN_MODULES[module_name] = f"plugin {spec}"
        try:
            loader_spec.loader.exec_module(module)
        except Exception as exc:
            del sys.modules[module_name]
            raise BadInput(f"plugin {spec!r} failed to import: {type(exc).__name__}: {exc}",
                           file=file, field=field) from None
        return
    _PLUGIN_MODULES.setdefault(spec.split(".")[0], f"plugin {spec}")
    try:
        importlib.import_module(spec)
    except Exception as exc:
        raise BadInput(f"got {spec!r}; cannot import module: {type(exc).__name__}: {exc}; allowed: an "
                       "importable module name or a .py file relative to the suite file",
                       file=file, field=field) from None


ENTRY_POINT_GROUP = "sparse_attention_bench.plugins"
_entry_points_loaded = False


def load_entry_points() -> None:
    """Import every installed plugin package's entry point in ENTRY_POINT_GROUP, once per process.

    A package declares it in its pyproject.toml:

        [project.entry-points."sparse_attention_bench.plugins"]
        my_kernel = "my_kernel.bench_plugin"

    and `pip install my-kernel` makes what that module registers available without a `plugins:` line. Raises
    BadInput naming the entry point when its module fails to import.
    """
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    from importlib.metadata import entry_points

    for point in entry_points(group=ENTRY_POINT_GROUP):
        distribution = getattr(point.dist, "name", None) or "an installed package"
        _PLUGIN_MODULES.setdefault(point.value.split(":")[0].split(".")[0],
                                   f"package {distribution} (entry point {point.name})")
        try:
            point.load()
        except Exception as exc:
            _entry_points_loaded = False  # the next caller sees the same error
            raise BadInput(f"the plugin package {distribution} failed to import: {type(exc).__name__}: {exc}",
                           file=f"entry point {point.name} = {point.value}", field=ENTRY_POINT_GROUP) from None
