"""Pipeline-parallel runtime on real gloo processes, against a single-process reference.

Each launch runs many cases (pp_worker.py measures, the test asserts): pp=2 (example
GPT with GPipe and 1F1B, a tied-embedding GPT whose copies' gradients are
summed, forward-only inference), pp=4 (GPT with both schedules and their
traces, HF Llama whose rotary embeddings are relayed through the middle
stages), dp=2 x pp=2, tp=2 x pp=2, and dp=2 x tp=2 x pp=2 on 8 processes; interleaved 1F1B
with 2 chunks per rank on pp=2 (GPT with its trace, the tied GPT), dp=2 x pp=2 (HF Llama) and
tp=2 x pp=2, and with 3 chunks per rank on pp=2 (a 4-layer GPT):
losses each step, first-step gradients and parameters after 3 steps per
stage, and the p2p sends per step equal to the tensors crossing the cuts; forward-only
inference's output; the traces' spans, in each schedule's order.
"""

from __future__ import annotations

import pytest

# fp32: the stages compute what one process does; only the order of sums differs (micro-batches, tp)
RTOL, ATOL = 1e-4, 2e-5

CASES = {
    "pp2": ["gpt/dp=1/tp=1/pp=2/gpipe/m=4", "gpt/dp=1/tp=1/pp=2/1f1b/m=4", "tied-gpt/dp=1/tp=1/pp=2/1f1b/m=4",
            "gpt/inference/dp=1/pp=2", "gpt/dp=1/tp=1/pp=2/interleaved-1f1b/m=4",
            "tied-gpt/dp=1/tp=1/pp=2/interleaved-1f1b/m=6", "gpt-4l/dp=1/tp=1/pp=2/interleaved-1f1b/m=4"],
    "pp4-dp2xpp2-tp2xpp2": ["gpt/dp=1/tp=1/pp=4/1f1b/m=4", "gpt/dp=1/tp=1/pp=4/gpipe/m=4",
                            "hf-llama/dp=1/tp=1/pp=4/1f1b/m=4", "gpt/dp=2/tp=1/pp=2/1f1b/m=4",
                            "gpt/dp=1/tp=2/pp=2/gpipe/m=4", "gpt/inference/dp=2/pp=2",
                            "hf-llama/dp=2/tp=1/pp=2/interleaved-1f1b/m=4",
                            "gpt/dp=1/tp=2/pp=2/interleaved-1f1b/m=2"],
    "dp2xtp2xpp2": ["gpt/dp=2/tp=2/pp=2/1f1b/m=2"],
}


def _in_flight(order):
    live = peak = 0
    for action, _, _ in order:
        live += 1 if action == "F" else -1
        peak = max(peak, live)
    return peak


def test_schedules_run_every_micro_batch_once_and_1f1b_bounds_activations():
    from partita.runtime.pipeline.stage import schedule_order

    p, m = 4, 8
    assert schedule_order("1f1b", p, 0, 4) == [("F", 0, 0), ("F", 1, 0), ("F", 2, 0), ("F", 3, 0), ("B", 0, 0),
                                               ("B", 1, 0), ("B", 2, 0), ("B", 3, 0)]
    assert schedule_order("1f1b", p, 3, 4)[:4] == [("F", 0, 3), ("B", 0, 3), ("F", 1, 3), ("B", 1, 3)]
    for s in range(p):
        for kind in ("gpipe", "1f1b"):
            order = schedule_order(kind, p, s, m)
            assert sorted(order) == sorted([("F", k, s) for k in range(m)] + [("B", k, s) for k in range(m)])
            assert all(order.index(("F", k, s)) < order.index(("B", k, s)) for k in range(m))
        assert _in_flight(schedule_order("1f1b", p, s, m)) == p - s  # stage i holds p - i micro-batches
        assert _in_flight(schedule_order("gpipe", p, s, m)) == m


def _run_blocking(orders, p, v):
    """Play every rank's order as the runtime runs it: sends never block, a receive waits for the
    next message on its channel (sender, receiver, activations or gradients), messages on a channel
    arrive in the order sent. Returns the ranks' positions when nothing moves (all done: the ends)."""
    V, sent, got, pos = p * v, {}, {}, [0] * p
    moved = True
    while moved:
        moved = False
        for r in range(p):
            while pos[r] < len(orders[r]):
                a, k, c = orders[r][pos[r]]
                wants = (("act", (c - 1) % p, r), (c - 1, k)) if a == "F" and c > 0 else \
                    (("grad", (c + 1) % p, r), (c + 1, k)) if a == "B" and c < V - 1 else None
                if wants is not None:
                    channel, message = wants
                    queue, i = sent.get(channel, []), got.get(channel, 0)
                    if i >= len(queue):
                        break  # blocked: nothing arrived yet
                    assert queue[i] == message, (channel, queue[i], message)  # FIFO: the one expected
                    got[channel] = i + 1
                if a == "F" and c < V - 1:
                    sent.setdefault(("act", r, (c + 1) % p), []).append((c, k))
                if a == "B" and c > 0:
                    sent.setdefault(("grad", r, (c - 1) % p), []).append((c, k))
                pos[r] += 1
                moved = True
    return pos


def test_interleaved_order_runs_without_deadlock_and_messages_arrive_in_order():
    """Interleaved 1F1B on p ranks of v chunks: each rank runs every chunk's forward and backward of
    every micro-batch once, its forward before its backward; played with non-blocking sends and
    blocking receives (the runtime's), every rank finishes, and each channel's messages arrive in
    the order its receiver takes them. It holds more micro-batches than 1F1B (Narayanan et al.:
    rank 0 holds p (1 + (p - 1) / (p v)) micro-batches of its chunks)."""
    from partita.runtime.pipeline.stage import schedule_order

    for p in (2, 3, 4):
        for v in (2, 3, 4):
            for m in (p, 2 * p, 4 * p):
                orders = [schedule_order("interleaved-1f1b", p, r, m, v) for r in range(p)]
                for r, order in enumerate(orders):
                    chunks = range(r, p * v, p)
                    assert sorted(order) == sorted((a, k, c) for a in "FB" for k in range(m) for c in chunks)
                    assert all(order.index(("F", k, c)) < order.index(("B", k, c)) for k in range(m) for c in chunks)
                assert _run_blocking(orders, p, v) == [len(o) for o in orders], (p, v, m)
    assert _in_flight(schedule_order("interleaved-1f1b", 4, 0, 8, 2)) == 11  # 4 (1 + 3 / 8) x 2 chunks


def test_a_chunked_plan_that_cannot_run_is_refused():
    from partita.core.errors import PlanError
    from partita.runtime.pipeline.stage import schedule_order

    with pytest.raises(PlanError, match="groups of pp=4: 6 is not a multiple"):
        schedule_order("interleaved-1f1b", 4, 0, 6, 2)
    with pytest.raises(PlanError, match="at least 2 chunks"):
        schedule_order("interleaved-1f1b", 4, 0, 8, 1)


def test_split_refuses_a_stage_map_against_the_graph_order():
    import torch

    from examples.models import gpt_tiny
    from partita.core.errors import PlanError
    from partita.core.model.capture import capture
    from partita.core.model.inputs import InputSpec
    from partita.runtime.pipeline.stage import split_stages
    from tests.workers.dp_worker import SEQ, gpt_loss

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
