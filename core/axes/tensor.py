"""Tensor parallelism: each layer's tensors split over ``tp`` ranks inside a node (core/tp/, passes/tp/);
its layouts are checked node by node (core/plans/verify.py ``_nodes``, ``_params``)."""

from partita.core.axes.rules import Axis

AXIS = Axis("tensor parallelism", ("tp",), describe=lambda plan: (
    f"tp = {plan.mesh.tp}: each layer's tensors split over {plan.mesh.tp} ranks" if plan.mesh.tp > 1 else None))
