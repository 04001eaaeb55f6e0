"""[R5 2/6] `bench run --dry-run` as a full preflight (every option a real run would refuse, the pairs a resume would
measure, the skips it can predict), `--impl` as a filter of the suite's implementations, and the small breaks of
export and dashboard output paths."""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from bench.cli import main
from tests.synthetic import commit_id, noisy, record, write_run


def write_suite(tmp_path, name="tiny", impls=("dense", "sdpa"), **defaults):
    body = {"name": name, "impls": list(impls),
            "defaults": {"batch": 1, "heads": 1, "head_dim": 8, "device": "cpu", "mode": "fwd", **defaults},
            "sweep": {"seq_len": [32, 64], "pattern": ["causal"]}, "measure": {"warmup": 0, "repeat": 2}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def run(capsys, *args):
    code = main(["run", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(("extra", "message"), [
    (["--run-id", "bad id/../x"], "--run-id: got 'bad id/../x'; a run id is 1-100 letters"),
    (["--run-id", ""], "--run-id: got ''"),
    (["--run-id", "a" * 101], "a run id is 1-100"),
    (["--resume", "NOSUCH"], "--resume: not a run directory (no run.json)"),
    (["--out", "/nonexistent/dir"], "--out: its parent /nonexistent does not exist"),
    (["--impl", "naive_loop"], "not among suite tiny's implementations (dense, sdpa); --impl picks among those. "
                               "To measure one outside the suite, add it with --add-impl naive_loop"),
    (["--add-impl", "nosuch"], "--add-impl: got 'nosuch'; known implementations"),
])
def test_the_dry_run_refuses_what_the_real_run_refuses(tmp_path, capsys, extra, message):
    suite = write_suite(tmp_path)
    extra = [str(tmp_path / "nosuch") if a == "NOSUCH" else a for a in extra]
    for dry in (["--dry-run"], []):
        code, out, err = run(capsys, suite, "--out", tmp_path / "results", *extra, *dry)
        assert code == 2 and message in " ".join(err.split()), err
        assert "nothing was run" not in out
    assert not (tmp_path / "results").exists() or not any((tmp_path / "results").iterdir())


def test_an_existing_run_id_and_another_suites_run_are_refused_by_the_dry_run(tmp_path, capsys):
    suite, other = write_suite(tmp_path), write_suite(tmp_path, name="other")
    out_dir = tmp_path / "results"
    assert run(capsys, suite, "--out", out_dir, "--run-id", "first")[0] == 0
    code, _, err = run(capsys, suite, "--out", out_dir, "--run-id", "first", "--dry-run")
    assert code == 2 and "run 'first' exists already" in err
    code, _, err = run(capsys, other, "--resume", out_dir / "first", "--dry-run")
    assert code == 2 and "--resume" in err and "suite" in err


def test_a_resumed_dry_run_lists_only_the_missing_pairs(tmp_path, capsys):
    suite = write_suite(tmp_path)
    out_dir = tmp_path / "results"
    assert run(capsys, suite, "--out", out_dir, "--run-id", "r", "--impl", "dense")[0] == 0
    code, out, err = run(capsys, suite, "--resume", out_dir / "r", "--dry-run")
    text = " ".join(out.split())
    assert code == 0, err
    assert "2 (case, impl) pairs to run; 2 already in the run" in text and "nothing was run" in text


def test_predicted_skips_are_listed_with_their_reasons(tmp_path, capsys):
    suite = write_suite(tmp_path, impls=("dense", "flex"), mode="fwd_bwd")
    code, out, _ = run(capsys, suite, "--dry-run", "--add-impl", "cp_ring")
    text = " ".join(out.split())
    assert code == 0
    assert "predicted skips" in text and "flex" in text and "backward" in text.lower()
    assert "cp_ring (added: not in the suite)" in text and "4 to measure, 2 predicted skips" in text
    cuda = write_suite(tmp_path, name="gpu_only", device="cuda")
    code, out, _ = run(capsys, cuda, "--dry-run")
    if not __import__("torch").cuda.is_available():
        assert "no CUDA device visible" in out and "0 to measure" in " ".join(out.split())


def test_the_memory_model_predicts_a_skip(tmp_path, capsys, monkeypatch):
    from bench.measure import memory_model

    monkeypatch.setattr(memory_model, "host_available_bytes", lambda: 1024)
    suite = write_suite(tmp_path)
    code, out, _ = run(capsys, suite, "--dry-run")
    assert code == 0 and "memory model: dense needs at least" in " ".join(out.split())


def test_export_to_a_directory_and_a_torn_line_are_said(tmp_path, capsys):
    rng = np.random.default_rng(0)
    run_dir = write_run(tmp_path, commit=commit_id(1), records=[record(f"c{i}", "dense", noisy(rng, 1e-3))
                                                                for i in range(3)])
    assert main(["export", str(run_dir), "--format", "csv", "-o", str(tmp_path)]) == 2
    assert "is a directory; -o names the file to write" in capsys.readouterr().err
    with (run_dir / "records.jsonl").open("a") as f:
        f.write('{"case_id": "torn')
    assert main(["export", str(run_dir), "--format", "csv", "-o", str(tmp_path / "out.csv")]) == 0
    assert "last line is incomplete" in capsys.readouterr().err
    assert len((tmp_path / "out.csv").read_text().splitlines()) == 4  # the header and three records


def test_dashboard_refuses_an_output_in_a_missing_directory(tmp_path, capsys):
    rng = np.random.default_rng(0)
    run_dir = write_run(tmp_path / "results", commit=commit_id(1), records=[record("c", "dense", noisy(rng, 1e-3))])
    target = tmp_path / "missing" / "dash"
    assert main(["dashboard", str(run_dir), "-o", str(target)]) == 2
    assert "its parent" in capsys.readouterr().err and not (tmp_path / "missing").exists()


def test_bench_list_stays_readable_at_80_columns():
    from rich.console import Console

    from bench import registry
    from bench.cli.listing import impls_table

    console = Console(width=80, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(impls_table(80))
    text = console.export_text()
    assert len(text.splitlines()) < 4 * len(registry.all_impls()) + 8
    assert all(impl.name in text for impl in registry.all_impls())  # every name whole, never cut


def test_records_left_out_of_a_flashinfer_export_are_one_line_per_reason(tmp_path, capsys, monkeypatch):
    from bench.interop.flashinfer import export
    from bench.interop.flashinfer.cli import export_trace

    left = [export.LeftOut(case_id=f"local-{i}", impl="dense", reason="no op type for static sparse masks")
            for i in range(154)]
    summary = export.ExportSummary(root=str(tmp_path), traces=1, definitions=["d"], solutions=["s"], left_out=left)
    monkeypatch.setattr(export, "export_flashinfer", lambda run_dir, root, reference: summary)
    assert export_trace(tmp_path, tmp_path / "out", "flashinfer_reference") == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == ("bench export: left out 154 records (dense on local-0, ...): no op type for static sparse "
                      "masks") and len(err) == 2
