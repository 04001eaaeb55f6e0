"""Security: YAML safe loading only, no pickle of results, paths that cannot leave the results directory,
plugins loaded only from the paths a suite names."""

from __future__ import annotations

import re

import pytest

from bench.cli import main
from bench.errors import BadInput
from bench.results.store import create_run_dir
from tests.conftest import ROOT, write_suite


def test_yaml_tags_that_would_run_code_are_refused(tmp_path, capsys):
    marker = tmp_path / "pwned"
    path = write_suite(tmp_path, f"name: x\nimpls: [dense]\ndescription: !!python/object/apply:os.system "
                                 f"['touch {marker}']\n")
    assert main(["run", str(path), "--dry-run"]) == 2
    assert "malformed YAML" in capsys.readouterr().err
    assert not marker.exists()


def test_no_pickle_anywhere_in_the_code():
    # Results are JSON; worker pipes carry JSON lines; nothing unpickles data it did not make itself.
    pattern = re.compile(r"^\s*(import pickle|from pickle|import cPickle|import dill)|torch\.load\(|pickle\.loads?\(",
                         re.MULTILINE)
    offenders = [str(p.relative_to(ROOT)) for folder in ("bench", "impls") for p in (ROOT / folder).rglob("*.py")
                 if pattern.search(p.read_text())]
    assert offenders == []


@pytest.mark.parametrize("name", ["../x", "a/b", "..", "x/../../y", "UPPER", "", "a b"])
def test_suite_names_that_could_escape_the_results_directory_are_refused(name, tmp_path):
    with pytest.raises(BadInput, match=r"\[a-z0-9_-\]\+"):
        create_run_dir(tmp_path, name, "abc1234")
    assert list(tmp_path.iterdir()) == []


def test_run_ids_stay_inside_the_results_directory(tmp_path):
    run_id, run_dir = create_run_dir(tmp_path / "results", "ok_name", "../../../etc")
    assert run_dir.parent == tmp_path / "results"
    assert "/" not in run_id and ".." not in run_id


def test_only_the_named_plugins_are_imported(tmp_path, capsys):
    marker = tmp_path / "imported"
    (tmp_path / "named.py").write_text("")
    (tmp_path / "unnamed.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    path = write_suite(tmp_path, {"name": "x", "impls": ["dense"], "plugins": ["named.py"]})
    assert main(["run", str(path), "--dry-run"]) == 0
    capsys.readouterr()
    assert not marker.exists()


def test_a_plugin_that_fails_to_import_is_bad_input(tmp_path, capsys):
    (tmp_path / "broken.py").write_text("raise SystemError('planted')\n")
    path = write_suite(tmp_path, {"name": "x", "impls": ["dense"], "plugins": ["broken.py"]})
    assert main(["run", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "plugins[0]: plugin 'broken.py' failed to import: SystemError: planted" in err


def test_yaml_is_loaded_with_the_safe_loader_only():
    offenders = []
    for p in list((ROOT / "bench").rglob("*.py")) + list((ROOT / "impls").rglob("*.py")):
        text = p.read_text()
        if re.search(r"yaml\.(load|unsafe_load|full_load)\(", text) or "yaml.Loader" in text:
            offenders.append(str(p))
    assert offenders == []

