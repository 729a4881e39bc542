"""The registry of parallelism axes: one module each, each declaring an ``Axis`` (core/axes/rules.py):
the settings it owns, its rules over settings and facts, and its checks of a plan.

Every part that asks something of every axis iterates ``AXES``: ``Pins`` checks their rules on the
pins alone (``check_pins``); the planner again with the facts the graph and the cluster give
(passes/search.py); verify on a plan with the facts its decisions give (``axis_problems``), so a
plan compile could not have written is refused whichever field was edited. docs/adding-an-axis.md
says what a new axis declares here and which files it touches.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from partita.core.axes import context, data, experts, offload, pipeline, recompute, sequence, tensor, zero
from partita.core.axes.rules import SETTINGS, Axis, broken_rules, pin_voice, plan_voice
from partita.core.errors import PartitaError

AXES: tuple[Axis, ...] = tuple(m.AXIS for m in (data, tensor, pipeline, zero, offload, recompute, sequence, experts,
                                                  context))


def pin_settings(pins: Any, *, inference: bool | None = None) -> dict[str, Any]:
    """The settings the pins fix (None: the planner's to choose), with the request's ``inference``."""
    values = {name: getattr(pins, name, None) for name in SETTINGS}
    values["recompute"] = None if pins.recompute is None else frozenset((pins.recompute,))
    values["inference"] = inference
    values["expert_load"] = _number(pins.expert_load)  # a router profile's load depends on ep: the planner's
    return values


def _number(value: Any) -> float | None:
    try:
        return None if value is None else float(value)
    except ValueError:
        return None


def check_pins(pins: Any, *, inference: bool | None = None, facts: Mapping[str, Any] | None = None) -> None:
    """Refuse, in one message, the first rule of any axis the pins break where all it reads is known."""
    values = {**pin_settings(pins, inference=inference), **(facts or {})}
    for axis in AXES:
        for message, hint in broken_rules(axis.rules, values, pin_voice(values)):
            raise PartitaError(message, hint=hint)


def plan_settings(plan: Any) -> dict[str, Any]:
    """A plan's settings, every one known, each read at its plan field (``SETTINGS``); ``recompute`` the
    set of its stages' modes."""
    values: dict[str, Any] = {"recompute": frozenset(s.recompute for s in plan.stages)}
    for name, (_, field) in SETTINGS.items():
        if name not in values:
            values[name] = functools.reduce(getattr, field.split("."), plan)
    return values


def plan_facts(plan: Any) -> dict[str, Any]:
    """What a plan's decisions say of the model and cluster: its attention cores and repeated layers,
    its experts, the cluster's host bandwidth. The residual stream is not recorded (None)."""
    from partita.core.cluster import ClusterSpec
    from partita.core.experts import decided_expert_modules
    from partita.core.recompute import decided_cores

    try:
        cluster = ClusterSpec.from_dict(plan.cluster)
        host = cluster.host_bandwidth > 0 and cluster.host_memory_bandwidth > 0
    except (PartitaError, TypeError, ValueError):
        host = None  # core/plans/verify.py's ``_cluster`` names it
    return {"attention_core": bool(decided_cores(plan.nodes, recompute.input_names(plan))),
            "repeated_layers": any(d.layer for d in plan.nodes), "residual_stream": None,
            "experts": bool(decided_expert_modules(plan.nodes)), "host_bandwidth": host,
            "sequence": sequence_length(plan.model.inputs), "heads": None}


def sequence_length(inputs: Any) -> int | None:
    """The sequence a model's inputs carry (dim 1, the same in every input of two or more dims; the
    dim context parallelism splits), or None when they carry none or disagree."""
    from partita.core.model.inputs import check_input_spec  # (without torch: plan readers run without it)

    try:
        return sequence_of(check_input_spec(s)[2] for s in inputs)
    except PartitaError:
        return None  # core/plans/verify.py names a malformed input


def sequence_of(shapes: Any) -> int | None:
    """Dim 1 of every shape of two or more dims, where they agree (the sequence), else None."""
    lengths = {tuple(s)[1] for s in shapes if len(tuple(s)) >= 2}
    return lengths.pop() if len(lengths) == 1 else None


def axis_summary(plan: Any) -> list[tuple[str, str | None]]:
    """(axis, what ``plan`` decided on it, or None where it is off), for every axis: the report's
    and the viewer's axis cards."""
    return [(axis.name, axis.describe(plan)) for axis in AXES]


def axis_problems(plan: Any) -> list[str]:
    """Every axis's rules broken by ``plan``, in the plan file's words, and its own plan checks."""
    values = {**plan_settings(plan), **plan_facts(plan)}
    say = plan_voice(values, plan.stages)
    out = []
    for axis in AXES:
        out += [message for message, _ in broken_rules(axis.rules, values, say)]
        if axis.plan_checks is not None:
            out += axis.plan_checks(plan)
    return out

