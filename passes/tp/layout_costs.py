"""The TP layout the pipeline search cuts by, and its per-node costs.

``tp_choice`` solves the TP ILP (passes/tp/problem.py, passes/tp/ilp.py) at one (tp,
micro-batch) by time alone; ``tp_node_costs`` prices that layout node by node in the
pipeline order (passes/pipeline/costs.py ``NodeCosts``) with the one per-node TP cost
(passes/tp/costs.py), so a stage is cut by the numbers the layout was chosen by. Reads the
profile's annotated graph; writes nothing on it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

from partita.core.cluster import ClusterSpec
from partita.core.pins import TrainingRequest
from partita.core.placement import is_shard
from partita.core.tp.strategies import input_index, node_strategies
from partita.core.tp.vocabulary import Strategy
from partita.passes.pipeline.costs import NodeCosts, crossing_bytes, kv_ratio, node_costs, output_bytes
from partita.passes.profile import ModelProfile
from partita.passes.tp.costs import TPCosts
from partita.passes.tp.ilp import solve_tp
from partita.passes.tp.problem import TPSetting, build_problem
from partita.passes.tp.sequence import sequence_parallel_strategies


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
    return solve_tp(build_problem(G, setting, cluster, repeated=profile.repeated,
                                  strategies=sequence_parallel_strategies if sp else None)).choice


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
    fwd, bwd, saved = list(base.forward_s), list(base.backward_s), list(base.saved_bytes)
    live = list(base.live_bytes)
    params = [0] * len(base.order)
    at = {n: i for i, n in enumerate(base.order)}
    for n in base.order:
        s, i = choice[n], at[n]
        f, b = costs.compute_s(n, s)
        f += costs.internal_s(n, s)
        compute_b, haves = b, []
        for j, u in enumerate(G.nodes[n].get("inputs", [])):
            k = input_index(G, n, j)
            haves.append(choice[u].out[k])
            reshard = costs.reshard_s(haves[-1], s, j, costs.tensor_bytes(u, k), G.nodes[n]["op"], compute_b)
            if reshard is None:
                raise ValueError(f"node {n}: strategy {s.name} cannot take input {j} from {u} ({choice[u].out[k]})")
            f, b = f + reshard[0], b + reshard[1]
        fwd[i], bwd[i] = f, b
        saved[i] = round(costs.saved_bytes(n, s, haves))
        if not request.inference:
            live[i] = round(costs.transient_bytes(n, s))
    # local parameter elements, each counted once where node_costs put it (its first user's position)
    local: dict[str, float] = {}
    for n, a in G.nodes(data=True):
        if a["kind"] == "param":
            whole = math.prod(a["shapes"][0])
            sharded = choice[n].out and is_shard(choice[n].out[0])
            name = a.get("param_name", n)
            local[name] = min(local.get(name, whole), whole / tp if sharded else whole)
    shared = {p.name for p in base.shared}
    for n, a in G.nodes(data=True):
        if a["kind"] != "param" or a.get("param_name", n) in shared:
            continue
        users = [at[u] for u in G.successors(n)]
        pos = min(users) if users else at[n]
        name = a.get("param_name", n)
        if name in local:
            params[pos] += round(local.pop(name))
    shared_local = tuple(replace(p, numel=round(p.numel / tp) if any(
        choice[n].out and is_shard(choice[n].out[0]) for n, a in G.nodes(data=True)
        if a["kind"] == "param" and a.get("param_name") == p.name) else p.numel) for p in base.shared)
    # what crosses a cut is each rank's piece of it: a sharded tensor is sent (and held) at 1/tp
    whole = output_bytes(profile, request, micro_batch)
    send, grad = crossing_bytes(G, base.order, lambda n: whole(G.nodes[n]) / (
        tp if choice[n].out and is_shard(choice[n].out[0]) else 1), request.inference)
    return replace(base, forward_s=tuple(fwd), backward_s=tuple(bwd), saved_bytes=tuple(saved),
                   param_numel=tuple(params), shared=shared_local, live_bytes=tuple(live),
                   core_inputs=_local_core_inputs(base, saved), send_bytes=send, grad_bytes=grad)


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

