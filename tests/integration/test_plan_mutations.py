"""A mutation matrix over a real plan: the harmless edits, trained on gloo ranks;
tests/unit/test_plan_mutations.py has the one-process checks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from partita.core.plans.plan import SEAL, seal_digest
from tests.harness import launch
from tests.unit.test_plan_mutations import HARMLESS, captured, field_classes, good, mutations, refused  # noqa: F401 (fixtures)
from tests.workers import plan_run_script


def _get(d: Any, path: list) -> Any:
    for k in path:
        d = d[k]
    return d


def _set(d: Any, path: list, value: Any) -> None:
    for k in path[:-1]:
        d = d[k]
    d[path[-1]] = value


def _run(plan: Path, out: Path) -> list[str]:
    """The plan's losses over 3 steps, on 2 ranks of the harness's group as `partita run` gives the plan."""
    launch(2, plan_run_script.run_plan, str(plan), str(out))
    return json.loads(out.read_text())


def test_harmless_edits_train_identically(good, captured, tp2_plan_path, tmp_path):
    """Every harmless field class's edit that loads, all at once: the run's losses equal the
    unedited plan's, bit for bit, on 2 gloo processes (3 steps of the example GPT)."""
    edited, applied = json.loads(json.dumps(good)), []
    for cls, data in mutations(good).items():
        if cls not in HARMLESS:
            continue
        path = next(p for p, _ in field_classes(data)[cls] if _get(data, p) != _get(good, p))
        trial = json.loads(json.dumps(edited))
        _set(trial, path, _get(data, path))
        trial[SEAL] = seal_digest(trial)
        if refused(trial, captured) is None:  # edits that together still load (a shape edit
            edited, applied = trial, applied + [cls]  # and a layout edit may not divide)
    assert len(applied) >= 80, applied
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(edited))
    losses = [_run(p, tmp_path / f"losses{i}.json") for i, p in enumerate((tp2_plan_path, path))]
    assert losses[0] == losses[1] and len(losses[0]) == 3, losses
