"""Sequence parallelism: the residual stream (norms, dropouts, residual adds) split along the
sequence over the tensor-parallel group (passes/tp/sequence.py)."""

from partita.core.axes.rules import Axis, Rule

WITHOUT_TP = Rule(
    ("sequence_parallel", "tp"), lambda v: v["sequence_parallel"] and v["tp"] == 1,
    lambda say, v: f"{say('sequence_parallel')} with {say('tp')}: there is no TP group to split the sequence over",
    "pin --tp 2 or more, or drop --sequence-parallel")
NO_RESIDUAL = Rule(
    ("sequence_parallel", "residual_stream"), lambda v: v["sequence_parallel"] and not v["residual_stream"],
    lambda say, v: f"{say('sequence_parallel')}: the model has no residual stream to split (repeated layers "
                   "handing each other batch x sequence x hidden)",
    "drop --sequence-parallel")

AXIS = Axis("sequence parallelism", ("sequence_parallel",), (WITHOUT_TP, NO_RESIDUAL), describe=lambda plan: (
    f"the residual stream split along the sequence over tp = {plan.mesh.tp}"
    if plan.training.sequence_parallel else None))
