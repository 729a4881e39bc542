"""Sequence parallelism (Korthikanti et al. 2022, section 4.2.2): between the tensor-parallel
regions, the residual stream is split along the sequence over the TP group instead of held whole
on every rank.

In the TP rules' words (core/tp/rules.py) that is a layout, not a new op: every node of the
residual stream (``residual_nodes``: a call in a repeated layer whose output has the shape of
what one layer hands the next, batch x sequence x hidden, and that neither multiplies matrices, looks up an
embedding nor only makes a view: norms, dropouts, residual adds) takes ``shard(1)``. A
row-parallel linear's partial sums then reach it by a reduce-scatter, and a column-parallel
linear gathers its input by an all-gather: the volume of the all-reduce they replace.

The setting (``TPSetting.sequence_parallel``, which ``--sequence-parallel`` pins and the search
otherwise decides: passes/search.py) is honoured in the strategies every TP problem offers
(``honour_sequence_parallel``, applied by passes/tp/problem.py): on, the residual stream's
nodes keep only their sequence-split strategies and the ILP (passes/tp/ilp.py) solves the rest
around them; off, no strategy that splits a tensor along the sequence is offered at all
(``splits_sequence``), so the layout is plain Megatron tensor parallelism with the stream whole
on every rank (replicated or partial sums), and full recomputation keeps each layer's input
whole, as the plan's ``sequence_parallel = false`` says. Which dims run along the sequence is
found from the graph (``sequence_dims``), not from sizes. What Megatron-LM's sequence
parallelism adds beyond the split stream, a column-parallel linear keeping its input split and
gathering it again in backward, is priced in passes/tp/costs.py (docs/cost-model.md).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from fractions import Fraction

import networkx as nx

from partita.core.model.graph import shape_at
from partita.core.model.ops import MATMUL, base_op
from partita.core.placement import shard, shard_dim
from partita.core.tp.strategies import input_index, node_strategies, op_key, op_rule
from partita.core.tp.view_rules import view, view_groups
from partita.core.tp.vocabulary import Strategy
from partita.passes.flops import is_view

SEQUENCE_DIM = 1  # batch x sequence x hidden

TensorKey = tuple[str, int]  # (node, output index)
# per dim along the sequence: (index steps of the dim one whole sequence spans, steps per position);
# (T, 1) for the sequence itself, also for a batch x sequence dim a flatten merged
SeqDims = dict[int, tuple[Fraction, Fraction]]


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


def sequence_dims(G: nx.DiGraph, t: int) -> dict[TensorKey, SeqDims]:
    """Every tensor's dims that run along the sequence, found from the residual stream's dim 1:
    through each op's strategies at ``t``, a shard of an input dim that becomes a shard of an
    output dim of the same size carries it (both ways: a linear's token dim, a transpose's, the
    attention scores' query and key dims, the embeddings' positions, the tokens), and a view
    regroups it (``_through_view``: a flatten of batch x sequence keeps the sequence in its
    merged dim). Computed once per graph and t."""
    cache = G.graph.get("sequence_dims")
    if cache is None or cache[0] != G.number_of_nodes():
        cache = G.graph["sequence_dims"] = (G.number_of_nodes(), {})
    if t in cache[1]:
        return cache[1][t]
    shape = residual_shape(G)
    found: dict[TensorKey, SeqDims] = {}
    if shape is not None:
        found = {(n, 0): {SEQUENCE_DIM: (Fraction(shape[SEQUENCE_DIM]), Fraction(1))} for n in residual_nodes(G)}
    links = _links(G, t)
    work = list(found)
    while work:
        tensor = work.pop()
        for other, carry in links.get(tensor, ()):
            for d, seq in carry(found[tensor]).items():
                if d not in found.setdefault(other, {}):
                    found[other][d] = seq
                    work.append(other)
    cache[1][t] = found
    return found


def _shape(G: nx.DiGraph, tensor: TensorKey) -> tuple[int, ...]:
    return tuple(G.nodes[tensor[0]]["shapes"][tensor[1]])


def _links(G: nx.DiGraph, t: int) -> dict[TensorKey, list]:
    """tensor -> [(another tensor, what a sequence dim of the first makes of the other's dims)]."""
    links: dict[TensorKey, list] = {}

    def link(a: TensorKey, b: TensorKey, carry_ab, carry_ba) -> None:
        links.setdefault(a, []).append((b, carry_ab))
        links.setdefault(b, []).append((a, carry_ba))

    for n, attrs in G.nodes(data=True):
        if attrs["kind"] != "call" or not attrs.get("inputs"):
            continue
        ins = [(u, input_index(G, n, j)) for j, u in enumerate(attrs["inputs"])]
        if op_rule(op_key(attrs["op"])[0]) is view:
            src, dst = _shape(G, ins[0]), _shape(G, (n, 0))
            link(ins[0], (n, 0), lambda dims, s=src, d=dst: _through_view(s, d, dims),
                 lambda dims, s=src, d=dst: _through_view(d, s, dims))
            continue
        pairs = {(j, a, k, b) for s in node_strategies(G, n, t)
                 for k, o in enumerate(s.out) if shard_dim(o) is not None
                 for j, p in enumerate(s.ins) if shard_dim(p) is not None
                 for a, b in [(shard_dim(p), shard_dim(o))]
                 if _shape(G, ins[j])[a] == _shape(G, (n, k))[b]}
        for j, a, k, b in pairs:
            link(ins[j], (n, k), lambda dims, a=a, b=b: {b: dims[a]} if a in dims else {},
                 lambda dims, a=a, b=b: {a: dims[b]} if b in dims else {})
    return links


def _through_view(src: tuple[int, ...], dst: tuple[int, ...], dims: SeqDims) -> SeqDims:
    """The sequence dims of a view's output from its input's: in each group of dims the view
    regroups, the sequence's positions span an interval of the group's flat index; each output dim
    whose strides meet that interval runs along the sequence, with the span in its own steps."""
    out: SeqDims = {}
    for gi, gj in view_groups(src, dst) or ():
        for i in gi:
            if i not in dims:
                continue
            stride = math.prod(src[x] for x in gi if x > i)
            span, step = dims[i][0] * stride, dims[i][1] * stride  # the flat index a whole sequence spans
            for k in gj:
                sk = math.prod(dst[x] for x in gj if x > k)
                if dst[k] > 1 and sk < span and sk * dst[k] > step:
                    out.setdefault(k, (span / sk, max(step / sk, Fraction(1))))
    return out


def splits_sequence(G: nx.DiGraph, node: str, s: Strategy, t: int, micro_batch: int) -> bool:
    """Whether ``s`` splits a tensor it makes or reads along the sequence at ``micro_batch``: a shard
    of a sequence dim whose t slices do not each hold whole sequences (a batch x sequence dim split
    between samples splits the batch, not the sequence)."""
    return _splits(G, node, s, t, micro_batch, sequence_dims(G, t))


def _splits(G: nx.DiGraph, node: str, s: Strategy, t: int, micro_batch: int, dims: dict[TensorKey, SeqDims]) -> bool:
    a = G.nodes[node]
    tensors = [((node, i), p) for i, p in enumerate(s.out)]
    tensors += [((src, input_index(G, node, j)), p) for j, (src, p) in enumerate(zip(a.get("inputs", []), s.ins))]
    for tensor, placement in tensors:
        d = shard_dim(placement)
        seq = dims.get(tensor, {}).get(d) if d is not None else None
        if seq is None:
            continue
        shape = shape_at(G, *tensor, micro_batch) or _shape(G, tensor)
        if Fraction(shape[d]) / t % seq[0]:
            return True
    return False


def honour_sequence_parallel(G: nx.DiGraph, node: str, strategies: Sequence[Strategy], t: int, micro_batch: int,
                             on: bool) -> tuple[Strategy, ...]:
    """``node``'s strategies under the setting (module docstring): on, a residual node's
    sequence-split ones (its others where it has none); off, those that split no tensor along the
    sequence."""
    if t == 1:
        return tuple(strategies)  # nothing is split
    if not on:
        dims = sequence_dims(G, t)
        return tuple(s for s in strategies if not _splits(G, node, s, t, micro_batch, dims))
    if node not in residual_nodes(G):
        return tuple(strategies)
    split = tuple(s for s in strategies if s.out and s.out[0] == shard(SEQUENCE_DIM))
    return split or tuple(strategies)


def sequence_parallel_strategies(G: nx.DiGraph, node: str, t: int) -> list[Strategy]:
    """``node_strategies`` with the residual stream's nodes split along the sequence (those with no
    such strategy keep theirs)."""
    return list(honour_sequence_parallel(G, node, node_strategies(G, node, t), t, G.graph.get("batch", 1), True))
