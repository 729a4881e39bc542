"""Tied parameters across pipeline stages, through the planner's own plans (issue: the runs on several
processes (tests/unit/test_runtime_tied.py has the single-process checks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from partita.compiler.compile import compile_model
from partita.core.cluster import load_cluster
from partita.core.model.inputs import parse_input_spec
from partita.core.options import Options
from tests.harness import calls, fast_cluster, launch, plain_training
from tests.workers import tied_script as script


def reference(name: str, batch: int):
    model = script.build(name)
    return plain_training(model, script.optimizer(model.parameters()), script.batches(batch))


def compile_plan(tmp_path: Path, name: str, *, dp: int, batch: int) -> Path:
    cluster = load_cluster(fast_cluster(tmp_path), devices=4 * dp)
    spec = parse_input_spec(f"{script.INPUT[name]}=int64[{batch},{script.SEQ}]")
    plan = compile_model(script.build(name), Options(inputs=[spec], cluster=cluster, world_size=4 * dp, dp=dp, tp=2,
                                                     pp=2, optimizer="adamw")).plan
    path = tmp_path / f"{name}.plan.json"
    plan.save(path)
    return path


def runs(tmp_path: Path, dp: int) -> list[str]:
    """``NAME=PLAN.json`` of each model, planned for 4 x ``dp`` ranks (``tied_script.run``'s argument)."""
    return [f"{name}={compile_plan(tmp_path, name, dp=dp, batch=4 * dp)}" for name in script.MODELS]


# dp=2, the 8-rank mesh, runs in its one launch with the other files' 8-rank parts: tests/integration/test_mesh8.py
@pytest.mark.parametrize("dp", [1])
def test_tied_models_train_under_tp_and_pp_as_one_process(tmp_path, dp):
    launch(4 * dp, script.run, str(tmp_path), runs(tmp_path, dp), timeout_s=400)
    check(tmp_path, dp)


def check(tmp_path: Path, dp: int) -> None:
    """What each rank of ``tied_script.run`` at 4 x ``dp`` ranks wrote in ``tmp_path``, against one process."""
    batch = 4 * dp
    for name in script.MODELS:
        ref_losses, ref_state = reference(name, batch)
        for rank in range(4 * dp):
            data = json.loads((tmp_path / f"{name}.rank{rank}.json").read_text())
            assert data["losses"] == pytest.approx(ref_losses, rel=1e-5, abs=1e-5), (name, rank)
            assert calls(data["counted"]) == calls(data["planned"]), (name, rank)
            tied = [c for c in data["counted"] if c[1] == "pp" and c[0] == "all_reduce"]
            assert tied, (name, rank, "no tied-gradient all-reduce ran")  # both stages hold a copy
        state = torch.load(tmp_path / f"{name}.pt", weights_only=True)
        assert set(state) <= set(ref_state)
        for k, v in state.items():
            torch.testing.assert_close(v, ref_state[k], rtol=1e-4, atol=1e-5, msg=k)
