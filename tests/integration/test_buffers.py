"""Buffers under data parallelism (issue 10): what starts processes (gloo
ranks, launchers, the console script, a browser); tests/unit/test_buffers.py has the one-process checks."""

from __future__ import annotations

from examples.models import SmallCNN
from partita.compiler.compile import compile_model
from partita.core.cluster import load_cluster
from partita.core.model.inputs import parse_input_spec
from partita.core.options import Options
from tests.harness import beyond, launch
from tests.unit.test_buffers import ATOL, RTOL, SPEC
from tests.workers import buffers_worker


def test_running_statistics_are_averaged_over_dp_and_saved(tmp_path):
    plan = compile_model(SmallCNN, Options(inputs=[parse_input_spec(SPEC)], cluster=load_cluster("local", devices=2),
                                           world_size=2, dp=2, grad_accum_steps=2)).plan
    path = tmp_path / "cnn.plan.json"
    plan.save(path)
    for rank, r in enumerate(launch(2, buffers_worker.run, str(path))):
        assert len(r["stats"]) == buffers_worker.STEPS
        for step, found in enumerate(r["stats"]):
            assert not beyond(found, rtol=RTOL, atol=ATOL), f"rank {rank} step {step}: running statistics, by the rule"
        assert r["replicas_agree"], "the replicas' running statistics differ"
        assert r["strict_load_refused"] is None, r["strict_load_refused"]
        assert not beyond(r["saved_stats"], rtol=0, atol=0), f"rank {rank}: full_state_dict's running statistics"
        stats = [c for c in r["counted"] if c[2] == 2 * (16 + 32) * 4]
        assert stats == [["all_reduce", "dp", 2 * (16 + 32) * 4, 1]], r["counted"]
        assert r["planned"] == [["all_reduce", "dp", 2 * (16 + 32) * 4, 1]]
        assert r["moved"] > 0.01  # the statistics moved off their initial zeros
