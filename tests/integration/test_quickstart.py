"""The README's quickstart runs exactly as the README prints it: the runs on several processes
(tests/unit/test_quickstart.py has the single-process checks)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess

from tests.unit.test_quickstart import BIN, quickstart_blocks


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
