"""The CLI's plan readers start without torch: `partita --help`, `show`, `diff` and `view` read a plan file
(and the help its flags), nothing else, so they answer in well under a second instead of paying for torch's
import (3-11 s here). Each command runs in a fresh interpreter where ``import torch`` fails."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLAN = ROOT / "docs" / "gpt3-175b.plan.json"
NO_TORCH = ("import sys; sys.modules['torch'] = None\n"  # any `import torch` now raises ImportError
            "from partita.compiler.cli import main\n"
            "main(sys.argv[1:])\n")


@pytest.mark.parametrize("args, expect", [
    (["--help"], "compile"),
    (["compile", "--help"], "--micro-batch-size"),
    (["run", "--help"], "--checkpoint-every"),
    (["show", str(PLAN)], "dp=1 x tp=8 x pp=16"),
    (["diff", str(PLAN), str(PLAN)], "the same decisions"),
    (["view", str(PLAN), "-o", "{tmp}/plan.html"], "plan.html"),
])
def test_plan_readers_and_help_run_without_torch(args, expect, tmp_path):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    r = subprocess.run([sys.executable, "-c", NO_TORCH, *args], capture_output=True, text=True, timeout=60,
                       env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    assert expect in r.stdout + r.stderr


def test_the_guard_would_see_torch():
    """The check is real: a command that needs torch fails in that interpreter."""
    r = subprocess.run([sys.executable, "-c", NO_TORCH, "compile", "examples/models.py:MLP", "--input",
                        "x=float32[8,64]", "-o", "/dev/null"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode != 0 and "torch" in r.stderr
