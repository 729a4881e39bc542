"""ZeRO: the model state sharded over each data-parallel group, stage 1 (optimizer state), 2 (and
gradients) or 3 (and parameters); passes/dp/zero.py prices it, runtime/dp/zero.py runs it."""

from __future__ import annotations

from partita.core.axes.rules import Axis


def _plan_checks(plan) -> list[str]:
    z = plan.training.zero_stage
    if z > 0 and plan.mesh.dp == 1:
        return [f"training.zero_stage = {z} with mesh.dp = 1: no data-parallel group to shard over"]
    return []


AXIS = Axis("ZeRO", ("zero_stage",), (), _plan_checks)
