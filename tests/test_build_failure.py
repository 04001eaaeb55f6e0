"""A C++ kernel that fails to build keeps its whole compiler log where the user can read it (the run directory
under `bench run`), and the record's reason names the first error and points to the log (it kept only the last 300
characters before, which rarely held the cause)."""

from __future__ import annotations

import pytest

from impls.blocked import kernel


def test_a_failed_build_keeps_the_whole_log_and_points_to_it(tmp_path, monkeypatch):
    monkeypatch.setenv("BENCH_RUN_DIR", str(tmp_path))
    log = "Error building extension 'blocked_cpu_kernel':\n[1/2] c++ -c kernel.cpp\n" + \
        "kernel.cpp:25:34: error: 'brgemm' is not a member of 'at::native::cpublas'\n" + "note: context\n" * 400

    def failing_build(source, stem):
        raise RuntimeError(log)

    monkeypatch.setattr(kernel, "build_extension", failing_build)
    monkeypatch.setattr(kernel, "_module", None)
    monkeypatch.setattr(kernel, "_unavailable", None)
    assert kernel.kernel_module() is None
    reason = kernel._unavailable
    assert reason is not None
    saved = tmp_path / "blocked_cpu_kernel-build-error.log"
    assert "error: 'brgemm' is not a member of 'at::native::cpublas'" in reason
    assert reason.endswith(f"the whole compiler log: {saved}")
    assert log in saved.read_text()  # all of it, not its tail


def test_a_failed_build_is_tried_once_per_machine_and_source_not_once_per_process(tmp_path, monkeypatch):
    import torch.utils.cpp_extension as cpp

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    source = tmp_path / "broken.cpp"
    source.write_text("this is not C++\n")
    calls = []

    def failing_load(**kwargs):
        calls.append(kwargs["name"])
        raise RuntimeError("broken.cpp:1:1: error: 'this' does not name a type")

    monkeypatch.setattr(cpp, "load", failing_load)
    for _ in range(3):  # three processes of one machine, as far as the build cache can tell
        try:
            kernel.build_extension(source, "broken_kernel")
        except RuntimeError as exc:
            last = str(exc)
    assert len(calls) == 1  # built once; the other two read the failure
    assert "error: 'this' does not name a type" in last and "not tried again: delete" in last
    (marker,) = (tmp_path / "ext").glob("*.failed")
    marker.unlink()  # deleting the record tries again
    with pytest.raises(RuntimeError):
        kernel.build_extension(source, "broken_kernel")
    assert len(calls) == 2


def test_a_library_built_with_this_torch_is_loaded_not_rebuilt_from_another_environment(tmp_path, monkeypatch):
    """torch's builder rebuilds when its ninja file names another virtual environment's include paths; a library
    stamped with the same torch version, ABI and flags is loaded as it is, and another stamp builds again."""
    import torch
    import torch.utils.cpp_extension as cpp

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    source = tmp_path / "fine.cpp"
    source.write_text("// a kernel\n")
    builds, loads = [], []

    def fake_build(**kwargs):
        builds.append(kwargs["name"])
        (tmp_path / "ext" / kwargs["name"] / f"{kwargs['name']}.so").write_bytes(b"library")
        return "built"

    monkeypatch.setattr(cpp, "load", fake_build)
    monkeypatch.setattr(kernel, "_load_library", lambda name, library: loads.append(library) or "loaded")
    assert kernel.build_extension(source, "fine_kernel") == "built"
    assert kernel.build_extension(source, "fine_kernel") == "loaded"  # another process, another venv
    assert len(builds) == 1 and loads[0].name.endswith(".so")
    monkeypatch.setattr(torch, "__version__", "0.0.0-another")
    assert kernel.build_extension(source, "fine_kernel") == "built"
    assert len(builds) == 2
