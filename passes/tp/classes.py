"""Which nodes the TP ILP ties to one choice: a class is the nodes at the same position of identical
layers (a repeated block's, passes/repeats.py) and the parameter nodes sharing a name
(``tying_classes``), split where members' strategy lists differ in layout (``split_unlike``). The
solver then picks one strategy per class (passes/tp/problem.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import networkx as nx

from partita.core.tp.vocabulary import Strategy
from partita.passes.repeats import RepeatedBlock


def tying_classes(G: nx.DiGraph, repeated: Sequence[RepeatedBlock]) -> dict[str, list[str]]:
    """Union of nodes at the same position of identical layers, and of parameter nodes sharing a name."""
    parent = {n: n for n in G.nodes}

    def find(n: str) -> str:
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    def union(a: str, b: str) -> None:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[rb] = ra

    by_layer: dict[str, list[str]] = {}
    for n, a in G.nodes(data=True):
        if a.get("layer"):
            by_layer.setdefault(a["layer"], []).append(n)
    for block in repeated:
        layers = [by_layer.get(name, []) for name in block.layers]
        first = layers[0]
        for other in layers[1:]:
            if len(other) != len(first):
                raise ValueError(f"repeated block {block.prefix}: layers of {len(first)} and {len(other)} nodes")
            for a, b in zip(first, other):
                union(a, b)
    by_param: dict[str, str] = {}
    for n, a in G.nodes(data=True):
        if a["kind"] == "param":
            union(by_param.setdefault(a["param_name"], n), n)
    groups: dict[str, list[str]] = {}
    for n in G.nodes:  # graph order: the representative is the first member
        groups.setdefault(find(n), []).append(n)
    return {members[0]: members for members in groups.values()}


def split_unlike(G: nx.DiGraph, groups: dict[str, list[str]],
                  own: Mapping[str, tuple[Strategy, ...]]) -> dict[str, list[str]]:
    """Each class split into members whose strategy lists match layout for layout.

    Members may still differ in which inputs carry a gradient (the first of a
    stack of layers reads the model's input, the others the previous layer's
    output): they keep their own strategies, index for index, so tying picks
    one layout for all and never changes what a member's own inputs need.
    """
    out: dict[str, list[str]] = {}
    for members in groups.values():
        if len(members) == 1:
            out[members[0]] = members
            continue
        by_layout: dict[tuple, list[str]] = {}
        for n in members:
            by_layout.setdefault(_layouts(own[n]), []).append(n)
        for part in by_layout.values():
            out[part[0]] = part
    position = {n: i for i, n in enumerate(G.nodes)}
    return dict(sorted(out.items(), key=lambda kv: position[kv[0]]))  # graph order, as tying_classes gives


def _layouts(ss: Sequence[Strategy]) -> tuple:
    """What tying may share between members: each strategy's layouts and costs, not its gradients."""
    return tuple((s.name, s.out, s.ins, s.compute_fraction, s.memory_fraction, s.internal) for s in ss)
