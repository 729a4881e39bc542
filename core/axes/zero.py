"""ZeRO: the model state sharded over each data-parallel group, stage 1 (optimizer state), 2 (and
gradients) or 3 (and parameters); passes/dp/zero.py prices it, runtime/dp/zero.py runs it."""

from __future__ import annotations

from partita.core.axes.rules import Axis


def _plan_checks(plan) -> list[str]:
    z, units, out = plan.training.zero_stage, plan.training.zero_units, []
    if z > 0 and plan.mesh.dp == 1:
        out.append(f"training.zero_stage = {z} with mesh.dp = 1: no data-parallel group to shard over")
    if units and z != 3:
        out.append(f"training.zero_units = {list(units)} with training.zero_stage = {z}: only ZeRO-3 gathers "
                   "parameters by units")
    layers = {d.layer for d in plan.nodes if d.layer}
    # compile's units are the repeated layers (passes/dp/zero.py ``zero_units``), each a layer of the plan's nodes
    unknown = [u for u in units if u not in layers]
    if unknown:
        out.append(f"training.zero_units names {', '.join(map(repr, unknown[:3]))}, no repeated layer of the plan's "
                   "nodes: ZeRO-3 gathers parameters by the model's layers")
    return out


SHARDED = {1: "optimizer state", 2: "optimizer state and gradients", 3: "optimizer state, gradients and parameters"}

AXIS = Axis("ZeRO", ("zero_stage",), (), _plan_checks, lambda plan: (
    f"stage {plan.training.zero_stage}: {SHARDED[plan.training.zero_stage]} sharded over dp = {plan.mesh.dp}"
    if plan.training.zero_stage in SHARDED else None))
