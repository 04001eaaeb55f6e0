"""Captured inputs: a safetensors file of q, k, v per layer, as `bench capture` writes it.

Layout (docs/DESIGN.md "Inputs"): for each captured layer L, `layers.L.q` (B, H, N, D) and `layers.L.k`,
`layers.L.v` (B, Hkv, N, D), rotary embedding already applied, q scaled so that q.k/sqrt(D) is the model's
score; string metadata `model` and `text_sha256` (and what else the writer adds). A case reads the first
seq_len tokens, its queries the last q_len of them, cast to its dtype.

The header is read without loading the tensors (safetensors maps the file), so a suite checks every case's
shapes against the file when it loads, and a worker reads only the slices it needs.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from bench.inputs.spec import InputsError, InputsSpec

TENSORS = ("q", "k", "v")
REQUIRED_METADATA = ("model", "text_sha256")


def tensor_name(layer: int, which: str) -> str:
    return f"layers.{layer}.{which}"


@dataclass(frozen=True)
class FileHeader:
    path: str
    shapes: dict[str, tuple[int, ...]]
    metadata: dict[str, str]

    def layers(self) -> list[int]:
        found = set()
        for name in self.shapes:
            parts = name.split(".")
            if len(parts) == 3 and parts[0] == "layers" and parts[1].lstrip("-").isdigit():
                found.add(int(parts[1]))
        return sorted(found)


_SHA_CACHE: dict[tuple[str, int, int], str] = {}


def file_sha256(path: str | Path) -> str:
    """The file's sha256 (cached per path, size and modification time)."""
    stat = os.stat(path)
    key = (str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _SHA_CACHE:
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 22), b""):
                digest.update(block)
        _SHA_CACHE[key] = digest.hexdigest()
    return _SHA_CACHE[key]


def read_header(path: str | Path) -> FileHeader:
    """Tensor names, shapes and metadata of a safetensors file. Raises InputsError naming the file's problem."""
    from safetensors import safe_open

    if not Path(path).is_file():
        raise InputsError(f"no such file: {path}", field="file")
    try:
        with safe_open(str(path), framework="pt") as handle:
            shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}  # noqa: SIM118
            metadata = dict(handle.metadata() or {})
    except Exception as exc:  # safetensors raises its own error types for a file that is not one of its own
        raise InputsError(f"{path} is not a readable safetensors file: {exc}", field="file") from None
    return FileHeader(str(path), shapes, metadata)


def resolve(spec: InputsSpec, base_dir: Path) -> InputsSpec:
    """The spec with its file made absolute (relative to the suite's directory) and its content hashed; a
    written sha256 must match. Raises InputsError."""
    assert spec.kind == "file" and spec.file is not None
    path = Path(spec.file).expanduser()
    path = path if path.is_absolute() else (base_dir / path)
    path = path.resolve()
    if not path.is_file():
        raise InputsError(f"no such file: {path}", field="file")
    digest = file_sha256(path)
    if spec.sha256 is not None and spec.sha256 != digest:
        raise InputsError(f"{path} has sha256 {digest}, not the {spec.sha256} the suite pins", field="sha256")
    return InputsSpec(kind="file", file=str(path), layer=spec.layer, sha256=digest)


def check_shapes(spec: InputsSpec, *, batch: int, heads: int, kv_heads: int, head_dim: int, seq_len: int,
                 q_len: int) -> None:
    """The case's shape fields against the file's tensors. Raises InputsError naming the file, the tensor and both
    shapes (seq_len and q_len may take a prefix of the file's tokens)."""
    assert spec.file is not None and spec.layer is not None
    header = read_header(spec.file)
    missing = [m for m in REQUIRED_METADATA if m not in header.metadata]
    if missing:
        raise InputsError(f"{spec.file} lacks the metadata {missing} (a file bench capture wrote has them)",
                          field="file")
    for which in TENSORS:
        name = tensor_name(spec.layer, which)
        if name not in header.shapes:
            raise InputsError(f"{spec.file} has no tensor {name}; it holds layers {header.layers()}", field="layer")
    q_shape, k_shape = header.shapes[tensor_name(spec.layer, "q")], header.shapes[tensor_name(spec.layer, "k")]
    for which, shape in (("q", q_shape), ("k", k_shape), ("v", header.shapes[tensor_name(spec.layer, "v")])):
        if len(shape) != 4:
            raise InputsError(f"{spec.file}: {tensor_name(spec.layer, which)} has shape {list(shape)}; expected "
                              "4 dimensions (B, heads, N, D)", field="layer")
    n = q_shape[2]
    expected = {"q": (batch, heads, n, head_dim), "k": (batch, kv_heads, n, head_dim),
                "v": (batch, kv_heads, n, head_dim)}
    for which in TENSORS:
        shape = header.shapes[tensor_name(spec.layer, which)]
        if tuple(shape) != expected[which]:
            raise InputsError(f"{spec.file}: {tensor_name(spec.layer, which)} has shape {list(shape)} (B, heads, N, "
                              f"D) but the case asks for {list(expected[which])} (batch {batch}, heads {heads}, "
                              f"kv_heads {kv_heads}, head_dim {head_dim})", field="layer")
    if seq_len > n:
        raise InputsError(f"{spec.file}: layer {spec.layer} holds {n} tokens; the case's seq_len {seq_len} must be "
                          f"at most {n} (a shorter seq_len takes the first tokens)", field="file")


def load(spec: InputsSpec, *, seq_len: int, q_len: int) -> tuple[Tensor, Tensor, Tensor]:
    """q (B, H, q_len, D): the last q_len of the first seq_len tokens; k, v (B, Hkv, seq_len, D). In the file's
    dtype, on the CPU."""
    from safetensors import safe_open

    assert spec.file is not None and spec.layer is not None
    with safe_open(spec.file, framework="pt") as handle:
        q = handle.get_slice(tensor_name(spec.layer, "q"))[:, :, seq_len - q_len : seq_len]
        k = handle.get_slice(tensor_name(spec.layer, "k"))[:, :, :seq_len]
        v = handle.get_slice(tensor_name(spec.layer, "v"))[:, :, :seq_len]
    return tuple(torch.as_tensor(t).contiguous() for t in (q, k, v))  # type: ignore[return-value]
