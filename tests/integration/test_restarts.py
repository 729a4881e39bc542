"""A rank SIGKILLed mid-run: what starts processes (gloo
ranks, launchers, the console script, a browser); tests/unit/test_restarts.py has the one-process checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from partita.compiler.compile import compile_model
from partita.core.cluster import load_cluster
from partita.core.model.inputs import parse_input_spec
from partita.core.options import Options
from tests.harness import WORKERS, partita_cli
from tests.workers import tied_script as script


def run(tmp: Path, plan: Path, kill_at: int) -> tuple[dict[int, float], dict]:
    out = tmp / f"kill{kill_at}"
    out.mkdir()
    r = partita_cli("run", "--checkpoint-dir", out / "ckpt", "--checkpoint-every", "2", "--max-restarts", "1", plan,
                    WORKERS / "restart_script.py", out, kill_at, timeout_s=400)
    lines = [json.loads(x) for x in (out / "losses.jsonl").read_text().splitlines()]
    attempts = {x["attempt"] for x in lines}
    assert attempts == ({0, 1} if kill_at else {0}), attempts
    if kill_at:
        assert "resumed from" in r.stdout and f"(step {kill_at - kill_at % 2})" in r.stdout, r.stdout[-2000:]
        # the restart happened after the kill, and did not hang: from the kill to the end of the first step
        # of the restarted run (a guard, not a timing: 10-20 s here alone, more beside other launcher tests;
        # benchmarks/restart_latency.py times it)
        latency = min(x["t"] for x in lines if x["attempt"] == 1) - float((out / "killed_at").read_text())
        assert 0 < latency < 300, f"the restarted run's first step ended {latency:.0f} s after the kill: it hangs"
    last = {x["step"]: x["loss"] for x in lines}  # a step rerun after the restart overwrites its first try
    return last, torch.load(out / "final.pt", weights_only=True)


# A pipeline (its stages' state, tied parameters across them, the schedule's sends) is the hardest run
# to resume; a data-parallel one is killed and resumed exactly by test_elastic.py (its lost node) and
# test_faults.py, so it is not run a third time here (84 s of the suite).
@pytest.mark.parametrize("mesh", [dict(pp=2)])
def test_a_killed_rank_restarts_and_resumes_to_the_uninterrupted_result(tmp_path, mesh):
    plan = compile_model(script.build("tied-gpt"),
                         Options(inputs=[parse_input_spec(f"idx=int64[4,{script.SEQ}]")],
                                 cluster=load_cluster("local", devices=2), world_size=2, **mesh)).plan
    path = plan.save(tmp_path / "plan.json")
    want_losses, want_state = run(tmp_path, path, kill_at=0)
    got_losses, got_state = run(tmp_path, path, kill_at=3)
    assert got_losses == want_losses
    assert set(got_state) == set(want_state)
    for k, v in want_state.items():
        assert torch.equal(got_state[k], v), k
