"""A case's q, k, v from a FlashInfer-Bench workload: `inputs: {kind: flashinfer, root: DIR, definition: NAME,
workload: UUID}`.

A FlashInfer Trace dataset (`bench import flashinfer-trace`, bench.interop.flashinfer) keeps each workload as a
line of `ROOT/workloads/**/<definition>.jsonl`: its axes and, per input of the definition, `random`, a `scalar`
or a `safetensors` tensor (a path relative to ROOT and a key). The case's shape fields (batch, documents, q_len,
kv_lens, page_size) were derived from the workload's index tensors when it was imported; what is read here is
q, k and v:

- given as random: our own seeded draws, exactly as for `inputs: random` (FlashInfer-Bench draws them too);
- given as stored tensors, in their layout: q (total_q, H, D), k and v (total_kv, Hkv, D) for a ragged batch,
  k_cache and v_cache (pages, page_size, Hkv, D) with kv_indptr, kv_indices (and kv_last_page_len, else full
  last pages) for a paged one. They are put into ours: q (B, H, q_len, D), k, v (B, Hkv, seq_len, D), a paged
  cache's pages gathered in each sequence's order (zeros past a sequence's length).

ROOT is relative to the suite file; the suite resolves it and hashes the workload's tensor file, which the case's
id digests with the definition and the workload's uuid (never the path), and which the record's `inputs` names.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, ValidationError
from torch import Tensor

from bench.inputs.files import file_sha256
from bench.inputs.spec import InputsError, InputsSpec

K_NAMES = ("k", "k_cache")
V_NAMES = ("v", "v_cache")


class TensorSource(BaseModel):
    """One input of a workload, as much of FlashInfer-Bench's InputSpec as reading tensors needs."""

    model_config = ConfigDict(extra="ignore")
    type: str = "random"
    path: str | None = None
    tensor_key: str | None = None


class WorkloadEntry(BaseModel):
    model_config = ConfigDict(extra="ignore")
    uuid: str
    axes: dict[str, int]
    inputs: dict[str, TensorSource]


class _WorkloadLine(BaseModel):
    model_config = ConfigDict(extra="ignore")
    definition: str
    workload: WorkloadEntry


_FOUND: dict[tuple[str, str, str], WorkloadEntry] = {}


def find_workload(root: Path, definition: str, uuid: str) -> WorkloadEntry:
    """The workload `uuid` of `definition` in ROOT/workloads. Raises InputsError naming what is missing."""
    key = (str(root), definition, uuid)
    if key in _FOUND:
        return _FOUND[key]
    if not (root / "workloads").is_dir():
        raise InputsError(f"{root} has no workloads/ directory (a FlashInfer Trace dataset's root)", field="root")
    for path in sorted((root / "workloads").rglob("*.jsonl")):
        for text in path.read_text(encoding="utf-8").splitlines():
            if uuid not in text:
                continue
            try:
                line = _WorkloadLine.model_validate(json.loads(text))
            except (ValueError, ValidationError):
                continue  # `bench import` reports malformed lines; here only the one asked for matters
            if line.definition == definition and line.workload.uuid == uuid:
                _FOUND[key] = line.workload
                return line.workload
    raise InputsError(f"{root}/workloads holds no workload {uuid} of definition {definition}", field="workload")


def tensor_files(root: Path, entry: WorkloadEntry) -> list[Path]:
    """The distinct safetensors files a workload's inputs name, resolved against ROOT, in first-use order."""
    seen = [root / s.path for s in entry.inputs.values() if s.type == "safetensors" and s.path]
    return list(dict.fromkeys(p.resolve() for p in seen))


def resolve(spec: InputsSpec, base_dir: Path) -> InputsSpec:
    """The spec with ROOT made absolute (relative to the suite's directory) and the workload's tensor file hashed;
    a written sha256 must match. Raises InputsError."""
    assert spec.kind == "flashinfer" and spec.file is not None and spec.workload is not None
    root = Path(spec.file).expanduser()
    root = (root if root.is_absolute() else base_dir / root).resolve()
    entry = find_workload(root, *spec.workload)
    files = tensor_files(root, entry)
    for path in files:
        if not path.is_file():
            raise InputsError(f"workload {entry.uuid} names {path}, which does not exist", field="workload")
    digest = workload_sha256(files)
    if spec.sha256 is not None and spec.sha256 != digest:
        raise InputsError(f"workload {entry.uuid}'s tensors have sha256 {digest}, not the {spec.sha256} the suite "
                          "pins", field="sha256")
    return InputsSpec(kind="flashinfer", file=str(root), workload=spec.workload, sha256=digest)


def workload_sha256(files: list[Path]) -> str | None:
    """One file's sha256; several files' combined (the hash of their hashes in order); None without files."""
    if not files:
        return None
    if len(files) == 1:
        return file_sha256(files[0])
    return hashlib.sha256("".join(file_sha256(p) for p in files).encode()).hexdigest()


@dataclass
class WorkloadTensors:
    """What a workload gives of q, k, v in our layout (None: drawn at random), and the file they came from."""

    q: Tensor | None
    k: Tensor | None
    v: Tensor | None
    file: str | None
    sha256: str | None


def _read(root: Path, source: TensorSource) -> Tensor:
    from safetensors import safe_open

    assert source.path is not None and source.tensor_key is not None
    path = root / source.path
    try:
        with safe_open(str(path), framework="pt") as handle:
            return handle.get_tensor(source.tensor_key)
    except Exception as exc:  # safetensors raises its own error types: a missing key, a file that is not one
        raise InputsError(f"{path}: cannot read tensor {source.tensor_key!r}: {exc}", field="workload") from None


def _stored(entry: WorkloadEntry, names: tuple[str, ...]) -> TensorSource | None:
    for name in names:
        source = entry.inputs.get(name)
        if source is not None and source.type == "safetensors":
            return source
    return None


def _rows(t: Tensor, batch: int, length: int, heads: int, head_dim: int, what: str) -> Tensor:
    """(batch * length, heads, D) -> (batch, heads, length, D)."""
    if tuple(t.shape) != (batch * length, heads, head_dim):
        raise InputsError(f"workload tensor {what} has shape {list(t.shape)}; the case needs "
                          f"[{batch * length}, {heads}, {head_dim}] (batch {batch} x {length} tokens)",
                          field="workload")
    return t.reshape(batch, length, heads, head_dim).permute(0, 2, 1, 3).contiguous()


def _gathered(root: Path, entry: WorkloadEntry, cache: Tensor, seq_len: int, what: str) -> Tensor:
    """Pages (P, page_size, Hkv, D) -> (B, Hkv, seq_len, D) in each sequence's order, zeros past its length."""
    index: dict[str, Tensor] = {}
    for name in ("kv_indptr", "kv_indices", "kv_last_page_len"):
        source = entry.inputs.get(name)
        if source is not None and source.type == "safetensors":
            index[name] = _read(root, source).to(torch.int64)
    if "kv_indptr" not in index or "kv_indices" not in index:
        raise InputsError(f"workload {entry.uuid} stores {what} but not kv_indptr and kv_indices", field="workload")
    indptr, indices = index["kv_indptr"], index["kv_indices"]
    page_size, hkv, d = cache.shape[1], cache.shape[2], cache.shape[3]
    batch = indptr.numel() - 1
    out = cache.new_zeros(batch, hkv, seq_len, d)
    for b in range(batch):
        pages = indices[int(indptr[b]) : int(indptr[b + 1])]
        last = int(index["kv_last_page_len"][b]) if "kv_last_page_len" in index else page_size
        length = max(0, (pages.numel() - 1) * page_size + last) if pages.numel() else 0
        if length > seq_len:
            raise InputsError(f"workload {entry.uuid}: sequence {b} holds {length} keys, more than the case's "
                              f"seq_len {seq_len}", field="workload")
        out[b, :, :length] = cache[pages].reshape(-1, hkv, d)[:length].transpose(0, 1)
    return out


def load(spec: InputsSpec, batch: int, heads: int, kv_heads: int, seq_len: int, q_len: int, head_dim: int
         ) -> WorkloadTensors:
    """The workload's stored q, k, v in our layout (module docstring), on the CPU in their dtype. Raises
    InputsError for a tensor that does not fit the case."""
    assert spec.kind == "flashinfer" and spec.file is not None and spec.workload is not None
    root = Path(spec.file)
    entry = find_workload(root, *spec.workload)
    files = tensor_files(root, entry)
    q_source, k_source, v_source = _stored(entry, ("q",)), _stored(entry, K_NAMES), _stored(entry, V_NAMES)
    q = None if q_source is None else _rows(_read(root, q_source), batch, q_len, heads, head_dim, "q")
    kv: list[Tensor | None] = []
    for source, names in ((k_source, K_NAMES), (v_source, V_NAMES)):
        if source is None:
            kv.append(None)
            continue
        tensor = _read(root, source)
        paged = entry.inputs.get(names[1]) is source
        kv.append(_gathered(root, entry, tensor, seq_len, names[1]) if paged
                  else _rows(tensor, batch, seq_len, kv_heads, head_dim, names[0]))
    first = next((root / s.path for s in (q_source, k_source, v_source) if s is not None and s.path), None)
    shown = first.resolve() if first is not None else (files[0] if files else None)
    return WorkloadTensors(q, kv[0], kv[1], None if shown is None else str(shown), spec.sha256)
