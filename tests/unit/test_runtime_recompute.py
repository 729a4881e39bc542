"""Activation recomputation in the runtime on real gloo processes (see recompute_worker.py).

Two launches of 2 processes. Full recomputation: GPT at dp=2 with ZeRO-1 and with ZeRO-2,
GPT and HF Llama at tp=2, and a GPT pipeline of 2 stages under 1F1B recomputing on stage 0
only. Selective recomputation (attention cores only): a GPT with its attention written out
at dp=2, tp=2 and on stage 0 of a 2-stage pipeline, and the fused-attention GPT at tp=2.
Each is run with and without recomputation
next to one process: losses, gradients and parameters against the reference,
the extra collectives exactly the recomputed layers' forward TP collectives,
and fewer activation bytes saved for backward where a stage recomputes.
ZeRO-3 with recomputation is refused before anything runs. (recompute_worker.py measures, the
test asserts.)
"""

from __future__ import annotations

import dataclasses

import pytest

from partita.core.errors import PlanError
from partita.core.plans.plan import NodeDecision, Stage
from partita.runtime.compose import refuse_unsupported
from tests.workers import dp_worker

# fp32: the plan sums the same numbers as one process, in another order (dp, tp, micro-batches)
RTOL, ATOL = 1e-4, 2e-5

CASES = {"2ranks": ["gpt/dp=2/tp=1/pp=1/none/zero1/m=2/full[0]", "gpt/dp=2/tp=1/pp=1/none/zero2/m=2/full[0]",
                    "gpt/dp=1/tp=2/pp=1/none/zero0/m=2/full[0]", "gpt/dp=1/tp=1/pp=2/1f1b/zero0/m=4/full[0]",
                    "hf-llama/dp=1/tp=2/pp=1/none/zero0/m=2/full[0]"],
         "selective": ["gpt-manual/dp=2/tp=1/pp=1/none/zero1/m=2/selective[0]",
                       "gpt-manual/dp=1/tp=2/pp=1/none/zero0/m=2/selective[0]",
                       "gpt-manual/dp=1/tp=1/pp=2/1f1b/zero0/m=4/selective[0]",
                       "gpt/dp=1/tp=2/pp=1/none/zero0/m=2/selective[0]"]}


def _recomputing(zero_stage: int, nodes: tuple[NodeDecision, ...]):
    plan = dp_worker.make_plan(2, zero_stage=zero_stage)
    stage = Stage(index=0, nodes=len(nodes), first_node="a", last_node="a", params=0, predicted_time_s=0.0,
                  memory_bytes=0, recompute="full")
    return dataclasses.replace(plan, nodes=nodes, stages=(stage,))


def test_recompute_refused_with_zero3_or_without_node_decisions():
    node = (NodeDecision("a", "aten.relu.default", "h.0", "replicate", ("replicate",), layer="h.0"),)
    refuse_unsupported(_recomputing(2, node))  # ZeRO-2 recomputes
    with pytest.raises(PlanError, match="ZeRO-3") as e:
        refuse_unsupported(_recomputing(3, node))
    assert "ZeRO <= 2" in e.value.hint
    with pytest.raises(PlanError, match="no node decisions"):
        refuse_unsupported(_recomputing(2, ()))
