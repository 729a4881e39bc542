"""The golden plan set (tests/golden.py): every case planned again gives the plan file kept in
tests/data/golden/, apart from the format fields (timings, the schema version, the seal).

A change that moves a plan on purpose rewrites the kept file (``python -m tests.golden CASE``) and
says why in its commit; any other difference is a regression of the planner. The files were written
with one torch: another captures graphs whose node names and decompositions may differ, so the
comparison runs under that torch only (the oldest-torch run skips it, saying so).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.golden import CASES, FOLDER, comparable, kept, plan_of


def test_the_set_is_large_and_every_case_is_kept():
    assert len(CASES) >= 30
    assert len({c.id for c in CASES}) == len(CASES)
    files = {p.stem for p in FOLDER.glob("*.json")}
    assert files == {c.id for c in CASES}, "a kept file without its case, or a case without its file"
    meshes = {json.dumps(kept(c)["mesh"], sort_keys=True) for c in CASES}
    assert len(meshes) >= 8, "the set should span many meshes, not one plan repeated"


def _differences(a, b, path="plan", out=None):
    out = [] if out is None else out
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                out.append(f"{path}.{k}: only in the {'kept' if k in a else 'new'} plan")
            else:
                _differences(a[k], b[k], f"{path}.{k}", out)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            _differences(x, y, f"{path}[{i}]", out)
    elif a != b:
        out.append(f"{path}: kept {json.dumps(a)[:120]}, now {json.dumps(b)[:120]}")
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_the_plan_is_unchanged(case):
    want = kept(case)
    written_with = want.pop("golden")["torch"]
    if torch.__version__.split("+")[0] != written_with:
        pytest.skip(f"the golden plans were written with torch {written_with}; this is torch {torch.__version__}")
    got = comparable(plan_of(case))
    problems = _differences(want, got)
    assert not problems, f"{case.id}: {len(problems)} differences:\n" + "\n".join(problems[:20])
