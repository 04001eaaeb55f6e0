"""Benchmarking and profiling suite for sparse attention.

Data flows one way: suite -> cases -> runner -> (impl, timing, memory, comm) -> records -> store ->
compare / dashboard. See docs/DESIGN.md for the contracts between those parts.
"""

__version__ = "0.1.0"
