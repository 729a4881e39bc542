"""Buffers under data parallelism (issue 10): batch norm's running statistics stay the same on
every replica (averaged over "dp" after each step, by the rule tests/workers/buffers_worker.py works by
hand), are part of ``full_state_dict``, and the plan lists the all-reduce that keeps them so."""

from __future__ import annotations

from examples.models import SmallCNN
from partita.compiler.compile import compile_model
from partita.core.cluster import load_cluster
from partita.core.model.capture import capture
from partita.core.model.inputs import parse_input_spec
from partita.core.model.losses import default_loss
from partita.core.model.ops import running_buffers
from partita.core.options import Options

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
