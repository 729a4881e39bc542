"""A test-only pipeline plan builder: cuts at chosen layer boundaries (not product code).

``pp_plan`` captures the training graph at the micro-batch shape, profiles it
(the planner's analyses), cuts it with the planner's own ``stage_of_nodes`` at
the given layer boundaries, and lays TP out with tests/tp_choice.py's
Megatron-style choice; it fills ``NodeDecision.stage``, ``ParamDecision.stage``
and ``Plan.stages`` (ranks from the mesh order, pp outermost), the schedule
and the micro-batches. ``expected_sends`` counts, from the planner's annotated
graph alone, the tensors each stage sends per step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from tests.tp_choice import MEGATRON, tp_plan


def boundary_cuts(G, layers_before: list[int]) -> list[str]:
    """Cut nodes for cuts at allowed boundaries number ``layers_before`` (0: before the first
    repeated layer, L: after the last), as ``stage_of_nodes`` takes them."""
    from partita.passes.pipeline.costs import allowed_boundaries, pipeline_order

    order = pipeline_order(G)
    allowed = allowed_boundaries(G, order)
    return [order[allowed[i] - 1] for i in layers_before]


def pp_plan(module, inputs: list, loss, targets, *, pp: int, cuts_at: list[int], schedule: str, tp: int = 1,
            dp: int = 1, mbs: int = 2, accum: int = 4, pins: Mapping[tuple[str, str], str] | None = MEGATRON,
            inference: bool = False, chunks: int = 1):
    """A plan of pp x ``chunks`` (virtual) stages cut at ``cuts_at``, stage s on pipeline rank s mod pp."""
    from partita.core.mesh import Mesh
    from partita.core.model.capture import capture
    from partita.core.model.inputs import InputSpec
    from partita.core.plans.plan import Stage
    from partita.passes.pipeline.stages import stage_of_nodes
    from partita.passes.profile import profile_model

    micro = [InputSpec(s.name, s.dtype, (mbs, *s.shape[1:])) for s in inputs]
    mt = InputSpec(targets.name, targets.dtype, (mbs, *targets.shape[1:])) if targets is not None else None
    captured = capture(module, micro, loss=None if inference else loss, targets=mt)
    profile = profile_model(captured)
    cuts = boundary_cuts(profile.graph, cuts_at)
    virtual = pp * chunks
    assert len(cuts) == virtual - 1
    stage = stage_of_nodes(profile, cuts)
    base = tp_plan(module, inputs, loss, targets, tp=tp, dp=dp, mbs=mbs, accum=accum, pins=pins,
                   captured=captured)
    nodes = tuple(dataclasses.replace(d, stage=stage[d.name]) for d in base.nodes)
    first_user: dict[str, int] = {}
    for n, q in captured.param_nodes.items():
        first_user[q] = min(first_user.get(q, virtual), stage[n])
    params = tuple(dataclasses.replace(p, stage=first_user[p.name]) for p in base.params)
    by_stage = [[d for d in nodes if d.stage == s] for s in range(virtual)]
    stages = tuple(
        Stage(index=s, nodes=len(ds), first_node=ds[0].name, last_node=ds[-1].name,
              params=sum(1 for p in params if p.stage == s), predicted_time_s=0.0, memory_bytes=0,
              ranks=tuple(((s % pp) * dp + d) * tp + t for d in range(dp) for t in range(tp)))
        for s, ds in enumerate(by_stage))
    training = dataclasses.replace(base.training, schedule=schedule, inference=inference, chunks=chunks,
                                   optimizer="none" if inference else base.training.optimizer)
    plan = dataclasses.replace(base, mesh=Mesh(dp=dp, tp=tp, pp=pp), nodes=nodes, params=params, stages=stages,
                               training=training, collectives=())
    return plan, profile, stage


def expected_sends(profile, stage: Mapping[str, int], pp: int, micro_batches: int, chunks: int = 1) -> list[int]:
    """Tensors each pipeline rank sends per step: m x (values live across its chunks' outgoing cuts,
    forward, + those of their incoming cuts that carry a gradient, backward); from the planner's graph."""
    G = profile.graph
    virtual = pp * chunks
    fwd, bwd = [0] * virtual, [0] * virtual
    for n, a in G.nodes(data=True):
        if a["kind"] in ("param", "buffer"):
            continue
        users = [stage[u] for u in G.successors(n)]
        for cut in range(stage[n], max(users, default=stage[n])):  # cut after stage `cut`
            fwd[cut] += len(a["shapes"]) if a.get("shapes") else 1
            if a.get("requires_grad"):
                bwd[cut + 1] += 1
    per_stage = [micro_batches * (f + b) for f, b in zip(fwd, bwd)]
    return [sum(per_stage[r::pp]) for r in range(pp)]
