"""Sparsity patterns, each defined once as a predicate `allowed(i, j)` over query and key positions.

This is a public module: plugins import `Pattern`, `register_pattern` and `register_mask_mod` from here, and
`make_pattern` builds any pattern of the table (docs/DESIGN.md "Patterns"). Every view an implementation
uses - `dense_mask()`, `csr()`, `block_layout(bs)`, `block_sparse(bs)`, `density`, `block_density(bs)` - is
computed from the predicate, so no implementation invents its own semantics.
"""

from bench.patterns import builtin as _builtin  # noqa: F401 - fills the table
from bench.patterns.base import FIELD_SHORT, PATTERN_FIELDS, Pattern, PatternError
from bench.patterns.builtin import (
    Axial,
    BigBird,
    BlockRandom,
    Causal,
    CausalLocal,
    Dense,
    Dilated,
    Local,
    Longformer,
    Neighborhood,
    PrefixLM,
    Random,
    Sink,
    Strided,
)
from bench.patterns.documents import document_lengths
from bench.patterns.hashing import hash_keep, keep_threshold, seed_key
from bench.patterns.registry import PATTERNS, MaskModPattern, make_pattern, register_mask_mod, register_pattern
from bench.patterns.score_mods import (
    SCORE_MODS,
    ScoreMod,
    ScoreModError,
    alibi_slopes,
    make_score_mod,
    register_score_mod,
    score_mod_names,
    t5_bucket,
)
from bench.patterns.views import BlockSparse

__all__ = [
    "FIELD_SHORT",
    "PATTERNS",
    "PATTERN_FIELDS",
    "SCORE_MODS",
    "Axial",
    "BigBird",
    "BlockRandom",
    "BlockSparse",
    "Causal",
    "CausalLocal",
    "Dense",
    "Dilated",
    "Local",
    "Longformer",
    "MaskModPattern",
    "Neighborhood",
    "Pattern",
    "PatternError",
    "PrefixLM",
    "Random",
    "ScoreMod",
    "ScoreModError",
    "Sink",
    "Strided",
    "alibi_slopes",
    "document_lengths",
    "hash_keep",
    "keep_threshold",
    "make_pattern",
    "make_score_mod",
    "register_mask_mod",
    "register_pattern",
    "register_score_mod",
    "score_mod_names",
    "seed_key",
    "t5_bucket",
]
