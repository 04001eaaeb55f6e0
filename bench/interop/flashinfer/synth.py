"""The FlashInfer-Bench definition of a case, and its workload: what `bench export` writes for cases of ours.

A case from a dataset (`inputs: {kind: flashinfer, ...}`) keeps its own definition and workload (`target`). Any
other case maps when FlashInfer-Bench has its op type: causal or dense attention (no selector, no score_mod),
inference, one process. Packed documents and plain batches are `gqa_ragged` prefill; a paged cache is `gqa_paged`
prefill, or decode with one query per sequence. Names follow theirs (`gqa_paged_decode_h32_kv8_d128_ps16`), with
the dtype added when it is not bfloat16 (their definitions' dtype); the reference is ours (reference_code.py);
inputs and outputs are as their op-type docs list them, with kv_last_page_len where pages hold more than one
token (as their published page_size 64 definitions take it).
"""

from __future__ import annotations

from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict

from bench.inputs.paged import kv_lengths, page_kv
from bench.interop.flashinfer.dataset import LoadedDefinition, definitions_of
from bench.interop.flashinfer.layout import page_indices, ragged_lengths
from bench.interop.flashinfer.mapping import Layout, layout_of
from bench.interop.flashinfer.reference_code import reference_source
from bench.interop.flashinfer.schema import (
    AxisConst,
    AxisVar,
    Definition,
    RandomInput,
    SafetensorsInput,
    ScalarInput,
    TensorSpec,
    Workload,
)
from bench.spec.case import Case


class Target(BaseModel):
    """The definition a case is an instance of, and where it comes from (a dataset's root, or ours)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    definition: Definition
    layout: Layout
    root: Path | None = None  # the dataset the case came from; None: made here from the case
    file: str | None = None  # the definition's file under root
    workload: str | None = None  # the dataset workload's uuid


def _kind(case: Case) -> str:
    if case.page_size is not None:
        return "paged_decode" if case.n_queries == 1 else "paged_prefill"
    return "ragged_prefill"


def why_not(case: Case) -> str | None:
    """Why a case of ours has no FlashInfer-Bench definition, or None."""
    if case.pattern not in ("causal", "dense"):
        return (f"pattern {case.pattern}: FlashInfer-Bench has no op type for static sparse masks yet "
                "(flashinfer-bench#116, #142 ask for them)")
    for name, ok, what in (("selector", case.selector is None, "a selection"), ("score_mod", case.score_mod == "none",
                           "a score modification"), ("mode", case.mode == "fwd", "a backward pass"),
                           ("world_size", case.world_size == 1, "several processes")):
        if not ok:
            return f"{name} {getattr(case, name)}: {what} has no FlashInfer-Bench op type"
    if case.page_size is not None and case.documents is not None:
        return "documents in a paged cache have no FlashInfer-Bench op type"
    return None


def definition_name(case: Case) -> str:
    kind, mask = _kind(case), "_causal" if case.pattern == "causal" else ""
    shape = f"h{case.heads}_kv{case.n_kv_heads}_d{case.head_dim}"
    dtype = "" if case.dtype == "bfloat16" else {"float32": "_fp32", "float16": "_fp16"}[case.dtype]
    if kind == "ragged_prefill":
        return f"gqa_ragged_prefill{mask}_{shape}{dtype}"
    stage = "decode" if kind == "paged_decode" else f"prefill{mask}"
    return f"gqa_paged_{stage}_{shape}_ps{case.page_size}{dtype}"


def _tensors(case: Case, kind: str) -> tuple[dict[str, TensorSpec], dict[str, TensorSpec]]:
    dt = case.dtype
    tokens = "batch_size" if kind == "paged_decode" else "total_q"
    t = lambda shape, dtype=dt: TensorSpec(shape=shape, dtype=dtype)  # noqa: E731
    out = {"output": t([tokens, "num_qo_heads", "head_dim"]), "lse": t([tokens, "num_qo_heads"], "float32")}
    q = t([tokens, "num_qo_heads", "head_dim"])
    if kind == "ragged_prefill":
        kv = t(["total_kv", "num_kv_heads", "head_dim"])
        return {"q": q, "k": kv, "v": kv, "qo_indptr": t(["len_indptr"], "int32"),
                "kv_indptr": t(["len_indptr"], "int32"), "sm_scale": t(None, "float32")}, out
    cache = t(["num_pages", "page_size", "num_kv_heads", "head_dim"])
    inputs = {"q": q, "k_cache": cache, "v_cache": cache}
    if kind == "paged_prefill":
        inputs["qo_indptr"] = t(["len_indptr"], "int32")
    inputs.update({"kv_indptr": t(["len_indptr"], "int32"), "kv_indices": t(["num_kv_indices"], "int32")})
    if case.page_size != 1:
        inputs["kv_last_page_len"] = t(["batch_size"], "int32")
    inputs["sm_scale"] = t(None, "float32")
    return inputs, out


def synth_definition(case: Case) -> Definition:
    """The definition of a case that maps (`why_not` is None)."""
    kind = _kind(case)
    consts: dict[str, AxisConst | AxisVar] = {"num_qo_heads": AxisConst(type="const", value=case.heads),
                                              "num_kv_heads": AxisConst(type="const", value=case.n_kv_heads),
                                              "head_dim": AxisConst(type="const", value=case.head_dim)}
    if kind == "ragged_prefill":
        variables = ["len_indptr", "total_q", "total_kv"]
        constraints = ["total_q == qo_indptr[-1].item()", "total_kv == kv_indptr[-1].item()"]
    else:
        consts["page_size"] = AxisConst(type="const", value=int(case.page_size or 1))
        variables = ["len_indptr", "num_kv_indices", "num_pages", "batch_size"]
        variables.insert(1, "batch_size" if kind == "paged_decode" else "total_q")
        constraints = ["num_kv_indices == kv_indptr[-1].item()", "len_indptr == batch_size + 1"
                       if kind == "paged_decode" else "total_q == qo_indptr[-1].item()"]
    inputs, outputs = _tensors(case, kind)
    used = {a for spec in (*inputs.values(), *outputs.values()) for a in spec.shape or []}
    axes = {**consts, **{name: AxisVar(type="var") for name in dict.fromkeys(variables) if name in used}}
    stage = "decode" if kind == "paged_decode" else "prefill"
    code = reference_source(kind, causal=case.pattern == "causal", heads=case.heads, kv_heads=case.n_kv_heads,
                            head_dim=case.head_dim, page_size=case.page_size, last_page_len=case.page_size != 1)
    return Definition(name=definition_name(case), op_type="gqa_ragged" if kind == "ragged_prefill" else "gqa_paged",
                      axes=axes, inputs=inputs, outputs=outputs, reference=code, constraints=constraints,
                      tags=[f"stage:{stage}", "source:sparse-attention-bench"],
                      description=f"{'Causal' if case.pattern == 'causal' else 'Dense'} grouped-query attention, "
                                  f"{stage}, as sparse-attention-bench measures it ({kind.replace('_', ' ')}).")


def target(case: Case) -> Target | str:
    """The case's definition: its dataset's own, or the one made from it; or why it has none."""
    if case.inputs.kind == "flashinfer" and case.inputs.workload is not None and case.inputs.file is not None:
        root, (name, uuid) = Path(case.inputs.file), case.inputs.workload
        found: LoadedDefinition | None = definitions_of(root).get(name)
        if found is None:
            return f"{root} has no sound definition {name}"
        layout = layout_of(found.definition)
        if isinstance(layout, str):
            return layout
        return Target(definition=found.definition, layout=layout, root=root, file=found.file, workload=uuid)
    reason = why_not(case)
    if reason is not None:
        return reason
    definition = synth_definition(case)
    layout = layout_of(definition)
    assert not isinstance(layout, str), layout
    return Target(definition=definition, layout=layout)


def synth_workload(case: Case, layout: Layout) -> tuple[Workload, dict[str, torch.Tensor]]:
    """The workload of a case of ours (uuid: its case id; q, k, v random) and the index tensors it stores."""
    if layout.kind == "ragged_prefill":
        q_lens, kv_lens = ragged_lengths(case)
        tensors = {"qo_indptr": torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32),
                   "kv_indptr": torch.tensor([0, *torch.tensor(kv_lens).cumsum(0).tolist()], dtype=torch.int32)}
        axes = {"len_indptr": len(q_lens) + 1, "total_q": sum(q_lens), "total_kv": sum(kv_lens)}
    else:
        lens = kv_lengths(case.kv_lens, case.batch, case.seq_len, case.n_queries, case.seed)
        dummy = torch.zeros(case.batch, 1, case.seq_len, 1)  # the pool's page order does not depend on the data
        indices = page_indices(page_kv(dummy, dummy, int(case.page_size or 1), lens, case.seed))
        tensors = {name: t for name, t in indices.items() if name != "kv_last_page_len" or layout.last_page_len}
        if layout.kind == "paged_prefill":
            tensors["qo_indptr"] = torch.arange(case.batch + 1, dtype=torch.int32) * case.n_queries
        axes = {"len_indptr": case.batch + 1, "num_kv_indices": int(indices["kv_indices"].numel()),
                "num_pages": int(indices["kv_indices"].numel()), "batch_size": case.batch,
                "total_q": case.batch * case.n_queries}
    return Workload(axes=axes, inputs={}, uuid=case.case_id), tensors


def workload_inputs(definition: Definition, tensors: dict[str, torch.Tensor], blob: str
                    ) -> dict[str, RandomInput | SafetensorsInput | ScalarInput]:
    """Every input of the definition: the stored index tensors in `blob` (relative to the root), sm_scale, the
    rest random."""
    out: dict[str, RandomInput | SafetensorsInput | ScalarInput] = {}
    for name, spec in definition.inputs.items():
        if name in tensors:
            out[name] = SafetensorsInput(path=blob, tensor_key=name)
        elif spec.shape is None:
            out[name] = ScalarInput(value=1.0 / definition.const_axes()["head_dim"] ** 0.5)
        else:
            out[name] = RandomInput()
    return out
