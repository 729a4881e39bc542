"""Tensor parallelism: each layer's tensors split over ``tp`` ranks inside a node (core/tp/, passes/tp/);
its layouts are checked node by node (core/verify.py ``_nodes``, ``_params``)."""

from partita.core.axes.rules import Axis

AXIS = Axis("tensor parallelism", ("tp",))
