"""Pipeline-parallel runtime on real gloo processes, against a single-process reference.

Each launch runs many checks (see pp_worker.py): pp=2 (example
GPT with GPipe and 1F1B, a tied-embedding GPT whose copies' gradients are
summed, forward-only inference), pp=4 (GPT with both schedules and their
traces, HF Llama whose rotary embeddings are relayed through the middle
stages), dp=2 x pp=2, tp=2 x pp=2, and dp=2 x tp=2 x pp=2 on 8 processes:
losses each step, first-step gradients and parameters after 3 steps per
stage, and the p2p sends per step equal to the tensors crossing the cuts.
"""

from __future__ import annotations

import pytest

import pp_worker
from harness import launch


@pytest.mark.slow
@pytest.mark.parametrize("name", list(pp_worker.LAUNCHES))
def test_pipeline_parallel_matches_single_process(name, tmp_path):
    world, checks = pp_worker.LAUNCHES[name]
    launch(world, checks, str(tmp_path))


def _in_flight(order):
    live = peak = 0
    for action, _ in order:
        live += 1 if action == "F" else -1
        peak = max(peak, live)
    return peak


def test_schedules_run_every_micro_batch_once_and_1f1b_bounds_activations():
    from partita.runtime.pipeline.stage import schedule_order

    p, m = 4, 8
    assert schedule_order("1f1b", p, 0, 4) == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("B", 1),
                                               ("B", 2), ("B", 3)]
    assert schedule_order("1f1b", p, 3, 4)[:4] == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    for s in range(p):
        for kind in ("gpipe", "1f1b"):
            order = schedule_order(kind, p, s, m)
            assert sorted(order) == sorted([("F", k) for k in range(m)] + [("B", k) for k in range(m)])
            assert all(order.index(("F", k)) < order.index(("B", k)) for k in range(m))
        assert _in_flight(schedule_order("1f1b", p, s, m)) == p - s  # stage i holds p - i micro-batches
        assert _in_flight(schedule_order("gpipe", p, s, m)) == m


def test_split_refuses_a_stage_map_against_the_graph_order():
    import torch

    from dp_worker import SEQ, gpt_loss
    from examples.models import gpt_tiny
    from partita.core.capture import capture
    from partita.core.errors import PlanError
    from partita.core.inputs import InputSpec
    from partita.runtime.pipeline.stage import split_stages

    c = capture(gpt_tiny(), [InputSpec("idx", torch.int64, (2, SEQ))], loss=gpt_loss)
    graph = c.graph_module.graph
    held = lambda n: n.name in c.param_nodes or n.name in c.buffer_nodes  # noqa: E731
    names = [n.name for n in graph.nodes]
    half = {n: int(i >= len(names) // 2) for i, n in enumerate(names)}
    stages = split_stages(graph, half, 2, held)
    assert stages[1].send == [] and stages[0].send == stages[1].recv and stages[0].send
    backwards = {n: 1 - s for n, s in half.items()}
    with pytest.raises(PlanError, match="stages must follow the graph's order"):
        split_stages(graph, backwards, 2, held)
    with pytest.raises(PlanError, match="no pipeline stage for node"):
        split_stages(graph, {n: 0 for n in names[1:]}, 2, held)
