"""The TP layout the pipeline search cuts by, and its per-node costs.

``tp_choice`` solves the TP ILP (passes/tp/problem.py, passes/tp/ilp.py) at one (tp,
micro-batch) by time alone; ``tp_node_costs`` prices that layout node by node in the
pipeline order (passes/pipeline/costs.py ``NodeCosts``) with the one per-node TP cost
(passes/tp/costs.py), so a stage is cut by the numbers the layout was chosen by. Reads the
profile's annotated graph; writes nothing on it.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import networkx as nx

from partita.core.cluster import ClusterSpec
from partita.core.model.graph import per_graph
from partita.core.pins import TrainingRequest
from partita.core.placement import is_shard
from partita.core.precision import element_bytes
from partita.core.tp.layout import tensor_bytes
from partita.core.tp.strategies import input_index, node_strategies
from partita.core.tp.vocabulary import Strategy
from partita.passes.pipeline.costs import NodeCosts, crossing_bytes, kv_ratio, node_costs, output_bytes
from partita.passes.profile import ModelProfile
from partita.passes.tp.costs import TPCosts
from partita.passes.tp.ilp import solve_tp
from partita.passes.tp.problem import TPSetting, build_problem


def tp_choice(profile: ModelProfile, cluster: ClusterSpec, request: TrainingRequest, micro_batch: int,
              tp: int, *, sp: bool = False) -> Mapping[str, Strategy]:
    """The TP ILP's layout at (tp, micro-batch), by time alone (each stage's memory is the cut solver's);
    ``sp``: with the residual stream split along the sequence (passes/tp/sequence.py)."""
    G = profile.graph
    if tp == 1:
        return {n: node_strategies(G, n, 1)[0] for n in G.nodes}
    setting = TPSetting(tp, micro_batch, profile.batch_size, request.precision, request.optimizer,
                        request.inference, kv_ratio=kv_ratio(profile, request), captured_dtype=profile.param_dtype,
                        sequence_parallel=sp)
    return solve_tp(build_problem(G, setting, cluster, repeated=profile.repeated)).choice


def tp_node_costs(profile: ModelProfile, cluster: ClusterSpec, request: TrainingRequest, micro_batch: int,
                  tp: int, *, choice: Mapping[str, Strategy] | None = None,
                  base: NodeCosts | None = None, sp: bool = False) -> NodeCosts:
    """Per-node costs of one micro-batch under the TP layout at ``tp``, in the pipeline order.

    Each node's forward is its local FLOPs (the strategy's compute fraction), its
    op-internal collectives and the forward reshards of its inputs; its backward
    the local backward FLOPs and the backward reshards. Saved activations and
    parameters are the local shares, and so are the tensors crossing a cut (a rank sends its piece).
    """
    if base is None:  # the profile's own costs at tp = 1 (a caller may hand in ones it already has)
        base = node_costs(profile, cluster, request, micro_batch, tp=1)
    if tp == 1:
        return base
    G = profile.graph
    choice = tp_choice(profile, cluster, request, micro_batch, tp, sp=sp) if choice is None else choice
    costs = TPCosts(G, cluster, tp, micro_batch, profile.batch_size, request.precision, request.inference,
                    kv_ratio(profile, request), profile.param_dtype, sequence_parallel=sp)
    nodes = _nodes(G, base.order, costs)
    fwd, bwd, saved = list(base.forward_s), list(base.backward_s), list(base.saved_bytes)
    live = list(base.live_bytes)
    priced: dict[tuple, tuple[float, float, int, int | None]] = {}  # per (node class, strategy, input placements)
    for i, (n, inputs, kind) in enumerate(zip(base.order, nodes.inputs, nodes.kinds)):
        s = choice[n]
        haves = tuple(choice[u].out[k] for u, k in inputs)
        key = (kind, id(s), haves)  # ``choice`` holds every strategy: ids stay unique
        if key not in priced:
            priced[key] = _price(costs, n, s, inputs, haves)
        fwd[i], bwd[i], saved[i], transient = priced[key]
        if transient is not None:
            live[i] = transient

    def sharded(n: str) -> bool:
        return bool(choice[n].out) and is_shard(choice[n].out[0])

    # local parameter elements, each counted once where node_costs put it (its first user's position)
    local: dict[str, float] = {}
    for n, name, whole, _ in nodes.params:
        local[name] = min(local.get(name, whole), whole / tp if sharded(n) else whole)
    shared = {p.name for p in base.shared}
    params = [0] * len(base.order)
    for _, name, _, pos in nodes.params:
        if name not in shared and name in local:
            params[pos] += round(local.pop(name))
    shared_local = tuple(replace(p, numel=round(p.numel / tp) if any(map(sharded, nodes.by_name.get(p.name, ())))
                                 else p.numel) for p in base.shared)
    # what crosses a cut is each rank's piece of it: a sharded tensor is sent (and held) at 1/tp
    whole = output_bytes(profile, request, micro_batch)
    send, grad = crossing_bytes(G, base.order, lambda n: whole(n) / (tp if sharded(n) else 1), request.inference)
    return replace(base, forward_s=tuple(fwd), backward_s=tuple(bwd), saved_bytes=tuple(saved),
                   param_numel=tuple(params), shared=shared_local, live_bytes=tuple(live),
                   core_inputs=_local_core_inputs(base, saved), send_bytes=send, grad_bytes=grad)


def _price(costs: TPCosts, n: str, s: Strategy, inputs: Sequence[tuple[str, int]], haves: Sequence[str]
           ) -> tuple[float, float, int, int | None]:
    """Node ``n``'s (forward s, backward s, saved bytes, transient bytes or None for inference) under
    ``s`` with its inputs placed as ``haves``."""
    f, b = costs.compute_s(n, s)
    f += costs.internal_s(n, s)
    compute_b, op = b, costs.G.nodes[n]["op"]
    for j, ((u, k), have) in enumerate(zip(inputs, haves)):
        reshard = costs.reshard_s(have, s, j, costs.tensor_bytes(u, k), op, compute_b)
        if reshard is None:
            raise ValueError(f"node {n}: strategy {s.name} cannot take input {j} from {u} ({have})")
        f, b = f + reshard[0], b + reshard[1]
    return (f, b, round(costs.saved_bytes(n, s, haves)),
            None if costs.inference else round(costs.transient_bytes(n, s)))


@dataclass(frozen=True)
class _Nodes:
    """What ``tp_node_costs`` reads of the graph that no layout changes, per position of the pipeline
    order (``_nodes``: once per graph, order and element size)."""

    inputs: tuple[tuple[tuple[str, int], ...], ...]  # per position: (producer, its output index) per input
    kinds: tuple[int, ...]  # per position: positions of one kind cost alike under the same strategy and inputs
    params: tuple[tuple[str, str, int, int], ...]  # per parameter node, graph order: (node, name, numel, position)
    by_name: dict[str, list[str]]  # ``param_name`` -> its parameter nodes


# graph -> {(order, element bytes): _Nodes} (graph.per_graph)
_NODES: weakref.WeakKeyDictionary[nx.DiGraph, tuple[int, dict]] = weakref.WeakKeyDictionary()


def _nodes(G: nx.DiGraph, order: Sequence[str], costs: TPCosts) -> _Nodes:
    """``G``'s ``_Nodes`` in ``order`` at ``costs``'s element size, computed once."""
    cache = per_graph(_NODES, G)
    elem = element_bytes(costs.precision)
    key = (tuple(order), elem)
    if key not in cache:
        at = {n: i for i, n in enumerate(order)}
        inputs = tuple(tuple((u, input_index(G, n, j)) for j, u in enumerate(G.nodes[n].get("inputs", [])))
                       for n in order)
        kinds: dict[tuple, int] = {}  # what the costs read of a node: its key and op, its inputs' sizes
        signature = [(costs.node_key(n), G.nodes[n]["op"],
                      tuple((tensor_bytes(G, u, k, elem), bool(G.nodes[u].get("depends_on_input"))) for u, k in ins))
                     for n, ins in zip(order, inputs)]
        params, by_name = [], {}
        for n, a in G.nodes(data=True):
            if a["kind"] == "param":
                users = [at[u] for u in G.successors(n)]
                params.append((n, a.get("param_name", n), math.prod(a["shapes"][0]), min(users) if users else at[n]))
                by_name.setdefault(a.get("param_name"), []).append(n)
        cache[key] = _Nodes(inputs, tuple(kinds.setdefault(sig, len(kinds)) for sig in signature), tuple(params),
                            by_name)
    return cache[key]


def _local_core_inputs(base: NodeCosts, saved: Sequence[int]) -> tuple[int, ...]:
    """What each attention core keeps under selective recomputation on one TP rank: its whole inputs
    scaled as the layout scales the core's own saved bytes (by heads: 1 / tp)."""
    ratio: dict[str, tuple[int, int]] = {}
    for core, whole, local in zip(base.cores, base.saved_bytes, saved):
        if core:
            w, lo = ratio.get(core, (0, 0))
            ratio[core] = (w + whole, lo + local)
    return tuple(round(held * ratio[core][1] / ratio[core][0]) if held and ratio[core][0] else held
                 for core, held in zip(base.cores, base.core_inputs))

