"""Sequence parallelism (Korthikanti et al. 2022, section 4.2.2): between the tensor-parallel
regions, the residual stream is split along the sequence over the TP group instead of held whole
on every rank.

In the TP rules' words (core/tp/rules.py) that is a layout, not a new op: every node of the
residual stream (``residual_nodes``: a call in a repeated layer whose output has the shape of
what one layer hands the next, batch x sequence x hidden, and that neither multiplies matrices, looks up an
embedding nor only makes a view: norms, dropouts, residual adds) takes ``shard(1)``. A
row-parallel linear's partial sums then reach it by a reduce-scatter, and a column-parallel
linear gathers its input by an all-gather: the volume of the all-reduce they replace.
``sequence_parallel_strategies`` is the strategy list of core/tp/strategies.py with that
choice made for those nodes; the TP ILP (passes/tp/ilp.py) solves the rest around it. It is the
layout ``--sequence-parallel`` pins (passes/search.py). Unpinned, the ILP already splits each norm
and dropout along the sequence where that is faster (a norm's compute divides by t), and the two
layouts' activation memory is the same in the cost model: what Megatron-LM's sequence parallelism
adds beyond this, a column-parallel linear keeping its input split and gathering it again in
backward (the last 4 s b h of Korthikanti's 10 s b h), is not built (docs/cost-model.md).
On the GPTs measured (dropout 0.1, tp = 2) the pinned and the free layout hold the same
activations; the pin makes the layout Megatron's on every layer, whatever the solver's ties.
"""

from __future__ import annotations

from collections import Counter

import networkx as nx

from partita.core.model.ops import MATMUL, base_op
from partita.core.placement import shard
from partita.core.tp.strategies import node_strategies
from partita.core.tp.vocabulary import Strategy
from partita.passes.flops import is_view

SEQUENCE_DIM = 1  # batch x sequence x hidden


def residual_shape(G: nx.DiGraph) -> tuple[int, ...] | None:
    """The shape repeated layers hand each other (the most common among their outputs read outside
    them), when it is batch x sequence x hidden; None without repeated layers."""
    shapes: Counter = Counter()
    for n, a in G.nodes(data=True):
        layer = a.get("layer")
        if layer and a["kind"] == "call" and len(a["shapes"]) == 1 and any(
                G.nodes[u].get("layer") != layer for u in G.successors(n)):
            shapes[tuple(a["shapes"][0])] += 1
    shape = shapes.most_common(1)[0][0] if shapes else None
    return shape if shape is not None and len(shape) == 3 else None


def residual_nodes(G: nx.DiGraph) -> frozenset[str]:
    """The residual stream's nodes (module docstring), computed once per graph."""
    cached = G.graph.get("residual_nodes")
    if cached is not None and cached[0] == G.number_of_nodes():
        return cached[1]
    shape = residual_shape(G)
    nodes = frozenset(n for n, a in G.nodes(data=True)
                      if shape is not None and a["kind"] == "call" and a.get("layer") and len(a["shapes"]) == 1
                      and tuple(a["shapes"][0]) == shape and base_op(a["op"]) not in MATMUL
                      and not is_view(a["op"]) and base_op(a["op"]) != "embedding")
    G.graph["residual_nodes"] = (G.number_of_nodes(), nodes)
    return nodes


def sequence_parallel_strategies(G: nx.DiGraph, node: str, t: int) -> list[Strategy]:
    """``node_strategies`` with the residual stream's nodes split along the sequence (those with no
    such strategy keep theirs)."""
    strategies = node_strategies(G, node, t)
    if node not in residual_nodes(G):
        return strategies
    split = [s for s in strategies if s.out and s.out[0] == shard(SEQUENCE_DIM)]
    return split or strategies


def is_sequence_parallel(G: nx.DiGraph, choice: dict[str, Strategy]) -> bool:
    """Whether a TP layout splits the residual stream along the sequence wherever it can."""
    nodes = residual_nodes(G)
    return bool(nodes) and all(choice[n].out[0] == shard(SEQUENCE_DIM) for n in nodes
                               if len(sequence_parallel_strategies(G, n, 2)) < len(node_strategies(G, n, 2)))
