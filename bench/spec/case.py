"""A case: one point of a sweep. Every field of docs/DESIGN.md's case table, with its default."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, TypedDict

import torch
from torch import Tensor

from bench.inputs import InputsShape, InputsSpec
from bench.models.spec import BUILTIN_MODELS, TaskSpec, TrainSpec, model_label, model_sha256
from bench.patterns import PATTERN_FIELDS, Pattern, ScoreMod, make_pattern, make_score_mod

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
MODES = ("fwd", "fwd_bwd")
DEVICES = ("auto", "cpu", "cuda")
_DTYPE_SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}

# Fields added after the first release. Left at their default they stay out of a case's id digest, so the
# cases of older suites keep their ids (and their history) across the addition.
LATER_FIELDS: dict[str, Any] = {"kv_heads": None, "q_len": None, "documents": None, "prefix": 0,
                                "image_width": None, "cp_layout": "contiguous", "ulysses_degree": None,
                                "inputs": "random", "selector": None, "budget": None, "threshold": None,
                                "page_size": None, "kv_lens": None, "score_mod": "none", "softcap": None,
                                "model": None, "task": None, "samples": 100, "layers": None, "train": None,
                                "sinks": None}
CP_LAYOUTS = ("contiguous", "zigzag")


class OracleTerms(TypedDict):
    """What the oracle applies beyond the pattern (`Case.oracle_terms`), as keywords of its functions."""

    score_mod: ScoreMod | None
    sinks: Tensor | None

RANDOM_INPUTS = InputsSpec()  # frozen: one shared default


@dataclass(frozen=True)
class Case:
    batch: int = 1
    heads: int = 4
    head_dim: int = 64
    seq_len: int = 1024
    dtype: str = "float32"
    pattern: str = "local"
    window: int = 64
    density: float | None = None
    block_size: int = 64
    dilation: int = 1
    global_tokens: int = 0
    seed: int = 0
    mode: str = "fwd"
    checkpoint: bool = False
    world_size: int = 1
    device: str = "auto"
    kv_heads: int | None = None  # None: = heads; fewer is grouped-query attention
    q_len: int | None = None  # None: = seq_len; the last q_len positions are the queries
    documents: int | tuple[int, ...] | None = None  # packed documents: a count or the lengths
    prefix: int = 0  # prefix_lm
    image_width: int | None = None  # neighborhood: tokens per image row
    cp_layout: str = "contiguous"  # sequence split over ranks: contiguous chunks, or zigzag (chunks r, 2P-1-r)
    ulysses_degree: int | None = None  # cp_usp: ranks per Ulysses group (None: its default)
    # q, k, v: random | structured | a captured file (bench.inputs); given as a suite writes it, held as InputsSpec
    inputs: InputsSpec = RANDOM_INPUTS
    # data-dependent sparse attention (bench.selection): the selector choosing key units from (q, k) under the
    # base `pattern`, and how many it keeps (a count, or a fraction of what the base allows) or the mass to reach
    selector: str | None = None
    budget: int | float | None = None
    threshold: float | None = None
    # decode caches (bench.inputs.paged): K/V in a pool of pages of page_size tokens with a page table per
    # sequence, and the keys of each sequence (a list of B lengths, or `random`: drawn from the seed)
    page_size: int | None = None
    kv_lens: tuple[int, ...] | str | None = None
    # what is done to the scaled scores before the mask (bench.patterns.score_mods): none, softcap (with the cap
    # `softcap`), alibi, relative_bias, or a registered name
    score_mod: str = "none"
    softcap: float | None = None
    # model quality (bench.models.spec): the language model the case's attention is swapped into (a built-in's
    # name or a resolved directory), its task, the samples scored, the layers swapped (None: all), and a
    # training run (R4 3/6)
    model: str | None = None
    task: TaskSpec | None = None
    samples: int = 100
    layers: tuple[int, ...] | None = None
    train: TrainSpec | None = None
    # learned attention sinks (gpt-oss, DeepSeek-V4): one logit per query head joining every row's softmax with a
    # zero value vector; `learned` (seeded N(0, 1)) or the logits themselves
    sinks: str | tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.task is not None and not isinstance(self.task, TaskSpec):
            object.__setattr__(self, "task", TaskSpec.parse(self.task))
        if isinstance(self.train, dict):
            object.__setattr__(self, "train", TrainSpec.model_validate(self.train))
        for name in ("documents", "kv_lens", "layers", "sinks"):  # frozen and hashable: lists as tuples
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        if isinstance(self.softcap, int) and not isinstance(self.softcap, bool):  # 50 and 50.0: one id
            object.__setattr__(self, "softcap", float(self.softcap))
        if not isinstance(self.inputs, InputsSpec):
            object.__setattr__(self, "inputs", InputsSpec.parse(self.inputs))

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def params(self) -> dict[str, Any]:
        """Every case field, in declaration order (the record's `params`); document lengths as a list."""
        out = asdict(self)
        for name in ("documents", "kv_lens", "layers", "sinks"):
            if isinstance(out[name], tuple):
                out[name] = list(out[name])
        out["inputs"] = self.inputs.to_param()
        out["task"] = self.task.to_param() if self.task is not None else None
        out["train"] = self.train.model_dump() if self.train is not None else None
        return out

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def n_kv_heads(self) -> int:
        """Heads of K and V: kv_heads, or heads without grouped-query attention."""
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def n_queries(self) -> int:
        """Query rows: q_len, or seq_len."""
        return self.seq_len if self.q_len is None else self.q_len

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.heads // self.n_kv_heads

    @property
    def element_bytes(self) -> int:
        """Bytes of one element of the case's dtype."""
        return ELEMENT_BYTES[self.dtype]

    def score_bytes(self, element_bytes: int = 4) -> int:
        """Bytes of one (B, H, q_len, N) score matrix (float32 by default: low precision accumulates in it)."""
        return self.batch * self.heads * self.n_queries * self.seq_len * element_bytes

    def q_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.heads, self.n_queries, self.head_dim)

    def kv_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.n_kv_heads, self.seq_len, self.head_dim)

    def inputs_shape(self) -> InputsShape:
        return InputsShape(self.batch, self.heads, self.n_kv_heads, self.seq_len, self.n_queries, self.head_dim,
                           self.block_size)

    def pattern_fields(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in PATTERN_FIELDS}

    def make_pattern(self) -> Pattern:
        return make_pattern(self.pattern, self.seq_len, q_len=self.q_len, documents=self.documents,
                            **self.pattern_fields())

    def make_score_mod(self) -> ScoreMod | None:
        """The case's score modification (None for `none`); ScoreModError names the field at fault."""
        fields = {k: v for k, v in self.params().items() if k not in ("heads", "seq_len", "q_len", "seed",
                                                                     "softcap", "score_mod")}
        return make_score_mod(self.score_mod, heads=self.heads, seq_len=self.seq_len, q_len=self.q_len,
                              seed=self.seed, softcap=self.softcap, **fields)

    def sink_logits(self) -> Tensor | None:
        """float64 (H,): the case's sink logit per query head (`learned`: drawn from N(0, 1) with the case's seed),
        or None without sinks."""
        if self.sinks is None:
            return None
        if self.sinks == "learned":
            return torch.randn(self.heads, generator=torch.Generator().manual_seed(self.seed * 7_727 + 1),
                               dtype=torch.float64)
        return torch.tensor([float(x) for x in self.sinks], dtype=torch.float64)

    def sinks_problem(self) -> str | None:
        """What is wrong with `sinks` (a list of another length than heads, a non-finite logit), or None."""
        if self.sinks is None or self.sinks == "learned":
            return None
        if isinstance(self.sinks, str):
            return f"got sinks {self.sinks!r}; sinks is `learned` or a list of one logit per query head"
        if len(self.sinks) != self.heads or not all(math.isfinite(float(x)) for x in self.sinks):
            return (f"got {len(self.sinks)} sink logits with heads {self.heads}; sinks is `learned` or one finite "
                    "logit per query head")
        return None

    def oracle_terms(self) -> OracleTerms:
        """What the oracle applies beyond the pattern, as keywords of its functions: the score_mod and the sinks."""
        return {"score_mod": self.make_score_mod(), "sinks": self.sink_logits()}

    def score_mod_label(self) -> str:
        """`softcap50`, `alibi`, `relative_bias`, a custom name ('' for none)."""
        if self.score_mod == "softcap" and self.softcap is not None:
            return f"softcap{self.softcap:g}"
        return "" if self.score_mod == "none" else self.score_mod

    def pattern_label(self) -> str:
        return self.make_pattern().label

    def _digest_params(self) -> dict[str, Any]:
        params = self.params()
        same = {"kv_heads": self.heads, "q_len": self.seq_len}  # written out, they mean the default
        for name, default in LATER_FIELDS.items():
            if params[name] == default or params[name] == same.get(name):
                del params[name]
        if "inputs" in params:
            params["inputs"] = self.inputs.digest_param()  # a captured file by its content, not its path
        if "model" in params and self.model is not None and self.model not in BUILTIN_MODELS:
            params["model"] = {"sha256": model_sha256(self.model)}  # a directory by its content, not its path
        if "task" in params and self.task is not None:
            params["task"] = self.task.digest_param()
        return params

    @property
    def case_id(self) -> str:
        """Readable and stable: the same parameters give the same id in every run, on every machine."""
        digest = hashlib.sha1(json.dumps(self._digest_params(), sort_keys=True).encode()).hexdigest()[:8]
        kv = f"kv{self.kv_heads}" if self.kv_heads is not None and self.kv_heads != self.heads else ""
        q = f"q{self.q_len}" if self.q_len is not None and self.q_len != self.seq_len else ""
        parts = [self.pattern_label(), f"n{self.seq_len}{q}",
                 f"b{self.batch}h{self.heads}{kv}d{self.head_dim}", _DTYPE_SHORT[self.dtype], self.mode]
        if self.checkpoint:
            parts.append("ckpt")
        if self.world_size > 1:
            parts.append(f"p{self.world_size}")
        if self.cp_layout != "contiguous":
            parts.append(self.cp_layout)
        if self.ulysses_degree is not None:
            parts.append(f"u{self.ulysses_degree}")
        if self.inputs.label():
            parts.append(self.inputs.label())
        if self.selector is not None:
            parts.append(self.selection_label().replace(" ", "-"))
        if self.page_size is not None:
            parts.append(f"pg{self.page_size}" + ("-ragged" if self.kv_lens is not None else ""))
        if self.score_mod_label():
            parts.append(self.score_mod_label().replace("_", ""))
        if self.sinks is not None:
            parts.append("sinks")
        if self.model is not None:
            parts.append(self.model_label().replace(" ", "-"))
        parts.append(digest)
        return "-".join(parts)

    @property
    def label(self) -> str:
        """Short label for tables: pattern, shape and mode, e.g. `causal N=4096 q=16 B1H32/8D128 bf16 fwd`."""
        extra = " ckpt" if self.checkpoint else ""
        world = f" P={self.world_size}" if self.world_size > 1 else ""
        if self.cp_layout != "contiguous":
            world += f" {self.cp_layout}"
        if self.ulysses_degree is not None:
            world += f" U={self.ulysses_degree}"
        q = f" q={self.q_len}" if self.q_len is not None and self.q_len != self.seq_len else ""
        kv = f"/{self.kv_heads}" if self.kv_heads is not None and self.kv_heads != self.heads else ""
        inputs = f" {self.inputs.label()}" if self.inputs.label() else ""
        selection = f" {self.selection_label()}" if self.selector is not None else ""
        if self.page_size is not None:
            selection += f" pages of {self.page_size}" + (" ragged" if self.kv_lens is not None else "")
        selection += f" {self.score_mod_label()}" if self.score_mod_label() else ""
        selection += " sinks" if self.sinks is not None else ""
        selection += f" {self.model_label()}" if self.model is not None else ""
        return (f"{self.pattern_label()} N={self.seq_len}{q} B{self.batch}H{self.heads}{kv}D{self.head_dim} "
                f"{_DTYPE_SHORT[self.dtype]} {self.mode}{extra}{world}{inputs}{selection}")

    def selection_label(self) -> str:
        """`moba k8`, `oracle_topk k0.125`, `xattention t0.9` ('' without a selector)."""
        if self.selector is None:
            return ""
        amount = f" k{self.budget:g}" if self.budget is not None else ""
        amount += f" t{self.threshold:g}" if self.threshold is not None else ""
        return f"{self.selector}{amount}"

    def model_label(self) -> str:
        """`micro-mqar mqar` (with `train200` for a training run); '' without a model."""
        if self.model is None:
            return ""
        task = self.task.label() if self.task is not None else "task"
        train = f" train{self.train.steps}" if self.train is not None else ""
        return f"{model_label(self.model)} {task}{train}"

    def with_device(self, device: str) -> Case:
        return replace(self, device=device)


def resolve_device(requested: str) -> str:
    """`auto` is cuda when a GPU is visible, else cpu."""
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested
