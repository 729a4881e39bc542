"""Activation recomputation: a stage reruns its attention cores (selective) or whole layers (full)
in backward instead of keeping what they saved (core/recompute.py)."""

from __future__ import annotations

from partita.core.axes.rules import Axis, Rule
from partita.core.recompute import FULL, SELECTIVE

RERUNS = frozenset((SELECTIVE, FULL))

UNDER_ZERO_3 = Rule(
    ("recompute", "zero_stage"), lambda v: bool(v["recompute"] & RERUNS) and v["zero_stage"] == 3,
    lambda say, v: f"{say('recompute', v['recompute'] & RERUNS)} with {say('zero_stage')}: recomputation reruns a "
                   "layer's forward in backward, where ZeRO-3 would free the parameters it gathers under it",
    "pin --zero 2 or lower, or drop --recompute")
NO_CORE = Rule(
    ("recompute", "attention_core"), lambda v: SELECTIVE in v["recompute"] and not v["attention_core"],
    lambda say, v: f"{say('recompute', {SELECTIVE})}: the model has no attention core in its repeated layers to "
                   "recompute (core/recompute.py: Q K^T through softmax to the product with V, or a fused attention "
                   "op)",
    "pin --recompute full to rerun whole layers, or leave it out")
NO_LAYER = Rule(
    ("recompute", "repeated_layers"), lambda v: FULL in v["recompute"] and not v["repeated_layers"],
    lambda say, v: f"{say('recompute', {FULL})}: the model has no repeated layer to rerun",
    "leave --recompute out")

def _describe(plan) -> str | None:
    from partita.core.recompute import RECOMPUTED

    modes = [s.recompute for s in plan.stages]
    parts = [f"{RECOMPUTED[m]} on stage(s) {', '.join(str(i) for i, x in enumerate(modes) if x == m)}"
             if len(modes) > 1 else RECOMPUTED[m] for m in (SELECTIVE, FULL) if m in modes]
    return f"{'; '.join(parts)} rerun in backward" if parts else None


AXIS = Axis("recomputation", ("recompute",), (UNDER_ZERO_3, NO_CORE, NO_LAYER), describe=_describe)


def input_names(plan) -> set[str]:
    """The placeholders of the model's captured inputs and targets (each named as its input spec)."""
    from partita.core.errors import PartitaError
    from partita.core.model.inputs import check_input_spec

    names = set()
    for text in (*plan.model.inputs, plan.model.targets):
        if text is None:
            continue
        try:
            names.add(check_input_spec(text)[0])
        except PartitaError:
            pass  # core/plans/verify.py's ``_model`` names it
    return names
