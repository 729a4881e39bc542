"""Activation recomputation in the runtime on real gloo processes (see recompute_worker.py).

One launch of 2 processes: GPT at dp=2 with ZeRO-1 and with ZeRO-2 (tp=1, run
through the interpreter), GPT and HF Llama at tp=2, and a GPT pipeline of 2 stages under
1F1B recomputing on stage 0 only. Each is run with and without recomputation
next to one process: losses, gradients and parameters against the reference,
the extra collectives exactly the recomputed layers' forward TP collectives,
and fewer activation bytes saved for backward where a stage recomputes.
ZeRO-3 with recomputation is refused before anything runs.
"""

from __future__ import annotations

import dataclasses

import pytest

import dp_worker
import recompute_worker
from harness import launch
from partita.core.errors import PlanError
from partita.core.plan import NodeDecision, Stage
from partita.runtime.engine import refuse_unsupported


@pytest.mark.slow
@pytest.mark.parametrize("name", list(recompute_worker.LAUNCHES))
def test_recompute_matches_single_process_and_saves_activations(name, tmp_path):
    world, checks = recompute_worker.LAUNCHES[name]
    per_rank = launch(world, checks, str(tmp_path))
    cases = {r["case"] for results in per_rank for r in results}
    assert len(cases) == len(per_rank[0])


def _recomputing(zero_stage: int, nodes: tuple[NodeDecision, ...]):
    plan = dp_worker.make_plan(2, zero_stage=zero_stage)
    stage = Stage(index=0, nodes=len(nodes), first_node="a", last_node="a", params=0, predicted_time_s=0.0,
                  memory_bytes=0, recompute=True)
    return dataclasses.replace(plan, nodes=nodes, stages=(stage,))


def test_recompute_refused_with_zero3_or_without_node_decisions():
    node = (NodeDecision("a", "aten.relu.default", "h.0", "replicate", ("replicate",), layer="h.0"),)
    refuse_unsupported(_recomputing(2, node))  # ZeRO-2 recomputes
    with pytest.raises(PlanError, match="ZeRO-3") as e:
        refuse_unsupported(_recomputing(3, node))
    assert "ZeRO <= 2" in e.value.hint
    with pytest.raises(PlanError, match="no node decisions"):
        refuse_unsupported(_recomputing(2, ()))
