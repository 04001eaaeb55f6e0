"""The built-in fast selectors, one module each (the reference ones are in bench.selection.oracle)."""
