"""bench import flashinfer-trace: the dataset in tests/data/flashinfer as a suite, its inputs, its bad files.

The dataset follows FlashInfer-Bench's op-type docs (tests/data/flashinfer/make_dataset.py writes it); their own
library (`flashinfer_bench.data`, installed with --no-deps) loads it, and our reading must agree with theirs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from bench.cli import main
from bench.inputs import InputsSpec, make
from bench.interop.flashinfer.compare import element_check
from bench.interop.flashinfer.dataset import read_dataset
from bench.spec.case import Case
from bench.spec.suite import load_suite

DATA = Path(__file__).parent / "data" / "flashinfer"
RAGGED = "gqa_ragged_prefill_causal_h4_kv2_d32"
DECODE = "gqa_paged_decode_h4_kv2_d32_ps1"
PREFILL = "gqa_paged_prefill_causal_h4_kv2_d32_ps16"


def imported(tmp_path: Path, root: Path = DATA, *extra: str) -> tuple[int, dict, Path]:
    suite = tmp_path / "fib.yaml"
    code = main(["import", "flashinfer-trace", str(root), "-o", str(suite), "--impl", "sdpa", *extra])
    return code, json.loads((tmp_path / "fib.import.json").read_text()), suite


def test_their_library_and_ours_read_the_dataset_alike():
    flashinfer_data = pytest.importorskip("flashinfer_bench.data")
    theirs = flashinfer_data.TraceSet.from_path(str(DATA))
    ours = read_dataset(DATA)
    assert not ours.problems
    assert sorted(ours.definitions) == sorted(theirs.definitions)
    assert {k: len(v) for k, v in ours.workloads.items()} == {k: len(v) for k, v in theirs.workloads.items()}
    assert sorted(s.solution.name for s in ours.solutions) == sorted(
        s.name for sols in theirs.solutions.values() for s in sols)
    for name, loaded in ours.definitions.items():  # the same data, field for field
        assert loaded.definition.model_dump(mode="json") == theirs.definitions[name].model_dump(mode="json")


def test_import_maps_gqa_ragged_and_paged_and_says_why_not_the_rest(tmp_path):
    code, report, suite_file = imported(tmp_path)
    assert code == 0 and not report["problems"]
    by_name = {d["name"]: d for d in report["definitions"]}
    assert by_name["rmsnorm_h64"]["reason"] == "op type rmsnorm is not attention"
    unmapped = {u["uuid"]: u["reason"] for d in report["definitions"] for u in d["unmapped"]}
    assert "a batch has one q_len" in unmapped["r-mixed"]
    assert "9 queries over 5 keys" in unmapped["p-9-over-5"] and "LSE -inf" in unmapped["p-9-over-5"]
    mapped = {m["uuid"]: m for d in report["definitions"] for m in d["mapped"]}
    assert len(mapped) == 9
    for m in mapped.values():  # the definitions' reference run() agrees with the float64 oracle on each
        assert m["agreement"]["output_rel_l2"] < 0.02 and m["agreement"]["lse"]["passed"], m
    suite = load_suite(suite_file)
    cases = {c.inputs.workload[1]: c for c in suite.cases}
    assert cases["r-docs-5-11-8"].documents == (5, 11, 8) and cases["r-docs-5-11-8"].batch == 1
    assert (cases["r-chunk-2x4of16"].batch, cases["r-chunk-2x4of16"].q_len, cases["r-chunk-2x4of16"].seq_len) == \
        (2, 4, 16)
    decode = cases["d-3-of-7-12-3"]
    assert (decode.page_size, decode.kv_lens, decode.q_len, decode.seq_len) == (1, (7, 12, 3), 1, 12)
    decode = cases["d-5-of-9-1-15-4-6"]  # one sequence of a single key
    assert (decode.batch, decode.kv_lens, decode.q_len, decode.seq_len) == (5, (9, 1, 15, 4, 6), 1, 15)
    prefill = cases["p-2x8-of-40-23"]
    assert (prefill.page_size, prefill.kv_lens, prefill.q_len) == (16, (40, 23), 8)
    prefill = cases["p-3x4-of-50-17-32"]  # each sequence's 4 queries at its end; last pages of 2, 1 and 16
    assert (prefill.page_size, prefill.batch, prefill.kv_lens, prefill.q_len, prefill.seq_len) == \
        (16, 3, (50, 17, 32), 4, 50)
    assert all((c.heads, c.kv_heads, c.head_dim, c.dtype, c.pattern) == (4, 2, 32, "bfloat16", "causal")
               for c in suite.cases)
    assert suite.impls[0] == "flashinfer_reference" and "sdpa" in suite.impls
    assert {"ragged_causal_python", "ragged_no_mask_python", "decode_dps_python", "decode_wrong_scale_python"} <= \
        set(suite.impls)
    text = suite_file.read_text()
    assert "reference run() agrees with the float64 oracle" in text  # the cross-check, above each case


def test_workload_inputs_read_their_stored_tensors_into_our_layout(tmp_path):
    from safetensors.torch import load_file

    _, _, suite_file = imported(tmp_path, DATA, "--no-check")
    cases = {c.inputs.workload[1]: c for c in load_suite(suite_file).cases}
    ragged = cases["r-stored-16"]
    made = make(ragged.inputs, ragged.inputs_shape(), ragged.seed, ragged.torch_dtype, "cpu")
    stored = load_file(str(DATA / "blob/workloads/gqa_ragged" / RAGGED / f"{RAGGED}_r-stored-16.safetensors"))
    assert torch.equal(made.q[0].transpose(0, 1), stored["q"]) and torch.equal(made.v[0].transpose(0, 1), stored["v"])
    assert made.kind == "flashinfer" and made.file.endswith("r-stored-16.safetensors") and len(made.file_sha256) == 64
    decode = cases["d-stored-20"]
    made = make(decode.inputs, decode.inputs_shape(), decode.seed, decode.torch_dtype, "cpu")
    stored = load_file(str(DATA / "blob/workloads/gqa_paged" / DECODE / f"{DECODE}_d-stored-20.safetensors"))
    pages = stored["kv_indices"].long()  # page_size 1: a page is a token
    assert torch.equal(made.k[0].transpose(0, 1), stored["k_cache"][pages, 0])
    assert torch.equal(made.q[0, :, 0], stored["q"][0])
    drawn = cases["r-single-24"]  # q, k, v random in the workload: the draws of `inputs: random`
    made = make(drawn.inputs, drawn.inputs_shape(), drawn.seed, drawn.torch_dtype, "cpu")
    plain = make(InputsSpec(), drawn.inputs_shape(), drawn.seed, drawn.torch_dtype, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(made.tensors, plain.tensors, strict=True))


def test_the_new_inputs_kind_keeps_todays_ids_and_round_trips():
    assert Case().case_id == "local_w64-n1024-b1h4d64-fp32-fwd-5e3d306d"  # as tests/test_score_mods.py pins it
    spec = InputsSpec.parse({"kind": "flashinfer", "root": "/data", "definition": RAGGED, "workload": "w1"})
    assert InputsSpec.parse(spec.to_param()) == spec and spec.label() == "fib"
    assert "root" not in spec.digest_param()  # the id digests the workload, never the path


def copy_dataset(tmp_path: Path) -> Path:
    root = tmp_path / "dataset"
    shutil.copytree(DATA, root, ignore=shutil.ignore_patterns("*.py"))
    return root


def test_bad_files_are_named_by_file_and_field_exit_2_and_the_rest_imports(tmp_path, capsys):
    root = copy_dataset(tmp_path)
    bad_def = json.loads((root / f"definitions/gqa_paged/{PREFILL}.json").read_text())
    bad_def["axes"]["head_dim"]["value"] = -1  # fails their schema (NonNegativeInt)
    (root / f"definitions/gqa_paged/{PREFILL}.json").write_text(json.dumps(bad_def))
    lines = (root / f"workloads/gqa_ragged/{RAGGED}.jsonl").read_text().splitlines()
    unknown = json.loads(lines[0])
    unknown["definition"] = "gqa_ragged_prefill_causal_h9_kv9_d9"
    lines.append(json.dumps(unknown))
    (root / f"workloads/gqa_ragged/{RAGGED}.jsonl").write_text("\n".join(lines) + "\n")
    (root / f"blob/workloads/gqa_paged/{DECODE}/{DECODE}_d-3-of-7-12-3.safetensors").unlink()
    solution_file = root / f"solutions/tests/{RAGGED}/ragged_causal_python.json"
    solution = json.loads(solution_file.read_text())
    solution["spec"]["entry_point"] = "main.py::no_such_function"
    solution_file.write_text(json.dumps(solution))
    code, report, suite_file = imported(tmp_path, root, "--no-check")
    out = capsys.readouterr().out
    assert code == 2
    problems = {(p["file"], p["field"]): p["message"] for p in report["problems"]}
    assert "greater than or equal to 0" in problems[(f"definitions/gqa_paged/{PREFILL}.json", "axes.head_dim.value")]
    assert "no such definition" in problems[(f"workloads/gqa_ragged/{RAGGED}.jsonl", "line 6: definition")]
    assert "no such file" in problems[(f"workloads/gqa_paged/{DECODE}.jsonl", "line 1: workload.inputs.kv_indptr.path")]
    entry = problems[(f"solutions/tests/{RAGGED}/ragged_causal_python.json", "spec.entry_point")]
    assert "no function 'no_such_function'" in entry and "run" in entry
    for (file, field), _ in problems.items():  # each printed as one line naming file and field
        assert f"{file}: {field}: " in out
    cases = {c.inputs.workload[1] for c in load_suite(suite_file).cases}  # the sound rest still imports
    assert {"r-single-24", "r-docs-5-11-8", "d-stored-20"} <= cases and "d-3-of-7-12-3" not in cases
    assert not any(w.startswith("p-") for w in cases)  # the definition that failed the schema: none of it


def test_a_solution_with_no_entry_point_is_bad_input_for_bench_run(tmp_path, capsys):
    root = copy_dataset(tmp_path)
    solution_file = root / f"solutions/tests/{DECODE}/decode_dps_python.json"
    solution = json.loads(solution_file.read_text())
    solution["spec"]["entry_point"] = "main.py::missing"
    solution_file.write_text(json.dumps(solution))
    suite = tmp_path / "s.yaml"
    suite.write_text(yaml.safe_dump({"name": "s", "impls": ["dense"]}))
    assert main(["run", str(suite), "--solutions", str(root), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "decode_dps_python.json: spec.entry_point: got 'main.py::missing'" in err


def test_their_rule_for_infinities_in_the_lse():
    inf, nan = float("inf"), float("nan")
    same = element_check(torch.tensor([-inf, inf, 1.0]), torch.tensor([-inf, inf, 1.0]))
    assert same.passed and same.inf_matched == 2 and same.max_absolute_error == 0.0
    for actual, expected in (([0.0], [-inf]), ([-inf], [0.0]), ([inf], [-inf]), ([nan], [1.0]), ([nan], [nan])):
        check = element_check(torch.tensor(actual), torch.tensor(expected), required_matched_ratio=0.01)
        assert not check.passed and check.nonfinite_mismatched == 1, (actual, expected)
    loose = element_check(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 9.0]), required_matched_ratio=0.5)
    assert loose.passed and loose.matched_ratio == 0.5  # flashinfer-bench#178's matched ratio
