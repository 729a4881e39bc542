"""Pipeline-parallel runtime on real gloo processes, against a single-process reference.

Each launch runs many cases (pp_worker.py measures, the test asserts): pp=2 (example
GPT with GPipe and 1F1B, a tied-embedding GPT whose copies' gradients are
summed, forward-only inference), pp=4 (GPT with both schedules and their
traces, HF Llama whose rotary embeddings are relayed through the middle
stages), dp=2 x pp=2, tp=2 x pp=2, and dp=2 x tp=2 x pp=2 on 8 processes:
losses each step, first-step gradients and parameters after 3 steps per
stage, and the p2p sends per step equal to the tensors crossing the cuts; forward-only
inference's output; the traces' spans, in each schedule's order.
"""

from __future__ import annotations

import pytest

from tests import pp_worker
from tests.harness import beyond, launch, numbers_beyond

# fp32: the stages compute what one process does; only the order of sums differs (micro-batches, tp)
RTOL, ATOL = 1e-4, 2e-5

CASES = {
    "pp2": ["gpt/dp=1/tp=1/pp=2/gpipe/m=4", "gpt/dp=1/tp=1/pp=2/1f1b/m=4", "tied-gpt/dp=1/tp=1/pp=2/1f1b/m=4",
            "gpt/inference/dp=1/pp=2"],
    "pp4-dp2xpp2-tp2xpp2": ["gpt/dp=1/tp=1/pp=4/1f1b/m=4", "gpt/dp=1/tp=1/pp=4/gpipe/m=4",
                            "hf-llama/dp=1/tp=1/pp=4/1f1b/m=4", "gpt/dp=2/tp=1/pp=2/1f1b/m=4",
                            "gpt/dp=1/tp=2/pp=2/gpipe/m=4", "gpt/inference/dp=2/pp=2"],
    "dp2xtp2xpp2": ["gpt/dp=2/tp=2/pp=2/1f1b/m=2"],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(pp_worker.LAUNCHES))
def test_pipeline_parallel_matches_single_process(name, tmp_path):
    world, checks = pp_worker.LAUNCHES[name]
    for rank, results in enumerate(launch(world, checks, str(tmp_path))):
        assert [r["case"] for r in results] == CASES[name]
        for r in results:
            what = f"rank {rank} {r['case']}" + (f" stage {r['stage']}" if "stage" in r else "")
            if "inference" in r["case"]:
                assert not beyond(r["output"], rtol=RTOL, atol=ATOL), f"{what}: inference output"
                continue
            assert not numbers_beyond(r["losses"], r["ref_losses"], rtol=RTOL, atol=ATOL), f"{what}: losses"
            assert not beyond(r["grads"], rtol=RTOL, atol=ATOL), f"{what}: first step's gradients"
            assert not beyond(r["params"], rtol=RTOL, atol=ATOL), f"{what}: parameters after the last step"
            assert r["held"] and not r["not_the_models"], (what, "holds", r["held"], r["not_the_models"])
            # every parameter is held by some stage, and nothing else
            assert not r["held_by_none"] and not r["held_by_some"], (what, r["held_by_none"], r["held_by_some"])
            for step, sends in enumerate(r["p2p_sends"]):
                assert sends == r["expected_sends"], f"{what} step {step}: p2p sends, and the tensors crossing cuts"
            if "trace" in r:  # every micro-batch's F and B on every rank, in the schedule's order
                trace = r["trace"]
                assert trace["spans"] == trace["expected_spans"], (what, trace["spans"], trace["expected_spans"])
                assert trace["fingerprint"] == trace["plan_fingerprint"], what
                for stage in trace["orders"]:
                    assert stage["order"] == stage["schedule"], (what, stage)
        assert sum("trace" in r for r in results) == (2 if name == "pp4-dp2xpp2-tp2xpp2" else 0)


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

    from examples.models import gpt_tiny
    from partita.core.capture import capture
    from partita.core.errors import PlanError
    from partita.core.inputs import InputSpec
    from partita.runtime.pipeline.stage import split_stages
    from tests.dp_worker import SEQ, gpt_loss

    c = capture(gpt_tiny(), [InputSpec("idx", torch.int64, (2, SEQ))], loss=gpt_loss)
    graph = c.graph_module.graph
    held = lambda n: n.name in c.param_nodes or n.name in c.buffer_nodes
    names = [n.name for n in graph.nodes]
    half = {n: int(i >= len(names) // 2) for i, n in enumerate(names)}
    stages = split_stages(graph, half, 2, held)
    assert stages[1].send == [] and stages[0].send == stages[1].recv and stages[0].send
    backwards = {n: 1 - s for n, s in half.items()}
    with pytest.raises(PlanError, match="stages must follow the graph's order"):
        split_stages(graph, backwards, 2, held)
    with pytest.raises(PlanError, match="no pipeline stage for node"):
        split_stages(graph, {n: 0 for n in names[1:]}, 2, held)
