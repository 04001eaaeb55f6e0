"""bench run over an imported FlashInfer Trace dataset, and bench export --format flashinfer-trace: their library
(`flashinfer_bench.data`) loads what we write, the wrong solution is INCORRECT_NUMERICAL, what we imported comes
back as it was, and definitions made from our own cases hold to their schema and to the float64 oracle."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from bench.cli import main
from bench.interop.flashinfer.crosscheck import cross_check
from bench.interop.flashinfer.export import evaluation, status_of
from bench.interop.flashinfer.synth import target
from bench.results.records import ErrorInfo, Record, TimeStats
from bench.results.store import load_run
from bench.spec.case import Case

fib = pytest.importorskip("flashinfer_bench.data")

DATA = Path(__file__).parent / "data" / "flashinfer"
RAGGED = "gqa_ragged_prefill_causal_h4_kv2_d32"
DECODE = "gqa_paged_decode_h4_kv2_d32_ps1"
FAST = {"warmup": 1, "repeat": 3, "max_time_s": 0.05, "memory": "worker", "timeout_s": 120.0}


def only_run(run_dir_root: Path) -> Path:
    (run_dir,) = [p for p in run_dir_root.iterdir() if p.is_dir()]
    return run_dir


@pytest.fixture(scope="module")
def imported_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, int]:
    """The dataset imported, two of its workloads run (ragged documents; paged decode of three lengths) by the
    reference, the correct and the wrong solutions: (run directory, exported root, bench run's exit code)."""
    tmp = tmp_path_factory.mktemp("fib")
    suite_file = tmp / "fib.yaml"
    assert main(["import", "flashinfer-trace", str(DATA), "-o", str(suite_file), "--no-check", "--impl", "sdpa"]) == 0
    suite = yaml.safe_load(suite_file.read_text())
    suite["sweeps"] = [b for b in suite["sweeps"] if b["defaults"]["inputs"]["workload"] in ("r-docs-5-11-8",
                                                                                               "d-3-of-7-12-3")]
    suite["impls"] = ["flashinfer_reference", "ragged_causal_python", "ragged_no_mask_python", "decode_dps_python",
                      "decode_wrong_scale_python"]
    suite["measure"] = FAST
    suite_file.write_text(yaml.safe_dump(suite))
    code = main(["run", str(suite_file), "--out", str(tmp / "results")])
    run_dir = only_run(tmp / "results")
    assert main(["export", str(run_dir), "--format", "flashinfer-trace", "-o", str(tmp / "out")]) == 0
    return run_dir, tmp / "out", code


def test_solutions_run_as_implementations_and_the_wrong_one_is_incorrect(imported_run):
    run_dir, _, code = imported_run
    records = {(r.params["inputs"]["workload"], r.impl): r for r in load_run(run_dir).records}
    assert code == 1  # the wrong solution's records are incorrect
    for workload in ("r-docs-5-11-8", "d-3-of-7-12-3"):
        assert records[(workload, "flashinfer_reference")].status == "ok"
    assert records[("r-docs-5-11-8", "ragged_causal_python")].status == "ok"
    wrong = records[("r-docs-5-11-8", "ragged_no_mask_python")]
    assert wrong.status == "incorrect" and wrong.error is not None and wrong.error.rel_l2 > 0.1
    decode = records[("d-3-of-7-12-3", "decode_dps_python")]  # destination-passing, through the page table
    assert decode.status == "ok" and decode.config["flashinfer"]["lse"]["passed"]
    assert decode.memory is not None and decode.contention is not None  # measured as every implementation is
    wrong = records[("d-3-of-7-12-3", "decode_wrong_scale_python")]  # softmax scale 1/head_dim
    assert wrong.status == "incorrect" and wrong.error is not None and wrong.error.rel_l2 > 0.1
    skipped = records[("d-3-of-7-12-3", "ragged_causal_python")]
    assert skipped.status == "skipped" and f"solves {RAGGED}" in skipped.reason


def test_their_traceset_loads_the_export_with_statuses_and_speedups(imported_run):
    run_dir, out, _ = imported_run
    traces = fib.TraceSet.from_path(str(out))
    by = {(t.workload.uuid, t.solution): t.evaluation for ts in traces.traces.values() for t in ts}
    wrong = by[("r-docs-5-11-8", "ragged_no_mask_python")]
    assert wrong.status == fib.EvaluationStatus.INCORRECT_NUMERICAL and wrong.performance is None
    assert wrong.correctness.max_absolute_error > 0.1 and wrong.correctness.extra["error"]["rel_l2"] > 0.1
    good = by[("r-docs-5-11-8", "ragged_causal_python")]
    reference = by[("r-docs-5-11-8", f"flashinfer_reference__{RAGGED}")]
    assert good.status == fib.EvaluationStatus.PASSED and reference.status == fib.EvaluationStatus.PASSED
    records = {(r.case_id, r.impl): r for r in load_run(run_dir).records}
    case_id = good.correctness.extra["case_id"]
    assert good.performance.latency_ms == pytest.approx(records[(case_id, "ragged_causal_python")].time_s.median * 1e3)
    assert good.performance.reference_latency_ms == pytest.approx(reference.performance.latency_ms)
    assert good.performance.speedup_factor == pytest.approx(
        good.performance.reference_latency_ms / good.performance.latency_ms)
    assert good.environment.libs["torch"] and good.environment.hardware
    assert traces.get_solution("decode_dps_python").spec.destination_passing_style
    wrong = by[("d-3-of-7-12-3", "decode_wrong_scale_python")]
    assert wrong.status == fib.EvaluationStatus.INCORRECT_NUMERICAL and wrong.performance is None
    assert by[("d-3-of-7-12-3", "decode_dps_python")].status == fib.EvaluationStatus.PASSED
    assert len(traces.traces[DECODE]) == 3 and len(traces.traces[RAGGED]) == 3


def test_what_we_import_comes_back_as_it_was(imported_run):
    _, out, _ = imported_run
    ours, source = fib.TraceSet.from_path(str(out)), fib.TraceSet.from_path(str(DATA))
    for name in (RAGGED, DECODE):
        assert ours.definitions[name] == source.definitions[name]
        source_workloads = {w.workload.uuid: w.workload for w in source.workloads[name]}
        for trace in ours.traces[name]:
            assert trace.workload == source_workloads[trace.workload.uuid]
            for spec in trace.workload.inputs.values():
                if spec.type == "safetensors":  # the blobs came along
                    assert (out / spec.path).read_bytes() == (DATA / spec.path).read_bytes()
    for name in ("ragged_causal_python", "ragged_no_mask_python", "decode_dps_python", "decode_wrong_scale_python"):
        assert ours.get_solution(name) == source.get_solution(name)


CASES = [dict(pattern="causal", documents=[9, 30, 25], seq_len=64),  # gqa_ragged prefill, packed documents
         dict(pattern="dense", batch=2, seq_len=48, q_len=16),  # gqa_ragged prefill, not causal
         dict(pattern="causal", batch=3, seq_len=70, q_len=5, page_size=16, kv_lens=[70, 33, 16]),  # paged prefill
         dict(pattern="causal", batch=2, seq_len=40, q_len=1, page_size=1, kv_lens=[40, 9])]  # paged decode, ps 1


@pytest.mark.parametrize("fields", CASES, ids=["docs", "dense", "paged", "decode"])
def test_definitions_made_from_our_cases_hold_to_their_schema_and_to_the_oracle(fields):
    case = Case(heads=8, kv_heads=2, head_dim=32, dtype="bfloat16", **fields)
    found = target(case)
    assert not isinstance(found, str)
    theirs = fib.Definition.model_validate(found.definition.model_dump(mode="json"))
    assert theirs.name == found.definition.name and theirs.op_type in ("gqa_ragged", "gqa_paged")
    agreement = cross_check(case, found)  # our reference code, run as theirs would be
    assert not isinstance(agreement, str) and agreement.agrees, agreement


def test_cases_without_an_op_type_are_left_out_with_the_reason():
    assert "no op type for static sparse masks" in target(Case(pattern="local"))
    assert "score modification" in target(Case(pattern="causal", score_mod="alibi"))


def record(status: str, **extra: object) -> Record:
    case = Case(pattern="causal", heads=4, kv_heads=2, head_dim=32, seq_len=24, dtype="bfloat16")
    return Record(case_id=case.case_id, impl="sdpa", params=case.params(), status=status, **extra)


def test_statuses_follow_the_record():
    error = ErrorInfo(max_abs=0.5, rel_l2=0.3, tolerance=0.02, rows_checked=24)
    times = TimeStats(median=1e-3, min=1e-3, max=1e-3, mean=1e-3, std=0.0, q1=1e-3, q3=1e-3, n=3, samples=[1e-3] * 3)
    assert status_of(record("ok", error=error, time_s=times)) == "PASSED"
    assert status_of(record("incorrect", error=error)) == "INCORRECT_NUMERICAL"
    assert status_of(record("failed", failure="timeout", reason="killed after 300 s")) == "TIMEOUT"
    assert status_of(record("failed", failure="error", reason="output has shape [3]; the ...")) == "INCORRECT_SHAPE"
    assert status_of(record("failed", failure="error", reason="output has dtype float32; ...")) == "INCORRECT_DTYPE"
    assert status_of(record("failed", failure="error", reason="RuntimeError: boom")) == "RUNTIME_ERROR"
    assert status_of(record("skipped", reason="no GPU")) is None
    lse = {"flashinfer": {"definition": "d", "definition_file": None, "root": None, "solution": None,
                          "solution_file": None, "lse": {"max_absolute_error": 0.0, "max_relative_error": 0.0,
                                                          "matched_ratio": 0.9, "inf_matched": 0,
                                                          "nonfinite_mismatched": 1, "elements": 10,
                                                          "passed": False}}}
    assert status_of(record("ok", error=error, time_s=times, config=lse)) == "INCORRECT_NUMERICAL"


def test_evaluations_validate_with_their_models(imported_run):
    run = load_run(imported_run[0])
    for r in run.records:
        made = evaluation(r, run, "flashinfer_reference", {})
        if made is not None:  # NaN and infinities as their JSON writes them
            again = fib.Evaluation.model_validate_json(made.model_dump_json())
            assert again.status.value == made.status
    assert json.loads(next(iter((imported_run[1] / "traces").rglob("*.jsonl"))).read_text().splitlines()[0])


def test_solutions_from_the_command_line_run_on_our_own_cases(tmp_path):
    """`bench run SUITE --solutions ROOT`: the dataset's solutions join a suite of ours, whose case maps to their
    definition by name (gqa_ragged_prefill_causal_h4_kv2_d32), and the export makes that definition itself."""
    suite = tmp_path / "ours.yaml"
    suite.write_text(yaml.safe_dump({"name": "ours", "impls": ["flashinfer_reference", "dense"], "measure": FAST,
                                     "defaults": {"heads": 4, "kv_heads": 2, "head_dim": 32, "dtype": "bfloat16",
                                                  "pattern": "causal", "seq_len": 40, "documents": [12, 28]}}))
    assert main(["run", str(suite), "--solutions", str(DATA), "--impl", "flashinfer_reference", "--impl", "dense",
                 "--impl", "ragged_causal_python", "--out", str(tmp_path / "results")]) == 0
    run_dir = only_run(tmp_path / "results")
    assert main(["export", str(run_dir), "--format", "flashinfer-trace", "-o", str(tmp_path / "out")]) == 0
    traces = fib.TraceSet.from_path(str(tmp_path / "out"))
    assert list(traces.definitions) == [RAGGED] and "sparse-attention-bench" in traces.definitions[RAGGED].tags[-1]
    by = {t.solution: t for t in traces.traces[RAGGED]}
    assert set(by) == {"ragged_causal_python", f"flashinfer_reference__{RAGGED}", f"dense__{RAGGED}"}
    assert all(t.evaluation.status == fib.EvaluationStatus.PASSED for t in by.values())
    (workload,) = traces.workloads[RAGGED]
    assert workload.workload.axes == {"len_indptr": 3, "total_q": 40, "total_kv": 40}
    assert workload.workload.inputs["qo_indptr"].type == "safetensors"
    stored = traces.get_workload_blob_tensor(workload.workload.inputs["qo_indptr"].path)
    assert stored["qo_indptr"].tolist() == [0, 12, 40]


def test_an_export_into_an_existing_dataset_keeps_the_traces_it_did_not_write(imported_run, tmp_path):
    import shutil

    run_dir, out, _ = imported_run
    root = tmp_path / "dataset"
    shutil.copytree(out, root)
    (trace_file,) = (root / "traces").rglob(f"{RAGGED}.jsonl")
    first = json.loads(trace_file.read_text().splitlines()[0])
    foreign = {**first, "solution": "someone_elses_kernel", "evaluation": {**first["evaluation"],
                                                                         "log": "written by another tool"}}
    trace_file.write_text(trace_file.read_text() + json.dumps(foreign) + "\n")
    before = len(trace_file.read_text().splitlines())
    assert main(["export", str(run_dir), "--format", "flashinfer-trace", "-o", str(root)]) == 0
    lines = [json.loads(line) for line in trace_file.read_text().splitlines()]
    assert any(line["solution"] == "someone_elses_kernel" for line in lines)  # the foreign line survives
    assert len(lines) == before  # ours were replaced, not doubled


def test_max_relative_error_is_the_elementwise_maximum(imported_run):
    run_dir, out, _ = imported_run
    traces = fib.TraceSet.from_path(str(out))
    records = {(r.case_id, r.impl): r for r in load_run(run_dir).records}
    for trace in (t for ts in traces.traces.values() for t in ts):
        correctness = trace.evaluation.correctness
        if correctness is None or correctness.extra is None:
            continue
        record = records[(correctness.extra["case_id"], correctness.extra["impl"])]
        if record.error is None or record.error.max_rel is None:
            continue
        assert correctness.max_relative_error == pytest.approx(record.error.max_rel)
        assert "elementwise maximum" in correctness.extra["relative_error"]
