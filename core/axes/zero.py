"""ZeRO: the model state sharded over each data-parallel group, stage 1 (optimizer state), 2 (and
gradients) or 3 (and parameters); passes/dp/zero.py prices it, runtime/dp/zero.py runs it."""

from __future__ import annotations

from partita.core.axes.rules import Axis


def _plan_checks(plan) -> list[str]:
    z = plan.training.zero_stage
    if z > 0 and plan.mesh.dp == 1:
        return [f"training.zero_stage = {z} with mesh.dp = 1: no data-parallel group to shard over"]
    return []


SHARDED = {1: "optimizer state", 2: "optimizer state and gradients", 3: "optimizer state, gradients and parameters"}

AXIS = Axis("ZeRO", ("zero_stage",), (), _plan_checks, lambda plan: (
    f"stage {plan.training.zero_stage}: {SHARDED[plan.training.zero_stage]} sharded over dp = {plan.mesh.dp}"
    if plan.training.zero_stage in SHARDED else None))
