"""Activation recomputation's modes, and which nodes each one reruns: the one rule the planner
(passes/pipeline/costs.py prices it) and the runtime (runtime/tp/recompute.py runs it) share.

- ``full``: every node of a repeated layer reruns in backward; a layer keeps only its inputs.
- ``selective``: only each layer's *attention core* reruns (Korthikanti et al. 2022, "Reducing
  Activation Recomputation in Large Transformer Models", section 5): the ops from the scores
  matmul (Q K^T) to the matmul with V, whose saved tensors (scores, softmax, dropout mask; the
  5 a s^2 b term) grow with the square of the sequence while their FLOPs are few. A fused
  attention op (``scaled_dot_product_attention``) is a core of one node.
- ``none``: nothing reruns.

A core is found on the captured graph (``attention_cores``): in a repeated layer, in program
order, a matmul whose two operands both come from a model input (not a parameter: Q K^T and
P V, never a projection) opens a core, and the next such matmul that the first reaches closes
it; the core is every node of that layer from the one to the other, so it runs as one region.
A plan's node decisions record each node's op, layer and tensor inputs, so the same rule finds the
cores from the plan alone (``decided_cores``: what `partita verify` checks a selective plan by).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from partita.core.errors import PartitaError
from partita.core.model.ops import ATTENTION, MATMUL, base_op, op_name

if TYPE_CHECKING:  # torch is read by the functions that take fx nodes: the plan's checks run without it
    import torch.fx

NONE, SELECTIVE, FULL = "none", "selective", "full"
RECOMPUTE = (NONE, SELECTIVE, FULL)  # in the order of the time they add
RECOMPUTED = {SELECTIVE: "attention cores", FULL: "whole layers"}  # what each mode reruns, in words


def recompute_mode(value: Any) -> str | None:
    """A recomputation choice as this module names it: None (the planner decides), one of
    ``RECOMPUTE``, or True / False (full / none, as the keyword once was a flag)."""
    if value is None or value in RECOMPUTE:
        return value
    if value is True or value is False:
        return FULL if value else NONE
    raise PartitaError(f"recompute={value!r:.40} is not one of {', '.join(RECOMPUTE)}",
                       hint="selective reruns each layer's attention core, full whole layers, none nothing; "
                       "leave it out to let partita choose per stage")


class _Node(NamedTuple):
    """What the attention-core rule reads of one node: the captured graph's or a plan's decision's."""

    name: str
    op: str  # core/model/ops.py ``op_name``: "placeholder", "aten.bmm.default", "Tensor.softmax", ...
    inputs: tuple[str, ...]  # the nodes its arguments hold, in argument order, repeats kept


def attention_cores(nodes: Iterable[torch.fx.Node], layer_of: Mapping[str, str],
                    state: Collection[str]) -> dict[str, str]:
    """Node name -> its attention core (``"<layer>/attention<i>"``) for every node of a core
    (module docstring), given the graph's nodes in order, each node's repeated layer
    (``layer_of``; absent or "" outside them) and the placeholders that are model state
    (parameters, buffers)."""
    import torch.fx

    def read(n: torch.fx.Node) -> _Node:
        inputs: list[str] = []
        torch.fx.map_arg((n.args, n.kwargs), lambda a: inputs.append(a.name) or a)
        return _Node(n.name, op_name(n), tuple(inputs))

    nodes = list(nodes)
    return _cores([read(n) for n in nodes], layer_of,
                  {n.name for n in nodes if n.op == "placeholder" and n.name not in state})


def decided_cores(decisions: Iterable[Any], inputs: Collection[str]) -> dict[str, str]:
    """``attention_cores`` from a plan's node decisions (each with ``name``, ``op``, ``layer`` and
    ``ins``, its tensor inputs in argument order), ``inputs`` the placeholders that are the model's
    inputs: the same rule over what the plan records of the graph."""
    decisions = list(decisions)
    return _cores([_Node(d.name, d.op, tuple(lay.src for lay in d.ins)) for d in decisions],
                  {d.name: d.layer for d in decisions}, inputs)


def _cores(nodes: list[_Node], layer_of: Mapping[str, str], inputs: Collection[str]) -> dict[str, str]:
    from_input: set[str] = set()  # nodes a model input reaches
    for n in nodes:
        if (n.op == "placeholder" and n.name in inputs) or any(a in from_input for a in n.inputs):
            from_input.add(n.name)
    by_layer: dict[str, list[_Node]] = {}
    for n in nodes:
        layer = layer_of.get(n.name, "")
        if layer and _is_function_call(n.op):
            by_layer.setdefault(layer, []).append(n)
    cores: dict[str, str] = {}
    for layer, members in by_layer.items():
        spans: list[tuple[int, int]] = []
        opened: int | None = None
        reach: set[str] = set()  # the nodes of this layer the opening matmul reaches
        for i, n in enumerate(members):
            op = base_op(n.op)
            if opened is not None and any(a in reach for a in n.inputs):
                reach.add(n.name)
            if op in ATTENTION:
                spans.append((i, i))
                opened = None
            elif op in MATMUL and len(n.inputs) >= 2 and all(a in from_input for a in n.inputs[:2]):
                if opened is not None and n.name in reach:
                    spans.append((opened, i))
                    opened = None
                else:
                    opened, reach = i, {n.name}
        for c, (a, b) in enumerate(spans):
            for n in members[a:b + 1]:
                cores[n.name] = f"{layer}/attention{c}"
    return cores


def _is_function_call(op: str) -> bool:
    """Whether ``op`` (``op_name``) is a call_function node's: not a placeholder, attribute, output,
    method or module call."""
    return op not in ("placeholder", "get_attr", "output") and not op.startswith(("Tensor.", "module."))


def rerun_regions(stages: Iterable[Any], decisions: Iterable[Any], nodes: Iterable[torch.fx.Node],
                  state: Collection[str]) -> dict[str, str]:
    """Node name -> the region it reruns in backward: its layer on a stage that recomputes in
    full, its attention core on one that recomputes selectively (``stages``: the plan's, each with
    ``index`` and ``recompute``; ``decisions``: its nodes', each with ``name``, ``stage``,
    ``layer``; ``nodes``: the captured graph's, in order; ``state``: its parameter and buffer
    placeholders)."""
    modes = {s.index: s.recompute for s in stages}
    decisions = [d for d in decisions if d.layer and modes.get(d.stage, NONE) != NONE]
    cores = attention_cores(nodes, {d.name: d.layer for d in decisions}, state) \
        if any(modes[d.stage] == SELECTIVE for d in decisions) else {}
    return {d.name: d.layer if modes[d.stage] == FULL else cores[d.name]
            for d in decisions if modes[d.stage] == FULL or d.name in cores}
