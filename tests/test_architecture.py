"""The architecture's promises: a worker that cannot start gives failed records, plugins come from installed
packages (entry points), the Python API runs suites, setup phases are recorded, modules stay small."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from bench import api
from tests.conftest import PLUGINS, ROOT, only_run_dir, read_jsonl, run_bench, write_suite

SMALL = {"heads": 2, "head_dim": 16, "seq_len": 64, "device": "cpu"}
QUICK = {"warmup": 0, "repeat": 2, "max_time_s": 0.01, "memory": "worker"}  # no fresh process per pair


def test_a_plugin_failing_inside_the_worker_gives_failed_records_not_a_traceback(tmp_path):
    (tmp_path / "fails_in_worker.py").write_text((PLUGINS / "fails_in_worker.py").read_text())
    suite = write_suite(tmp_path, {"name": "broken", "impls": ["needs_the_worker", "dense"],
                                   "plugins": ["fails_in_worker.py"], "defaults": SMALL,
                                   "sweep": {"pattern": ["local", "causal"]}, "measure": QUICK})
    proc = run_bench("run", str(suite), "--out", str(tmp_path / "results"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    records = read_jsonl(only_run_dir(tmp_path / "results") / "records.jsonl")
    assert len(records) == 4  # one per pair the worker was to measure
    for r in records:
        assert r["status"] == "failed" and r["failure"] == "startup", r
        assert r["reason"].startswith("worker could not start: plugin 'fails_in_worker.py' failed to import: "
                                      "ImportError: planted: this plugin cannot be imported in the worker")
    assert "0 ok, 0 skipped, 4 failed" in proc.stdout


def test_an_installed_plugin_package_registers_through_its_entry_point(tmp_path):
    package = tmp_path / "src"
    (package / "my_kernel").mkdir(parents=True)
    (package / "my_kernel" / "__init__.py").write_text("")
    (package / "my_kernel" / "bench_plugin.py").write_text(
        "from bench.patterns import Pattern, register_pattern\n"
        "from bench.registry import Impl, register\n\n"
        "@register\n"
        "class MyKernel(Impl):\n"
        "    name = 'my_kernel'\n"
        "    def prepare(self, case, pattern, q, k, v):\n"
        "        from impls.dense import Dense\n"  # a stand-in kernel: correct, so the record is ok
        "        return Dense().prepare(case, pattern, q, k, v)\n\n"
        "@register_pattern\n"
        "class Stripes(Pattern):\n"
        "    name = 'my_stripes'\n"
        "    length_free = True\n"
        "    def allowed(self, i, j):\n"
        "        return ((i - j) % 3 == 0) | (i == j)\n")
    (package / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "my-kernel"\nversion = "0.1"\n'
        '[project.entry-points."sparse_attention_bench.plugins"]\nmy_kernel = "my_kernel.bench_plugin"\n')
    site = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                          "--target", str(site), str(package)], capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    env = {"PYTHONPATH": f"{ROOT}:{site}"}  # the package is installed there; no `plugins:` line anywhere
    suite = write_suite(tmp_path, {"name": "installed", "impls": ["my_kernel", "dense"], "defaults": SMALL,
                                   "sweep": {"pattern": ["my_stripes", "causal"]}, "measure": QUICK})
    proc = run_bench("run", str(suite), "--out", str(tmp_path / "results"), env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = read_jsonl(only_run_dir(tmp_path / "results") / "records.jsonl")
    assert {(r["impl"], r["params"]["pattern"]) for r in records if r["status"] == "ok"} == {
        ("my_kernel", "my_stripes"), ("my_kernel", "causal"), ("dense", "my_stripes"), ("dense", "causal")}
    listing = run_bench("list", "impls", env={**env, "COLUMNS": "250"})
    line = next(ln for ln in listing.stdout.splitlines() if "my_kernel" in ln)
    assert "package my-kernel (entry point my_kernel)" in line
    patterns = run_bench("list", "patterns", env={**env, "COLUMNS": "250"})
    assert "package my-kernel (entry point my_kernel)" in next(ln for ln in patterns.stdout.splitlines()
                                                               if "my_stripes" in ln)


def test_the_python_api_runs_a_suite_given_as_a_dict_and_returns_its_records(tmp_path):
    records = api.run({"name": "notebook", "impls": ["dense", "flex"], "defaults": SMALL,
                       "sweep": {"pattern": ["local", "causal"]}, "measure": QUICK},
                      out=tmp_path / "results", quiet=True)
    assert [(r.impl, r.params["pattern"]) for r in records] == [
        ("dense", "local"), ("flex", "local"), ("dense", "causal"), ("flex", "causal")]
    assert all(r.status == "ok" and r.error.rel_l2 <= r.error.tolerance for r in records)
    stored = read_jsonl(only_run_dir(tmp_path / "results") / "records.jsonl")
    assert [r["case_id"] for r in stored] == [r.case_id for r in records]
    # flex marks its phases: the BlockMask is mask building, torch.compile's first trace is compilation
    for r in records:
        assert r.setup is not None and r.setup.first_call_s is not None
        assert r.setup.mask_s is not None and r.setup.mask_s > 0  # dense builds its mask, flex its BlockMask
        if r.impl == "flex":
            assert r.setup.compile_s is not None and r.setup.compile_s > 0
            assert r.setup.compile_s + r.setup.mask_s + r.setup.first_call_s <= r.setup_s + 1e-6
        else:
            assert r.setup.compile_s is None  # dense compiles nothing


def _sources(*dirs: str) -> list[Path]:
    return [p for d in dirs for p in (ROOT / d).rglob("*.py") if "__pycache__" not in p.parts]


def test_no_module_is_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in _sources("bench", "impls", "tests")
            if (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"modules past 400 lines (split them by job): {long}"


def _triton_kernel(node: ast.FunctionDef) -> bool:
    """@triton.jit (or @triton.autotune / @triton.heuristics over it): a GPU kernel, one body by necessity."""
    return any(ast.unparse(d).startswith(("triton.", "jit")) for d in node.decorator_list)


def test_no_function_is_over_60_lines_outside_triton_kernels():
    long = {f"{p.relative_to(ROOT)}:{n.name}": n.end_lineno - n.lineno + 1 for p in _sources("bench", "impls", "tests")
            for n in ast.walk(ast.parse(p.read_text()))
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.end_lineno - n.lineno + 1 > 60
            and not _triton_kernel(n)}
    assert not long, f"functions past 60 lines (split them by step): {long}"


DICT_ANY_LIMIT = 99  # round 4 started at 206 (98 now); data with a schema is a model (bench.results.records, ...)


def test_untyped_dicts_stay_under_the_ratchet():
    """`dict[str, Any]` in bench/ is for data without a schema of ours (suite content, an implementation's free-form
    config, external formats, JSON from another checkout); the count only goes down."""
    count = sum(p.read_text().count("dict[str, Any]") for p in _sources("bench"))
    assert count < DICT_ANY_LIMIT, f"{count} `dict[str, Any]` in bench/ (limit {DICT_ANY_LIMIT}): type the new data"


def test_child_processes_are_started_in_one_place():
    """Only bench/run/child.py starts processes with subprocess.Popen (workers, ranks, calibration, janitor); only it
    and the fork server (which must fork, not exec) fork or kill; nothing sends a raw dict down a child's pipe."""
    def calls(path: Path) -> list[ast.Call]:
        return [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)]

    def dotted(node: ast.AST) -> str:
        return f"{dotted(node.value)}.{node.attr}" if isinstance(node, ast.Attribute) else getattr(node, "id", "?")

    files = {str(p.relative_to(ROOT)): p for p in (ROOT / "bench").rglob("*.py")}
    starters = sorted(name for name, p in files.items() if "Popen(" in p.read_text())
    assert starters == [str(Path("bench/run/child.py"))]
    forking = {name for name, p in files.items()
               if any(dotted(c.func) in ("os.fork", "os.kill", "os.killpg", "os.forkpty") for c in calls(p))}
    assert forking == {str(Path("bench/run/child.py")), str(Path("bench/run/forkserver.py"))}, forking
    def is_raw(arg: ast.expr) -> bool:  # a dict literal, or a model dumped to a dict
        return isinstance(arg, ast.Dict) or dotted(getattr(arg, "func", arg)).endswith("model_dump")

    raw = [f"{name}:{c.lineno}" for name, p in files.items() if name.startswith(str(Path("bench/run")))
           for c in calls(p) if dotted(c.func).split(".")[-1] in ("send", "_ask", "close") and c.args
           and is_raw(c.args[0])]
    assert not raw, f"raw dicts sent to a child (send a bench.run.messages model): {raw}"
    from bench.run.child import Child, ChildSide

    for send in (Child.send, ChildSide.send):
        assert "dict" not in str(send.__annotations__["message"]), send


def _import_graph() -> dict[str, set[str]]:
    """bench's modules and what each imports, at module level or inside functions (lazy imports count too)."""
    def name(p: Path) -> str:
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    files = {name(p): p for p in (ROOT / "bench").rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps |= {m for m in (node.module, *(f"{node.module}.{a.name}" for a in node.names)) if m in files}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in files}
        graph[module] = deps - {module}
    return graph


def test_no_import_circles_between_modules():
    """A circle (ab_suite -> runner -> worker -> ab_suite was one) is allowed only as a package and its own
    modules (an __init__ re-exporting them)."""
    graph = _import_graph()
    reach = {m: set(deps) for m, deps in graph.items()}
    changed = True
    while changed:  # transitive closure; bench has ~120 modules
        changed = False
        for m in reach:
            more = set().union(*(reach[d] for d in reach[m])) - reach[m]
            if more:
                reach[m] |= more
                changed = True
    circles = {m for m in reach if m in reach[m]}
    packages_own = {m for m in circles if any(m == p or m.startswith(p + ".") for p in circles if p in reach[p]
                                              and (ROOT / p.replace(".", "/") / "__init__.py").exists()
                                              and m in reach[p] and p in reach[m])}
    assert not circles - packages_own, sorted(circles - packages_own)
    assert "bench.run.ab.suite" not in reach["bench.run.ab.suite"]


def test_one_pairs_measurement_names_its_steps_in_one_function_in_the_order_open_takes_them():
    import inspect
    import re

    from bench.measure.pair import PairSession, _measure

    source = inspect.getsource(_measure)
    named = re.findall(r"session\.(\w+),", source)
    assert tuple(named) == PairSession.EARLY_STEPS
    assert all(f"session.{step}()" in source for step in ("time", "memory", "quality"))
    assert "session.record(" in source and len(source.splitlines()) <= 80
