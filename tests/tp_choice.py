"""A Megatron-style hand choice of TP strategies for tests (not product code).

``megatron_choice`` pins the nodes whose module path matches a pattern to a named
strategy (q/k/v/c_fc/gate/up -> col, c_proj/o_proj/down_proj -> row, the token
embedding -> vocab, lm_head -> col, the cross-entropy -> vocab), gives their
parameters the placement the pinned strategy needs, and lets every other node
take the first strategy whose ``ins`` equal its producers' outputs (falling back
to replicate).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import networkx as nx

from partita.core.tp.strategies import input_index, node_strategies
from partita.core.tp.vocabulary import Strategy

# (module-path regex, op packet name) -> strategy name
MEGATRON: dict[tuple[str, str], str] = {
    (r"(^|\.)(q_proj|k_proj|v_proj|c_fc|gate_proj|up_proj)$", "linear"): "col",
    (r"(^|\.)(q_proj|k_proj|v_proj|c_fc|gate_proj|up_proj)$", "addmm"): "col",
    (r"(^|\.)(c_proj|o_proj|down_proj)$", "linear"): "row",
    (r"(^|\.)(c_proj|o_proj|down_proj)$", "addmm"): "row",
    (r"(^|\.)(wte|embed_tokens)$", "embedding"): "vocab",
    (r"(^|\.)lm_head$", "linear"): "col",
    (r".*", "cross_entropy_loss"): "vocab",
}


def _packet(op: str) -> str:
    return op.split(".")[1] if op.startswith("aten.") else op


def pinned_choice(G: nx.DiGraph, t: int, pins: Mapping[tuple[str, str], str] = MEGATRON, *,
                  sequence_parallel: bool = False) -> dict[str, Strategy]:
    """Every node's strategy: pinned ones by pattern, the rest following their producers;
    ``sequence_parallel``: the residual stream on shard(1) (passes/tp/sequence.py)."""
    from partita.passes.repeats import find_repeated_layers
    from partita.passes.tp.sequence import residual_nodes, sequence_parallel_strategies

    if sequence_parallel:
        find_repeated_layers(G)  # the residual stream is the repeated layers'
    residual = residual_nodes(G) if sequence_parallel else frozenset()
    all_strategies = {n: node_strategies(G, n, t) for n in G.nodes}
    choice: dict[str, Strategy] = {}
    for n, a in G.nodes(data=True):
        for (pattern, packet), name in pins.items():
            if _packet(a["op"]) == packet and re.search(pattern, a.get("module", "")):
                by_name = {s.name: s for s in all_strategies[n]}
                if name in by_name:
                    s = choice[n] = by_name[name]
                    for src, need in zip(a["inputs"], s.ins):  # parameters follow their consumer
                        if G.nodes[src]["kind"] == "param":
                            choice[src] = next(p for p in all_strategies[src] if p.out == (need,))
                break
    for n, a in G.nodes(data=True):
        if n in choice:
            continue
        if n in residual:
            choice[n] = sequence_parallel_strategies(G, n, t)[0]
            continue
        have = tuple(choice[src].out[input_index(G, n, j)] for j, src in enumerate(a["inputs"]))
        choice[n] = next((s for s in all_strategies[n] if s.ins == have), all_strategies[n][0])
    return choice


def tp_plan(module, inputs: list, loss, targets, *, tp: int, dp: int = 1, mbs: int = 2, accum: int = 2,
            pins: Mapping[tuple[str, str], str] | None = MEGATRON, dp_collectives: tuple = (), captured=None,
            sequence_parallel: bool = False):
    """A hand-built plan for ``module`` (captured at the micro-batch shape, unless ``captured``
    is that capture): nodes from ``pinned_choice`` (``pins=None``: everything replicated), params,
    collectives."""
    from partita.core.mesh import Mesh
    from partita.core.model.capture import capture
    from partita.core.model.graph import graph_fingerprint, to_networkx
    from partita.core.model.inputs import InputSpec
    from partita.core.plans.plan import (
        Collective,
        MemoryBreakdown,
        ModelInfo,
        ParamDecision,
        Plan,
        Prediction,
        SolverReport,
        Training,
    )
    from partita.core.tp.layout import layout_decisions, tp_collectives

    micro = [InputSpec(s.name, s.dtype, (mbs, *s.shape[1:])) for s in inputs]
    mt = InputSpec(targets.name, targets.dtype, (mbs, *targets.shape[1:])) if targets is not None else None
    if captured is None:
        captured = capture(module, micro, loss=loss, targets=mt)
    G = to_networkx(captured)
    choice = pinned_choice(G, tp, pins, sequence_parallel=sequence_parallel) if pins is not None else {}
    nodes = layout_decisions(G, tp, choice)
    by_name = {d.name: d for d in nodes}
    placement: dict[str, str] = {}
    for n, q in sorted(captured.param_nodes.items(), key=lambda kv: G.out_degree(kv[0]) == 0):
        placement.setdefault(q, by_name[n].out[0])  # a tied parameter: where its used placeholder says
    params = tuple(
        ParamDecision(q, captured.params[q][0], str(captured.params[q][1]).removeprefix("torch."),
                      {"tp": p, "dp": "replicate"})
        for q, p in placement.items())
    collectives = tuple(Collective(k, "tp", b, n * accum, tp, p, 0.0)
                        for k, b, n, p in tp_collectives(nodes, sequence_parallel=sequence_parallel))
    mem = MemoryBreakdown(params=0, grads=0, optimizer=0, activations=0, capacity=1 << 30)
    gb = dp * mbs * accum
    return Plan(
        model=ModelInfo(captured.name, graph_fingerprint(G), 0, 0,
                        tuple(str(InputSpec(s.name, s.dtype, (gb, *s.shape[1:]))) for s in inputs), "torch.export",
                        G.number_of_nodes(),
                        targets=str(InputSpec(mt.name, mt.dtype, (gb, *mt.shape[1:]))) if mt is not None else None),
        cluster={}, mesh=Mesh(dp=dp, tp=tp),
        training=Training(global_batch=gb, micro_batch_size=mbs, grad_accum_steps=accum,
                          sequence_parallel=sequence_parallel),
        predicted=Prediction(0.0, 0.0, {}, 0.0, mem, {}, 0.0, None, 0.0, 0.0),
        solver=SolverReport("hand", "OPTIMAL", 0.0, 0.0, 1),
        params=params, nodes=nodes, collectives=collectives + tuple(dp_collectives),
    )
