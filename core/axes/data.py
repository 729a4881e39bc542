"""Data parallelism: replicas of the model over ``dp`` groups of ranks, each on its share of the batch."""

from partita.core.axes.rules import Axis

AXIS = Axis("data parallelism", ("dp",))
