"""The built-in fast selectors, one module each (the reference ones are in bench.selection.oracle)."""

from bench.selection import dsa, moba, msa, nsa, quest, xattention  # noqa: F401 - each registers its selector
