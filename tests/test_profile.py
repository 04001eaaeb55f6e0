"""`bench profile`: a Chrome trace that loads as JSON with events, a table of top operators, clear refusals."""

from __future__ import annotations

import json

import torch

from bench.cli import main
from tests.conftest import write_suite

SUITE = {"name": "prof", "impls": ["dense"], "defaults": {"heads": 2, "head_dim": 16, "seq_len": 64, "device": "cpu"},
         "sweep": {"mode": ["fwd", "fwd_bwd"]}}


def test_profile_writes_a_chrome_trace_and_the_top_operators(tmp_path, capsys):
    suite = write_suite(tmp_path, SUITE)
    trace = tmp_path / "trace.json"
    assert main(["profile", str(suite), "--impl", "sdpa", "--case", "1", "-o", str(trace)]) == 0
    out = capsys.readouterr().out
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert "sdpa_call" in names  # one labelled range per traced call
    assert sum(e.get("name") == "sdpa_call" and e.get("ph") == "X" for e in events) == 3
    assert any(str(n).startswith("aten::") for n in names)
    assert any("backward" in str(n).lower() for n in names)  # case 1 is fwd_bwd
    assert "top" in out and "by self CPU time over 3 calls" in out and "aten::" in out
    assert "fwd_bwd | sdpa on cpu" in out and f"trace: {trace}" in out


def test_profile_default_output_names_suite_case_and_impl(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    suite = write_suite(tmp_path, SUITE)
    assert main(["profile", str(suite), "--impl", "dense"]) == 0
    (trace,) = (tmp_path / "profiles").glob("prof-local_w64-n64-*-dense.json")
    assert json.loads(trace.read_text())["traceEvents"]


def test_profile_refusals_name_the_flag(tmp_path, capsys, monkeypatch):
    suite = write_suite(tmp_path, SUITE)
    assert main(["profile", str(suite), "--impl", "dense", "--case", "2"]) == 2
    assert "--case: got 2; the suite has 2 cases: 0 to 1" in capsys.readouterr().err
    assert main(["profile", str(suite), "--impl", "nope"]) == 2
    assert "--impl: got 'nope'; known implementations:" in capsys.readouterr().err
    cuda_suite = write_suite(tmp_path, {**SUITE, "defaults": {**SUITE["defaults"], "device": "cuda"}}, "cuda.yaml")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["profile", str(cuda_suite), "--impl", "dense"]) == 2
    assert "cannot profile dense on case 0 (local_w64 N=64 B1H2D16 fp32 fwd): no CUDA device visible" in \
        capsys.readouterr().err
