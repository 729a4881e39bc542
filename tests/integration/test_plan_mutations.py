"""A mutation matrix over a real plan: what starts processes (gloo
ranks, launchers, the console script, a browser); tests/unit/test_plan_mutations.py has the one-process checks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from partita.core.plan import SEAL, seal_digest
from tests.harness import ENV, ROOT
from tests.unit.test_plan_mutations import HARMLESS, captured, field_classes, good, mutations, refused  # noqa: F401 (fixtures)


def _get(d: Any, path: list) -> Any:
    for k in path:
        d = d[k]
    return d


def _set(d: Any, path: list, value: Any) -> None:
    for k in path[:-1]:
        d = d[k]
    d[path[-1]] = value


def _run(plan: Path, out: Path) -> list[str]:
    out.mkdir()
    r = subprocess.run([sys.executable, "-m", "partita.compiler.cli", "run", str(plan),
                        str(ROOT / "tests" / "workers" / "plan_run_script.py"), str(out / "losses.json")],
                       capture_output=True, text=True, timeout=600, cwd=ROOT, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((out / "losses.json").read_text())


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
    losses = [_run(p, tmp_path / f"run{i}") for i, p in enumerate((tp2_plan_path, path))]
    assert losses[0] == losses[1] and len(losses[0]) == 3, losses
