"""Replay three of a model's repeated layers in place of all of them, and write out the rest.

``annotate_saved_activations`` runs the captured graph forward and backward on fake tensors; a
70B model's 80 layers are 95% of that run, and every layer but the first and last behaves as
the second does. ``shortcut`` builds the graph with the layers of the largest repeated block
cut to its first, second and last (the last fed by the second's outputs, as it was by the one
before it), and ``expand`` rebuilds the full run's allocation events from the short run's:
the second layer's forward events once more per layer left out, each shifted by what one
layer's forward leaves alive (its saved tensors), and its backward events likewise, shifted by
what one layer's backward frees and adds (its saved tensors out, its parameters' gradients
in). Each copy is named after the layer it stands for, so every per-node figure and the step's
peak come out of the same account (``activations._transients``) as a full run's.

The rebuilt run is the full one where the middle layers do what the second does, which a
repeated block promises for their ops and shapes (passes/repeats.py: the same signature) and
``shortcut`` checks for their wiring: every middle layer and the last take their inputs from
the layer before at the same positions, and from outside the block the same nodes; nothing
after the block reads a middle layer. Where a check fails (or a layer's events are not one
run of events), the full graph is replayed. tests/unit/test_layer_replay.py compares the two
on GPT, Llama, BERT and Mixtral shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import networkx as nx
import torch.fx

from partita.passes.repeats import RepeatedBlock

Event = tuple[str | None, int, int, int]  # (node running, live bytes, saved bytes alive, storages alive)

MIN_LAYERS = 4  # three are replayed: below four nothing is left out


@dataclass(frozen=True)
class Shortcut:
    """The short graph and how its layers stand for the full graph's."""

    graph_module: torch.fx.GraphModule
    middle: tuple[str, ...]  # the second layer's nodes, in layer order
    left_out: tuple[tuple[str, ...], ...]  # each left-out layer's nodes, position for position with ``middle``


def shortcut(gm: torch.fx.GraphModule, G: nx.DiGraph, blocks: list[RepeatedBlock]) -> Shortcut | None:
    """The graph of ``gm`` with the largest repeated block of ``blocks`` cut to three layers, or None
    where the block is too short or its layers are not wired alike (see the module docstring)."""
    if not blocks:
        return None
    block = blocks[0]
    indices = list(block.indices)
    if len(indices) < MIN_LAYERS or indices != list(range(indices[0], indices[0] + len(indices))):
        return None
    layer_of = {f"{block.prefix}.{i}": k for k, i in enumerate(indices)}
    layers: list[list[torch.fx.Node]] = [[] for _ in indices]  # each layer's nodes, its parameters' included
    for node in gm.graph.nodes:
        k = layer_of.get(G.nodes[node.name].get("layer", "")) if node.name in G else None
        if k is not None:
            layers[k].append(node)
    if len({len(layer) for layer in layers}) != 1 or not layers[0]:
        return None
    where = {node: (k, p) for k, layer in enumerate(layers) for p, node in enumerate(layer)}
    wiring = [_wiring(layer, k, where) for k, layer in enumerate(layers)]
    if any(w != wiring[1] for w in wiring[2:]):
        return None  # a middle layer or the last wired unlike the second
    last = len(layers) - 1
    # a left-out layer's parameters stay placeholders (the graph's inputs), read by nothing
    dropped = {node for layer in layers[2:last] for node in layer if node.op == "call_function"}
    for node in gm.graph.nodes:
        if node in dropped:
            continue
        for src in node.all_input_nodes:
            if src in dropped and not (where.get(node, (None,))[0] == last and where[src][0] == last - 1):
                return None  # something past the block reads a middle layer
    # the last layer reads the one before it at the positions the second read the first
    remap = {a: b for a, b in zip(layers[last - 1], layers[1]) if a in dropped}
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in gm.graph.nodes:
        if node in dropped:
            continue
        env[node] = graph.node_copy(node, lambda a: env[remap.get(a, a)])
        if env[node].name != node.name:
            return None
    calls = [[n.name for n in layer if n.op == "call_function"] for layer in layers]
    return Shortcut(torch.fx.GraphModule(gm, graph), tuple(calls[1]), tuple(tuple(c) for c in calls[2:last]))


def _wiring(layer: list[torch.fx.Node], k: int, where: dict[torch.fx.Node, tuple[int, int]]) -> list[Any]:
    """Each node's target and constant arguments, and its inputs: inside its layer or the one before by
    position, elsewhere by name. (A constant that differs from layer to layer, say a per-layer scale or
    window, makes the layers unlike: their ops could then allocate differently.)"""
    rows = []
    for node in layer:
        named = node.op in ("placeholder", "get_attr")  # a parameter: its target is its own name
        row: list[Any] = [node.op, "" if named else str(node.target),
                          repr(torch.fx.map_arg((node.args, node.kwargs), lambda _: None))]
        for src in node.all_input_nodes:
            at = where.get(src)
            if at is not None and at[0] == k:
                row.append(("self", at[1]))
            elif at is not None and at[0] == k - 1:
                row.append(("before", at[1]))
            elif at is not None:
                row.append(("layer", at[0]))  # another layer of the block: never wired alike
            else:
                row.append(("outside", src.name))
        rows.append(row)
    return rows


def expand(cut: Shortcut, events: list[Event], births: list[tuple[int, int]],
           backward_at: int) -> tuple[list[Event], list[tuple[int, int]]] | None:
    """The full run's events and gradient births (event index, bytes) from the short run's
    (``backward_at``: the first backward event), or None where the second layer's forward or
    backward is not one unbroken run of events."""
    middle = set(cut.middle)
    forward = _run_of(events, middle, 0, backward_at)
    backward = _run_of(events, middle, backward_at, len(events))
    if forward is None or backward is None:
        return None
    names = [dict(zip(cut.middle, layer)) for layer in cut.left_out]  # copy k stands for left-out layer k
    extra = len(names)
    out: list[Event] = []
    at: list[int] = [0] * len(events)  # short event -> its index in ``out``
    copies: list[tuple[int, int]] = []  # (first index in ``out``, first short index) of each backward copy
    shift = (0, 0, 0)

    def emit(i: int, offset: tuple[int, int, int], name: str | None) -> None:
        _, live, saved, count = events[i]
        out.append((name, live + offset[0], saved + offset[1], count + offset[2]))

    (fa, fb), (ba, bb) = forward, backward
    delta_f, delta_b = _delta(events, fa, fb), _delta(events, ba, bb)
    for i in range(len(events)):
        if i == ba:  # the left-out layers' backward runs before the second's: the last of them first
            for m in range(extra):
                copies.append((len(out), ba))
                offset = _add(shift, delta_b, m)
                for j in range(ba, bb + 1):
                    emit(j, offset, names[extra - 1 - m][events[j][0]])
            shift = _add(shift, delta_b, extra)
        at[i] = len(out)
        emit(i, shift, events[i][0])
        if i == fb:  # after the second layer's forward, the left-out layers' in order
            for k in range(extra):
                offset = _add(shift, delta_f, k + 1)
                for j in range(fa, fb + 1):
                    emit(j, offset, names[k][events[j][0]])
            shift = _add(shift, delta_f, extra)
    grown = [(at[i], size) for i, size in births]
    grown += [(start + i - first, size) for start, first in copies for i, size in births if ba <= i <= bb]
    return out, grown


def _run_of(events: list[Event], names: set[str], start: int, stop: int) -> tuple[int, int] | None:
    """The first and last of ``events[start:stop]`` run by ``names``, where they are one unbroken run."""
    hits = [i for i in range(start, stop) if events[i][0] in names]
    if not hits or hits[0] == 0 or hits[-1] - hits[0] + 1 != len(hits):
        return None
    return hits[0], hits[-1]


def _delta(events: list[Event], first: int, last: int) -> tuple[int, int, int]:
    """What the run of events ``first``..``last`` leaves changed: live bytes, saved bytes, storages."""
    return tuple(events[last][k] - events[first - 1][k] for k in (1, 2, 3))  # type: ignore[return-value]


def _add(base: tuple[int, int, int], step: tuple[int, int, int], times: int) -> tuple[int, int, int]:
    return base[0] + step[0] * times, base[1] + step[1] * times, base[2] + step[2] * times
