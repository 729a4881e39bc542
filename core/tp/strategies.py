"""Candidate tensor-parallel layouts of every node: the vocabulary the TP solver chooses from.

``node_strategies`` offers each graph node's strategies over a TP group of t
ranks, from the op rules of core/tp/rules.py, with the gradient placements
that the graph's gradient flow allows; ``valid_at`` keeps those still valid at
another micro-batch. The words (``Strategy``, ``reshard_kind``, ``grad_convention``)
are core/tp/vocabulary.py's, the placements core/placement.py's.

This module is analysis: it never touches torch.distributed. The runtime
executes the decisions recorded in the plan; see runtime/tp/module.py.
"""

from __future__ import annotations

from typing import Any

from partita.core.model.ops import carries_gradient
from partita.core.placement import NONE, PARTIAL, REPLICATE, shard, shard_dim
from partita.core.tp.rules import REPLICATE_BY_NATURE, RULES, OpView, Rule
from partita.core.tp.view_rules import VIEW_RULES
from partita.core.tp.vocabulary import Strategy, replicated

# -- the strategies of a graph node ------------------------------------------------


def op_rule(name: str) -> Rule | None:
    """The TP rule of ATen op ``name`` (core/tp/rules.py, core/tp/view_rules.py); None: replicated."""
    return RULES.get(name) or VIEW_RULES.get(name)


def op_key(op: str) -> tuple[str, str]:
    """(packet, overload) of a DiGraph ``op``: ("add", "Tensor"); ("getitem", "") for operator.getitem."""
    if op.endswith(".getitem"):
        return "getitem", ""
    parts = op.split(".")
    if len(parts) == 3 and parts[0] == "aten":
        return parts[1], parts[2]
    return op, ""


def input_index(G: Any, node: str, j: int) -> int:
    """Which tensor output of its producer the node's j-th tensor input is (getitem's index, else 0)."""
    if j:
        return 0
    a = G.nodes[node]
    op = a["op"]
    if "getitem" in op and op_key(op)[0] == "getitem":
        return int(a["args"][1])
    return 0


def grad_flows(G: Any) -> dict[str, bool]:
    """Node -> whether a gradient flows into its outputs in backward (passes/flops.py
    ``gradient_flows``, the one rule)."""
    from partita.core.model.graph import gradient_flows  # the graph module reads fx (torch): the plan's checks do not

    return gradient_flows(G)


def node_strategies(G: Any, node: str, t: int) -> list[Strategy]:
    """Every strategy of ``node`` over a TP group of ``t`` ranks; the first is replicated.

    Reads the DiGraph attributes of core/model/graph.py (``op``, ``kind``, ``args``,
    ``kwargs``, ``inputs``, ``in_shapes``, ``shapes``, ``dtypes``); the rules per op
    and their catalog are in core/tp/rules.py. Placeholders: a parameter offers
    "replicate" and "shard(D)" for each dim that divides by t; model inputs, targets
    and buffers "replicate" only. The output node needs the loss replicated.
    Gradient placements are "none" for inputs that carry no gradient (integer and
    bool tensors, inputs not descending from a parameter) and for every input of a
    node whose outputs carry none. Computed once per (node, t) and cached in
    ``G.graph["tp_strategies"]`` (the graph's strategies do not change once it is annotated).
    """
    cache = G.graph.get("tp_strategies")
    if cache is None or cache[0] != G.number_of_nodes():
        cache = G.graph["tp_strategies"] = (G.number_of_nodes(), {}, {})
    key = (node, t)
    if key not in cache[1]:
        alike = _what_is_read(G, node, t)  # a call's strategies follow from these alone: one list per kind
        if alike is None:
            cache[1][key] = tuple(_node_strategies(G, node, t))
        else:
            if alike not in cache[2]:
                cache[2][alike] = tuple(_node_strategies(G, node, t))
            cache[1][key] = cache[2][alike]
    return list(cache[1][key])


def _what_is_read(G: Any, node: str, t: int) -> tuple | None:
    """All that ``_node_strategies`` reads of a call node (every node of a repeated layer matches its
    peers'), or None for the other kinds."""
    a = G.nodes[node]
    if a["kind"] != "call":
        return None
    flows = grad_flows(G)
    in_dtypes, in_shapes = _inputs(G, node)
    return (a["op"], repr(a.get("args", [])), repr(a.get("kwargs", {})), tuple(in_dtypes), tuple(in_shapes),
            tuple(tuple(s) for s in a["shapes"]), tuple(a["dtypes"]), bool(flows.get(node, False)),
            tuple(bool(flows.get(s, False)) for s in a["inputs"]), len(a["inputs"]), t)


def _inputs(G: Any, node: str) -> tuple[list[str], list[tuple[int, ...]]]:
    """The dtypes and shapes of the tensors ``node`` reads, in argument order."""
    a = G.nodes[node]
    srcs = a["inputs"]
    idx = [input_index(G, node, j) for j in range(len(srcs))]
    in_dtypes = [G.nodes[s]["dtypes"][i] if G.nodes[s]["dtypes"] else "" for s, i in zip(srcs, idx)]
    in_shapes = [tuple(G.nodes[s]["shapes"][i]) if G.nodes[s]["shapes"] else tuple(sh)
                 for s, i, sh in zip(srcs, idx, a["in_shapes"])]
    return in_dtypes, in_shapes


def _node_strategies(G: Any, node: str, t: int) -> list[Strategy]:
    a = G.nodes[node]
    n_in, n_out = len(a["inputs"]), len(a["shapes"])
    flows = grad_flows(G)
    if a["kind"] == "output":
        base = replicated(n_in, 0, tuple(REPLICATE if flows.get(s) else NONE for s in a["inputs"]))
        return [base]
    if a["kind"] in ("param", "buffer", "input"):
        out = [replicated(0, n_out)]
        if a["kind"] == "param" and t > 1:
            out += [Strategy(shard(d), (shard(d),), (), (), memory_fraction=1 / t)
                    for d, size in enumerate(a["shapes"][0]) if size >= t and size % t == 0]
        return out
    srcs = a["inputs"]
    in_dtypes, in_shapes = _inputs(G, node)
    strategies = [replicated(n_in, n_out)]
    name, overload = op_key(a["op"])
    rule = op_rule(name)
    if rule is not None and t > 1:
        view = OpView(name, overload, a.get("args", []), a.get("kwargs", {}), in_shapes,
                      [tuple(s) for s in a["shapes"]], [carries_gradient(d) for d in in_dtypes], t)
        strategies += rule(view)
    out_flows = flows.get(node, False)
    carries = [out_flows and flows.get(s, False) and carries_gradient(d) for s, d in zip(srcs, in_dtypes)]
    floating_in = [carries_gradient(d) for d in in_dtypes]
    floating_out = all(carries_gradient(d) for d in a["dtypes"])
    result, names = [], set()
    for s in strategies:
        partial_on_ints = any(p == PARTIAL and not f for p, f in zip(s.ins, floating_in)) or (
            PARTIAL in s.out and not floating_out)
        if partial_on_ints:  # a sum of integer / bool parts means nothing
            continue
        grads = tuple(g if c else NONE for g, c in zip(s.grads, carries))
        assert s.name not in names, f"{node}: two strategies named {s.name}"
        names.add(s.name)
        result.append(Strategy(s.name, s.out, s.ins, grads, s.compute_fraction, s.memory_fraction, s.internal))
    return result


def valid_at(G: Any, node: str, s: Strategy, t: int, micro_batch: int) -> bool:
    """Whether ``s`` (offered on ``G`` at its captured batch) is valid at ``micro_batch``: every
    tensor it shards, input or output, still splits into t equal whole slices there.

    Shapes at the micro-batch come from ``graph.shape_at`` (two captures' linear fit). When
    they are unknown (the model's structure depends on the batch), every strategy passes
    here and the compile pipeline lays the plan out on the micro-batch's own capture.
    """
    from partita.core.model.graph import shape_at

    if micro_batch == G.graph.get("batch") or t <= 1 or G.graph.get("batch_shapes") != "linear":
        return True
    a = G.nodes[node]
    tensors = [((node, i), p) for i, p in enumerate(s.out)]
    tensors += [((src, input_index(G, node, j)), p) for j, (src, p) in enumerate(zip(a.get("inputs", []), s.ins))]
    for (src, i), placement in tensors:
        d = shard_dim(placement)
        if d is None:
            continue
        shape = shape_at(G, src, i, micro_batch)
        size = shape[d] if d < len(shape) else 0
        if size != int(size) or size < t or int(size) % t:
            return False
    return True


def unsupported_ops(G: Any) -> dict[str, int]:
    """Ops of call nodes that have no TP rule (so they run replicated) -> how many nodes.

    Factories and whole-tensor statistics (``rules.REPLICATE_BY_NATURE``) are
    replicated by nature and not listed."""
    counts: dict[str, int] = {}
    for _, a in G.nodes(data=True):
        if a["kind"] != "call":
            continue
        name = op_key(a["op"])[0]
        if op_rule(name) is None and name not in REPLICATE_BY_NATURE:
            counts[a["op"]] = counts.get(a["op"], 0) + 1
    return dict(sorted(counts.items()))
