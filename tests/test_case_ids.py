"""Case ids are the keys of history, baselines and comparisons: every suite's ids are pinned by a golden list, so a
change of the id format or its digest (a field entering it, a new default) is caught here, not in a broken history.
After an intended change: UPDATE_GOLDEN=1 pytest tests/test_case_ids.py, and say why in the commit."""

from __future__ import annotations

import json
import os
from pathlib import Path

from bench.spec.suite import load_suite
from tests.conftest import ROOT

GOLDEN = Path(__file__).parent / "golden" / "case_ids.json"


def test_every_suites_case_ids_are_the_golden_ones():
    ids = {p.name: [c.case_id for c in load_suite(p).cases] for p in sorted((ROOT / "suites").glob("*.yaml"))}
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.write_text(json.dumps(ids, indent=1) + "\n")
    golden = json.loads(GOLDEN.read_text())
    assert sorted(ids) == sorted(golden), "suites added or removed: UPDATE_GOLDEN=1 after checking the new ids"
    for name, expected in golden.items():
        changed = [(a, b) for a, b in zip(expected, ids[name], strict=False) if a != b]
        assert ids[name] == expected, f"{name}: case ids changed (first: {changed[:1]}); history keys on them"
