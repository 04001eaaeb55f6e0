"""The FlashInfer Trace schema (flashinfer-bench 0.1.2, `flashinfer_bench.data`), as pydantic models of our own.

Why not import theirs: the package is an optional extra, and importing it loads its whole runtime (apply,
tracing, compile); reading and writing a dataset needs only the data shapes. The models below accept and
reject what theirs do (their validators are restated: a top-level `run` in the reference, disjoint input and
output names, constraints that parse, shapes naming declared axes, an entry point `file.py::fn` whose file is
among the sources, source paths relative and without `..`, correctness and performance present exactly where
the status needs them); tests/test_flashinfer_export.py loads what we write with the real library.
"""

from __future__ import annotations

import ast
import math
from enum import Enum
from pathlib import PurePath
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Name = Annotated[str, Field(min_length=1)]
DTYPES = ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float4_e2m1", "int64", "int32",
          "int16", "int8", "bool")
DType = Literal["float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float4_e2m1", "int64", "int32",
                "int16", "int8", "bool"]


class _Model(BaseModel):
    # Theirs ignore unknown keys (pydantic's default); so do ours, so that a newer dataset still reads.
    model_config = ConfigDict(extra="ignore")


class AxisConst(_Model):
    type: Literal["const"] = "const"
    value: Annotated[int, Field(ge=0)]
    description: str | None = None


class AxisVar(_Model):
    type: Literal["var"] = "var"
    description: str | None = None


class TensorSpec(_Model):
    shape: list[Name] | None  # None: a scalar
    dtype: DType
    description: str | None = None


class Definition(_Model):
    name: Name
    op_type: Name
    axes: dict[Name, AxisConst | AxisVar]
    inputs: dict[Name, TensorSpec]
    outputs: dict[Name, TensorSpec]
    reference: Name
    tags: list[Name] = Field(default_factory=list)
    description: str | None = None
    constraints: list[Name] = Field(default_factory=list)

    @model_validator(mode="after")
    def _valid(self) -> Definition:
        try:
            module = ast.parse(self.reference, mode="exec")
        except SyntaxError as exc:
            raise ValueError(f"Reference must be valid Python code: {exc}") from exc
        if not any(isinstance(node, ast.FunctionDef) and node.name == "run" for node in module.body):
            raise ValueError("Reference must define a top-level function named 'run'")
        if set(self.inputs) & set(self.outputs):
            raise ValueError("Input and output names must not overlap")
        for constraint in self.constraints:
            try:
                ast.parse(constraint, mode="eval")
            except SyntaxError as exc:
                raise ValueError(f"Constraints must be valid Python expressions: {exc}") from exc
        for name, spec in {**self.inputs, **self.outputs}.items():
            for axis in spec.shape or []:
                if axis not in self.axes:
                    raise ValueError(f'Tensor "{name}" references undefined axis "{axis}"')
        return self

    def const_axes(self) -> dict[str, int]:
        return {name: axis.value for name, axis in self.axes.items() if isinstance(axis, AxisConst)}


class RandomInput(_Model):
    type: Literal["random"] = "random"


class ScalarInput(_Model):
    type: Literal["scalar"] = "scalar"
    value: int | float | bool


class SafetensorsInput(_Model):
    type: Literal["safetensors"] = "safetensors"
    path: Name  # relative to the dataset's root
    tensor_key: Name


InputSpec = RandomInput | SafetensorsInput | ScalarInput  # their order: a bare {} is a random input


class Workload(_Model):
    axes: dict[str, Annotated[int, Field(ge=0)]]
    inputs: dict[str, InputSpec]
    uuid: Name


class Language(str, Enum):
    PYTHON = "python"
    TRITON = "triton"
    CPP = "cpp"
    CUDA = "cuda"
    TILELANG = "tilelang"


class BuildSpec(_Model):
    language: Language
    target_hardware: Annotated[list[str], Field(min_length=1)]
    entry_point: Name  # file.py::fn
    dependencies: list[Name] = Field(default_factory=list)
    destination_passing_style: bool = True  # outputs passed as the last arguments, else returned
    binding: Literal["tvm-ffi", "torch"] | None = None

    @field_validator("entry_point")
    @classmethod
    def _entry(cls, value: str) -> str:
        if value.count("::") != 1:
            raise ValueError(f'Invalid entry point format: {value}. Expected "<file_path>::<function_name>".')
        return value


class SourceFile(_Model):
    path: Name
    content: Name

    @field_validator("path")
    @classmethod
    def _relative(cls, value: str) -> str:
        path = PurePath(value)
        if path.is_absolute() or value.startswith("/"):
            raise ValueError(f"Invalid source path (absolute path not allowed): {value}")
        if ".." in path.parts:
            raise ValueError(f"Invalid source path (parent directory traversal not allowed): {value}")
        return value


class Solution(_Model):
    name: Name
    definition: Name
    author: Name
    spec: BuildSpec
    sources: Annotated[list[SourceFile], Field(min_length=1)]
    description: str | None = None

    @model_validator(mode="after")
    def _entry_file(self) -> Solution:
        paths = [s.path for s in self.sources]
        if len(set(paths)) != len(paths):
            raise ValueError(f"Duplicate source path in {paths}")
        if self.entry_file not in paths:
            raise ValueError(f"Entry source file '{self.entry_file}' not found in sources")
        return self

    @property
    def entry_file(self) -> str:
        return self.spec.entry_point.split("::")[0]

    @property
    def entry_symbol(self) -> str:
        return self.spec.entry_point.split("::")[1]


Status = Literal["PASSED", "INCORRECT_SHAPE", "INCORRECT_NUMERICAL", "INCORRECT_DTYPE", "RUNTIME_ERROR",
                 "COMPILE_ERROR", "TIMEOUT"]


class Correctness(_Model):
    model_config = ConfigDict(extra="ignore", ser_json_inf_nan="strings")
    max_relative_error: float = 0.0
    max_absolute_error: float = 0.0
    extra: dict[str, object] | None = None

    @field_validator("max_relative_error", "max_absolute_error")
    @classmethod
    def _non_negative(cls, value: float) -> float:
        if not math.isnan(value) and value < 0:
            raise ValueError("must be non-negative or NaN")
        return value


class Performance(_Model):
    latency_ms: Annotated[float, Field(ge=0.0)] = 0.0
    reference_latency_ms: Annotated[float, Field(ge=0.0)] = 0.0
    speedup_factor: Annotated[float, Field(ge=0.0)] = 0.0


class Environment(_Model):
    hardware: Name
    libs: dict[str, str] = Field(default_factory=dict)


class Evaluation(_Model):
    status: Status
    environment: Environment
    timestamp: Name
    log: str = ""
    correctness: Correctness | None = None
    performance: Performance | None = None

    @model_validator(mode="after")
    def _by_status(self) -> Evaluation:
        wants_correctness = self.status in ("PASSED", "INCORRECT_NUMERICAL")
        if wants_correctness != (self.correctness is not None):
            raise ValueError(f"correctness must {'' if wants_correctness else 'not '}be given with {self.status}")
        if (self.status == "PASSED") != (self.performance is not None):
            raise ValueError(f"performance must {'' if self.status == 'PASSED' else 'not '}be given with "
                             f"{self.status}")
        return self


class Trace(_Model):
    """A line of `workloads/**.jsonl` (solution and evaluation null) or of `traces/**.jsonl`."""

    definition: Name
    workload: Workload
    solution: str | None = None
    evaluation: Evaluation | None = None
