"""The `Pattern` base class: a predicate `allowed(i, j)` and every view of it.

A pattern is the q_len x seq_len matrix of allowed (query, key) pairs. Row r of it is position
i = r + seq_len - q_len (bottom-right alignment: decode and chunked prefill put the queries last); with
packed documents the predicate applies inside each document on positions relative to its start, and no pair
crosses documents. `mask(rows, cols)` is that matrix, element by element; every view an implementation uses
(bench.patterns.views: `dense_mask()`, `csr()`, `block_layout(bs)`, `block_sparse(bs)`, `density`,
`block_density(bs)`) is computed from it.
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar

import torch
from torch import Tensor

from bench.patterns import documents as docs
from bench.patterns.views import PatternViews

# Case fields a pattern may read. `make_pattern` accepts any of them; each pattern uses its own subset.
PATTERN_FIELDS = ("window", "density", "block_size", "dilation", "global_tokens", "seed", "prefix", "image_width")
# Short names in labels (`local_w64`, `block_random_p0.1_b64_s0`).
FIELD_SHORT = {"window": "w", "density": "p", "block_size": "b", "dilation": "d", "global_tokens": "g",
               "seed": "s", "prefix": "pre", "image_width": "iw"}


class PatternError(ValueError):
    """A pattern cannot take these fields, or its predicate misbehaved. Names the pattern and the field."""

    def __init__(self, pattern: str, field: str | None, message: str) -> None:
        self.pattern, self.field, self.message = pattern, field, message
        super().__init__(f"pattern {pattern}: {field}: {message}" if field else f"pattern {pattern}: {message}")


class Pattern(PatternViews):
    """A sparsity pattern. Subclasses define `allowed` over absolute positions, and their fields.

    `length_free`: the predicate never reads seq_len, so one instance serves documents of every length.
    A pattern that reads seq_len (neighborhood's image height) is evaluated per document by an instance of
    that document's length.
    """

    name: ClassVar[str] = ""
    fields: ClassVar[tuple[str, ...]] = ()
    description: ClassVar[str] = ""
    length_free: ClassVar[bool] = True
    source: ClassVar[str] = "built-in"

    def __init__(self, seq_len: int, *, q_len: int | None = None,
                 documents: int | list[int] | tuple[int, ...] | None = None, **fields: Any) -> None:
        def get(name: str, default: int) -> int:
            value = fields.get(name)
            return default if value is None else int(value)

        self.seq_len = int(seq_len)
        self.q_len = self.seq_len if q_len is None else int(q_len)
        self.q_offset = self.seq_len - self.q_len  # position of row 0
        self.window = get("window", 64)  # defaults as for a case (bench.case.Case)
        density = fields.get("density")
        self.p: Any = None if density is None else float(density)
        self.block_size = get("block_size", 64)
        self.dilation = get("dilation", 1)
        self.global_tokens = get("global_tokens", 0)
        self.seed = get("seed", 0)
        self.prefix = get("prefix", 0)
        width = fields.get("image_width")
        self.image_width: Any = None if width is None else int(width)
        self.documents_spec = tuple(documents) if isinstance(documents, list | tuple) else documents
        self.documents: tuple[int, ...] | None = None
        self._cache: dict[tuple, Any] = {}
        for field, message in self._structure_problems():
            raise PatternError(self.name, field, message)
        for field, message in self.problems():
            raise PatternError(self.name, field, message)
        lengths = sorted(set(self.documents)) if self.documents is not None else [self.seq_len]
        where = "documents" if self.documents is not None else None
        for length in lengths:
            for field, message in self.length_problems(length):
                if where:
                    message = f"a document of length {length}: {message}"
                raise PatternError(self.name, where or field, message)

    # --- definition -------------------------------------------------------------------------------

    def allowed(self, i: Tensor, j: Tensor) -> Tensor:
        """Bool tensor, broadcast over int64 query positions i and key positions j."""
        raise NotImplementedError

    def problems(self) -> list[tuple[str, str]]:
        """(field, message) for each field value this pattern cannot take; empty when valid."""
        out: list[tuple[str, str]] = []
        if "window" in self.fields and self.window < 1:
            out.append(("window", f"got {self.window}; must be >= 1"))
        if "dilation" in self.fields and self.dilation < 1:
            out.append(("dilation", f"got {self.dilation}; must be >= 1"))
        if "global_tokens" in self.fields and self.global_tokens < 0:
            out.append(("global_tokens", f"got {self.global_tokens}; must be >= 0"))
        if "block_size" in self.fields and self.block_size < 1:
            out.append(("block_size", f"got {self.block_size}; must be >= 1"))
        if "prefix" in self.fields and not 0 <= self.prefix <= self.seq_len:
            out.append(("prefix", f"got {self.prefix}; allowed: 0 to seq_len ({self.seq_len})"))
        if "density" in self.fields and self.p is None:
            out.append(("density", f"not set; pattern {self.name} needs a density in [0, 1]"))
        elif "density" in self.fields and not 0.0 <= self.p <= 1.0:
            out.append(("density", f"got {self.p}; pattern {self.name} needs a density in [0, 1]"))
        return out

    def length_problems(self, length: int) -> list[tuple[str, str]]:
        """Problems of the fields for a sequence (or document) of `length` positions, e.g. axial's R*C."""
        return []

    def _structure_problems(self) -> list[tuple[str, str]]:
        if self.seq_len < 1:
            return [("seq_len", f"got {self.seq_len}; must be >= 1")]
        if not 1 <= self.q_len <= self.seq_len:
            return [("q_len", f"got {self.q_len}; allowed: 1 to seq_len ({self.seq_len}), the last q_len "
                              "positions are the queries")]
        try:
            self.documents = docs.document_lengths(self.documents_spec, self.seq_len, self.seed)
        except ValueError as exc:
            return [("documents", str(exc))]
        return []

    def band(self) -> tuple[float, float] | None:
        """Range (lo, hi) of i - j outside which nothing is allowed (besides global tokens), if any."""
        return None

    def has_global_tokens(self) -> bool:
        """Whether some pairs outside `band()` are allowed (global tokens, sinks, a prefix)."""
        return "global_tokens" in self.fields and self.global_tokens > 0

    def params(self) -> dict[str, Any]:
        return {f: getattr(self, "p" if f == "density" else f) for f in self.fields}

    def field_values(self) -> dict[str, Any]:
        """Every pattern field as make_pattern takes it (to build a sibling of this pattern)."""
        return {f: getattr(self, "p" if f == "density" else f) for f in PATTERN_FIELDS}

    @property
    def label(self) -> str:
        """Series label carrying the parameters, e.g. `local_w64`, `block_random_p0.1_b64_s0`, `causal_docs8`."""
        parts = [self.name] + [f"{FIELD_SHORT[f]}{v:g}" if isinstance(v, float) else f"{FIELD_SHORT[f]}{v}"
                               for f, v in self.params().items()]
        if self.documents is not None:
            parts.append(docs.label_of(self.documents_spec, self.documents))  # type: ignore[arg-type]
        return "_".join(parts)

    def __repr__(self) -> str:
        q = f" q_len={self.q_len}" if self.q_len != self.seq_len else ""
        return f"<Pattern {self.label} N={self.seq_len}{q}>"

    # --- the matrix, element by element ------------------------------------------------------------

    def mask(self, rows: Tensor, cols: Tensor) -> Tensor:
        """Bool: may row `rows` of the q_len x seq_len matrix attend to key position `cols` (broadcast).

        rows in [0, q_len), cols in [0, seq_len), int64 tensors on any device.
        """
        try:
            out = self._matrix(rows, cols)
        except PatternError:
            raise
        except Exception as exc:
            raise PatternError(self.name, None, f"the predicate ({self.source}) raised "
                                                f"{type(exc).__name__}: {exc}") from exc
        shape = torch.broadcast_shapes(rows.shape, cols.shape)
        if not isinstance(out, Tensor) or out.dtype != torch.bool:
            got = f"a {out.dtype} tensor" if isinstance(out, Tensor) else type(out).__name__
            raise PatternError(self.name, None, f"the predicate ({self.source}) returned {got}; it must return a "
                                                "bool tensor broadcast over the query and key indices")
        if out.shape != shape:
            try:
                out = out.expand(shape)
            except RuntimeError:
                raise PatternError(self.name, None, f"the predicate ({self.source}) returned shape "
                                                    f"{tuple(out.shape)} for indices broadcast to "
                                                    f"{tuple(shape)}") from None
        return out

    def _matrix(self, rows: Tensor, cols: Tensor) -> Tensor:
        """`mask` without its checks: the form compiled FlexAttention mask_mods trace."""
        i = rows + self.q_offset
        if self.documents is None:
            return self.allowed(i, cols)
        index = self._document_index(rows.device)
        last = self.seq_len - 1
        di = index.doc_id[i.clamp(0, last)]  # FlexAttention also asks about padding past the sequence
        dj = index.doc_id[cols.clamp(0, last)]
        start = index.start[di]
        rel_i, rel_j = i - start, cols - start  # rel_j is meaningful where the documents are the same
        if self.length_free:
            inner = self.allowed(rel_i, rel_j)
        else:
            lengths = index.length[di]
            inner = torch.zeros(torch.broadcast_shapes(rows.shape, cols.shape), dtype=torch.bool,
                                device=rows.device)
            for length, base in self._bases().items():
                inner = inner | ((lengths == length) & base.allowed(rel_i, rel_j))
        return (di == dj) & inner

    def _document_index(self, device: torch.device) -> docs.DocumentIndex:
        key = ("documents", str(device))
        if key not in self._cache:
            assert self.documents is not None
            self._cache[key] = docs.DocumentIndex.of(self.documents, device)
        return self._cache[key]

    def _bases(self) -> dict[int, Pattern]:
        """One instance of this pattern per distinct document length (patterns that read seq_len)."""
        if ("bases",) not in self._cache:
            assert self.documents is not None
            self._cache[("bases",)] = {n: type(self)(n, **self.field_values()) for n in sorted(set(self.documents))}
        return self._cache[("bases",)]

    def fresh(self) -> Pattern:
        """The same pattern with none of its views built yet (each implementation builds its own in prepare)."""
        clone = copy.copy(self)
        clone._cache = {}
        return clone

    def with_tensor_fields(self, device: torch.device | str) -> Pattern:
        """A copy whose fields are 0-dim tensors on `device` (density float64, the rest int64).

        Its `_matrix` is the same predicate (the predicates are elementwise torch ops, so they take tensor
        fields as they take ints), but under torch.compile the values become graph inputs, so one compiled
        graph serves every value. Document tables are moved to `device` too.
        """
        clone = copy.copy(self)
        clone._cache = {}
        for field in self.fields:
            attr = "p" if field == "density" else field
            dtype = torch.float64 if attr == "p" else torch.int64
            setattr(clone, attr, torch.tensor(getattr(self, attr), dtype=dtype, device=device))
        clone.q_offset = torch.tensor(self.q_offset, dtype=torch.int64, device=device)
        if self.documents is not None:
            index = self._document_index(torch.device("cpu")).to(device)
            clone._cache[("documents", str(torch.device(device)))] = index
            if not self.length_free:
                clone._cache[("bases",)] = {n: b.with_tensor_fields(device) for n, b in self._bases().items()}
        return clone

    def probe(self) -> None:
        """Evaluate the predicate at a few pairs (the corners and the middle); raises PatternError on a fault."""
        rows = torch.unique(torch.tensor([0, 1, self.q_len // 2, self.q_len - 1]).clamp(0, self.q_len - 1))
        cols = torch.unique(torch.tensor([0, 1, self.seq_len // 2, self.seq_len - 1]).clamp(0, self.seq_len - 1))
        self.mask(rows[:, None], cols[None, :])
