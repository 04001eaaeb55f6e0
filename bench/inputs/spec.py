"""The case field `inputs`: which q, k, v a case's implementations and the oracle see.

Three kinds (docs/DESIGN.md "Inputs"):

- `random` (the default): independent standard normals, drawn from the case's seed. Their attention is nearly
  flat, which is fine for static masks and useless for selectors that choose keys from the inputs.
- `structured`: the seeded generator of `bench.inputs.structured`, whose attention has sinks, RoPE's decay with
  distance, heavy hitters and planted needles. Written `structured`, or `{kind: structured, <knob>: value}`.
- a file of captured tensors: `{file: PATH, layer: L}`, a safetensors file in the layout of `bench.inputs.files`
  (written by `bench capture`). PATH is relative to the suite file; the suite resolves it and records the file's
  sha256, which a case's id digests in place of the path (the same file gives the same id on every machine).
- a FlashInfer-Bench workload: `{kind: flashinfer, root: DIR, definition: NAME, workload: UUID}`, read by
  `bench.inputs.flashinfer` (`bench import flashinfer-trace` writes such cases); DIR relative to the suite file.

`InputsSpec` is the frozen, hashable form a `Case` holds; `to_param()` is the form records and suites write.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

InputsKind = Literal["random", "structured", "file", "flashinfer"]
INPUT_KINDS: tuple[str, ...] = ("random", "structured", "file", "flashinfer")


class StructuredKnobs(BaseModel):
    """The structured generator's knobs (docs/DESIGN.md "Inputs" says what each does to the attention).

    Logit knobs are in units of the scaled score q.k/sqrt(D): a key whose logit is larger by x gets e^x times
    the weight. Defaults give, at N = 16K with GQA 32/8 and D = 128, attention statistics in the range published
    for LLMs (docs/DESIGN.md cites the figures matched).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["structured"] = "structured"
    rope_theta: float = Field(500_000.0, gt=1.0)  # RoPE base (Llama 3: 500000; Llama 2: 10000)
    noise: float = Field(1.0, ge=0.0)  # std of the logits' random part (q, k drawn with that product spread)
    sinks: int = Field(4, ge=0)  # the first `sinks` tokens are attention sinks (StreamingLLM keeps 4)
    sink_logit: float = Field(8.0, ge=0.0)  # logit every query adds to a sink token
    local_logit: float = Field(8.0, ge=0.0)  # logit at distance 0 of the shared RoPE component (decays with it)
    # how the local component's energy spreads over RoPE's pairs: theta_i^locality (0: evenly, a slow decay; 1: on
    # the fast pairs, a sharp decay with stronger stripes at the distances where their phases meet again)
    locality: float = Field(0.5, ge=0.0)
    heavy_hitters: float = Field(0.002, ge=0.0, le=0.5)  # share of keys that are heavy hitters (at least one)
    heavy_logit: float = Field(5.0, ge=0.0)  # logit a query adds to a heavy-hitter key
    needles: int = Field(8, ge=0)  # planted needle spans
    needle_len: int | None = Field(None, ge=1)  # tokens per needle (null: the case's block_size)
    needle_queries: int = Field(16, ge=1)  # query rows that attend to each needle
    needle_logit: float = Field(12.0, ge=0.0)  # logit a needle's queries add to its keys
    temperature: float = Field(1.0, gt=0.0)  # divides every logit: > 1 flattens the rows, < 1 sharpens them
    local_heads: float = Field(0.5, ge=0.0, le=1.0)  # share of KV heads that are local (the rest global or mixed)
    global_heads: float = Field(0.25, ge=0.0, le=1.0)  # share of KV heads that are global


KNOB_NAMES: tuple[str, ...] = tuple(k for k in StructuredKnobs.model_fields if k != "kind")


class FileInputsModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["file"] = "file"
    file: str = Field(min_length=1)
    layer: int
    sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")  # pins the file's content when given


class FlashInferInputsModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["flashinfer"] = "flashinfer"
    root: str = Field(min_length=1)  # the dataset's root directory
    definition: str = Field(min_length=1)
    workload: str = Field(min_length=1)  # the workload's uuid
    sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")  # pins the workload's tensor file(s)


class InputsError(ValueError):
    """A bad `inputs` value: `field` is the path below `inputs` (`sinks`, `layer`), or None for the whole."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.message, self.field = message, field


@dataclass(frozen=True)
class InputsSpec:
    """A case's inputs, hashable. `knobs`: the structured knobs written (the others take their defaults)."""

    kind: InputsKind = "random"
    knobs: tuple[tuple[str, Any], ...] = ()
    file: str | None = None  # absolute once a suite resolved it (flashinfer: the dataset's root)
    layer: int | None = None
    sha256: str | None = None  # the file's content, read when the suite was loaded
    workload: tuple[str, str] | None = None  # flashinfer: (definition, workload uuid)

    @classmethod
    def parse(cls, value: Any) -> InputsSpec:
        """`random`, `structured`, a mapping (`{kind: structured, ...}`, `{file: PATH, layer: L}`), or an
        InputsSpec. Raises InputsError naming the bad key and what is allowed."""
        if isinstance(value, InputsSpec):
            return value
        if value is None:
            return cls()
        if isinstance(value, str):
            if value in ("random", "structured"):
                return cls(kind=value)  # type: ignore[arg-type]
            raise InputsError(f"got {value!r}; allowed: 'random', 'structured', {{kind: structured, <knob>: "
                              "value}, or {file: PATH, layer: L}")
        if not isinstance(value, dict):
            raise InputsError(f"got {type(value).__name__}; allowed: 'random', 'structured', or a mapping")
        kind = value.get("kind", "file" if "file" in value else None)
        if kind == "random" and set(value) == {"kind"}:
            return cls()
        if kind == "structured":
            knobs = _validated(StructuredKnobs, value)
            written = tuple(sorted((k, getattr(knobs, k)) for k in value if k != "kind"))
            return cls(kind="structured", knobs=written)
        if kind == "file":
            model = _validated(FileInputsModel, value)
            return cls(kind="file", file=model.file, layer=model.layer, sha256=model.sha256)
        if kind == "flashinfer":
            fib = _validated(FlashInferInputsModel, value)
            return cls(kind="flashinfer", file=fib.root, sha256=fib.sha256, workload=(fib.definition, fib.workload))
        raise InputsError(f"got kind {kind!r}; allowed kinds: {', '.join(INPUT_KINDS)} (a mapping with `file` "
                          "is a file; `kind: flashinfer` takes root, definition and workload; `kind: structured` "
                          "takes the generator's knobs: "
                          f"{', '.join(KNOB_NAMES)})", field="kind")

    @property
    def structured(self) -> StructuredKnobs:
        """Every knob, the written ones over the defaults."""
        return StructuredKnobs(**dict(self.knobs))

    def to_param(self) -> str | dict[str, Any]:
        """As a suite writes it (a record's params): `random`, `structured`, or a mapping."""
        if self.kind == "file":
            return {"file": self.file, "layer": self.layer, "sha256": self.sha256}
        if self.kind == "flashinfer" and self.workload is not None:
            return {"kind": "flashinfer", "root": self.file, "definition": self.workload[0],
                    "workload": self.workload[1], "sha256": self.sha256}
        if self.knobs:
            return {"kind": self.kind, **dict(self.knobs)}
        return self.kind

    def digest_param(self) -> str | dict[str, Any]:
        """What a case id digests: the file by its content and layer, never by its path."""
        if self.kind == "file":
            return {"file_sha256": self.sha256, "layer": self.layer}
        if self.kind == "flashinfer" and self.workload is not None:
            return {"definition": self.workload[0], "workload": self.workload[1], "sha256": self.sha256}
        return self.to_param()

    def label(self) -> str:
        """'' for random inputs; `structured`, `structured*` (knobs changed), `capL12` (a captured layer)."""
        if self.kind == "random":
            return ""
        if self.kind == "structured":
            return "structured*" if self.knobs else "structured"
        if self.kind == "flashinfer":
            return "fib"
        return f"capL{self.layer}"


def _validated(model: type[BaseModel], value: dict[str, Any]) -> Any:
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or None
        if err["type"] == "extra_forbidden":
            allowed = [k for k in model.model_fields if k != "kind"]
            raise InputsError(f"unknown key; allowed keys here: kind, {', '.join(allowed)}", field=where) from None
        if err["type"] == "missing":
            raise InputsError("required key is missing", field=where) from None
        raise InputsError(f"got {err.get('input')!r}; {err['msg'].replace('Input should be', 'allowed:')}",
                          field=where) from None


class InputsInfo(BaseModel):
    """Where a case's q, k, v came from (bench.inputs): the kind, the seed, a captured file's path, content hash
    and layer, and the structured generator's planted needles (how many)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: InputsKind
    seed: int
    file: str | None = None
    file_sha256: str | None = None
    layer: int | None = None
    needles: int | None = None
