"""Data parallelism: replicas of the model over ``dp`` groups of ranks, each on its share of the batch."""

from partita.core.axes.rules import Axis

AXIS = Axis("data parallelism", ("dp",), describe=lambda plan: (
    f"dp = {plan.mesh.dp}: replicas, each on 1/{plan.mesh.dp} of the batch" if plan.mesh.dp > 1 else None))
