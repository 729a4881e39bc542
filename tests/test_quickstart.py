"""The README's quickstart runs exactly as the README prints it: its ``train.py`` is written from the
README's own code block, then each line of its shell block runs in that folder, as a user types it."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BIN = Path(sys.executable).parent  # the environment's `python` and `partita`, as `source .venv/bin/activate` gives


def quickstart_blocks() -> tuple[str, list[str], int]:
    """The README's quickstart: the train.py block, the shell lines, and the section's length in lines."""
    text = README.read_text()
    section = text[text.index("## Quickstart"):]
    section = section[:section.index("\n## ", 1)]
    train = re.search(r"<!-- quickstart: train.py -->\n```python\n(.*?)```", section, re.S)
    shell = re.search(r"<!-- quickstart: shell -->\n```bash\n(.*?)```", section, re.S)
    assert train and shell, "the README's quickstart lost its marked train.py or shell block"
    lines = [line for line in shell.group(1).splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return train.group(1), lines, len(section.splitlines())


def test_the_quickstart_is_short():
    _, lines, length = quickstart_blocks()
    assert length < 100, f"the quickstart is {length} lines"
    assert any(line.startswith("partita run ") for line in lines)


@pytest.mark.slow
def test_the_quickstart_runs_as_written(tmp_path):
    train, lines, _ = quickstart_blocks()
    (tmp_path / "train.py").write_text(train)
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "OMP_NUM_THREADS": "1"}
    outputs = {}
    for line in lines:
        command = shlex.split(line, comments=True)
        r = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"`{line}` failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        outputs[command[0] + " " + command[1]] = r.stdout + r.stderr
    # one process learns the counting sequences, as the README says
    losses = [float(x) for x in re.findall(r"^step \d+: loss ([0-9.]+)$", outputs["python train.py"], re.M)]
    assert len(losses) == 10 and losses[0] > 5 and losses[-1] < 0.05, losses
    assert "dp=2 x tp=1 x pp=1" in outputs["partita show"]
    # the 2-process run prints the same ten steps once (rank 0) and learns alike
    run = [float(x) for x in re.findall(r"^step \d+: loss ([0-9.]+)$", outputs["partita run"], re.M)]
    assert len(run) == 10 and run[-1] < 0.05, outputs["partita run"][-2000:]
    assert (tmp_path / "plan.json").is_file() and (tmp_path / "plan.html").stat().st_size > 10_000
