"""Buffers under data parallelism (issue 10): batch norm's running statistics stay the same on
every replica (averaged over "dp" after each step, by the rule tests/buffers_worker.py works by
hand), are part of ``full_state_dict``, and the plan lists the all-reduce that keeps them so."""

from __future__ import annotations

import pytest

from examples.models import SmallCNN
from partita.compiler.compile import compile_model
from partita.core.capture import capture
from partita.core.cluster import load_cluster
from partita.core.inputs import parse_input_spec
from partita.core.losses import default_loss
from partita.core.ops import running_buffers
from partita.core.options import Options
from tests import buffers_worker
from tests.harness import beyond, launch

SPEC = "x=float32[16,3,32,32]"
# fp32: the runtime's all-reduced mean and the rule worked by hand add the same numbers in another order
RTOL, ATOL = 1e-5, 1e-6


def test_the_running_statistics_a_training_forward_writes_are_found_in_the_graph():
    captured = capture(SmallCNN, [parse_input_spec(SPEC)], loss=default_loss)
    written = running_buffers(captured.graph_module.graph, captured.buffer_nodes)
    names = sorted(captured.buffer_nodes[n] for n in written)
    assert names == ["bn1.running_mean", "bn1.running_var", "bn2.running_mean", "bn2.running_var"]
    assert sum(n for n, _ in written.values()) == 2 * (16 + 32)  # num_batches_tracked is an integer: not averaged


def test_a_dp_plan_lists_one_all_reduce_of_the_statistics():
    plan = compile_model(SmallCNN, Options(inputs=[parse_input_spec(SPEC)], cluster=load_cluster("local", devices=2),
                                           world_size=2, dp=2)).plan
    listed = [c for c in plan.collectives if "running statistics" in c.purpose]
    assert [(c.kind, c.axis, c.bytes, c.count) for c in listed] == [("all_reduce", "dp", 2 * (16 + 32) * 4, 1)]


@pytest.mark.slow
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
