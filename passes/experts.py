"""Expert parallelism's planner half: what splitting each MoE layer's experts over an expert group costs.

Reads the MoE layers core/experts.py finds, as passes/profile.py leaves them on the profile's
graph (``G.graph["experts"]``), and the parameters stacked over experts. Gives the
expert-parallel degrees a (dp, tp) candidate weighs (``ep_choices``; ``check_ep_pin`` refuses a
pin this version cannot honour), each rank's share of the parameters (``expert_shards``) and of
the model state (``split_state``: the expert slices out of ZeRO, whole), one micro-batch's
all-to-alls as the runtime runs them (``all_to_alls``, runtime/experts.py: the one list that
time, traffic and the plan's collectives read) and one step's expert-parallel communication
(``expert_step``: the all-to-alls over the "ep" group, the expert gradients' all-reduce over
"edp"). The mesh search (passes/tp/mesh.py) adds these to a candidate at tp = 1, beside every
ZeRO stage; the pipeline search cuts ``expert_node_costs`` (the all-to-alls in the slots of the
stage holding each layer) at a pinned ep, and passes/search.py tells the parts apart
(``stage_expert_steps``, ``expert_parts``); the plan lists the same calls
(compiler/plan_collectives.py). Writes nothing on the graph. The formulas: docs/cost-model.md,
"Expert parallelism".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import networkx as nx

from partita.core.buckets import DEFAULT_BUCKET_BYTES
from partita.core.cluster import ClusterSpec, Link
from partita.core.errors import PartitaError
from partita.core.experts import ExpertLoad, ExpertRegion, ep_conflicts, ep_degrees, expert_params
from partita.core.optimizers import NO_OFFLOAD
from partita.core.pins import Pins, TrainingRequest
from partita.core.precision import activation_scale, element_bytes
from partita.passes.cost_model import (
    ModelStateMemory,
    PipelineStepCost,
    StateBytes,
    collective_time,
    collective_traffic,
    model_state_memory,
    zero_optimizer_time,
    zero_step_comm,
)
from partita.passes.dp.buckets import gradient_buckets
from partita.passes.pipeline.costs import NodeCosts, node_costs

EP_ALL_TO_ALL = "ep_all_to_all"  # the comm key of the all-to-alls over the expert group
EDP_ALL_REDUCE = "edp_all_reduce"  # the comm key of the expert gradients' all-reduce
COUNT_BYTES = 8  # one int64 per expert: the rows a rank sends to it (runtime/experts.py ``Route``)
DISPATCH = "expert dispatch: token rows to their experts' ranks (their gradients back in backward)"
COMBINE = "expert combine: expert outputs back to their tokens' ranks (their gradients out in backward)"
COUNTS = "expert counts: the rows each rank sends to each expert, before the dispatch"
BALANCED = ExpertLoad()  # routing taken as even over every expert group's ranks
CARRIED = "expert per-row values (a bias gathered by expert id, a scale) sent with their rows"


def model_experts(G: nx.DiGraph) -> tuple[ExpertRegion, ...]:
    """The MoE layers passes/profile.py found on the profile's graph (none: ``()``)."""
    return tuple(G.graph.get("experts", ()))


def expert_param_names(G: nx.DiGraph) -> frozenset[str]:
    """The qualified names of the parameters stacked over experts (dim 0 = the expert)."""
    placeholders = {n: a["param_name"] for n, a in G.nodes(data=True) if a["kind"] == "param"}
    return frozenset(expert_params(model_experts(G), placeholders))


def check_ep_pin(regions: Sequence[ExpertRegion], pins: Pins) -> None:
    """Refuse a pinned ``--ep`` that does not divide every MoE layer's experts (what else rules out a
    pinned ep, a model without experts and what ep does not run beside, are core/axes/experts.py's
    rules, checked with the others by plan_search)."""
    ep = pins.ep or 1
    counts = sorted({r.experts for r in regions})
    if ep > 1 and any(c % ep for c in counts):
        valid = [e for e in range(2, min(counts) + 1) if all(c % e == 0 for c in counts)]
        raise PartitaError(f"--ep {ep} does not divide the {' / '.join(map(str, counts))} experts of each MoE "
                           "layer: every rank of an expert group holds whole experts",
                           hint=f"pin --ep {' or '.join(map(str, valid))}" if valid else "drop --ep")


def _conflicts(pins: Pins, request: TrainingRequest) -> list[str]:
    """What the pins and the request set that this version does not run beside ep > 1 (core/experts.py)."""
    return ep_conflicts(inference=request.inference, tp=pins.tp or 1, offload=pins.offload not in (None, NO_OFFLOAD),
                        sequence_parallel=bool(pins.sequence_parallel))


def ep_choices(regions: Sequence[ExpertRegion], dp: int, tp: int, pins: Pins, request: TrainingRequest) -> list[int]:
    """The expert-parallel degrees a (dp, tp) candidate weighs, smallest first: the pinned one, else
    core/experts.py's ``ep_degrees`` where this version's runtime splits experts (training, tp = 1;
    beside every ZeRO stage), else [1]. A pinned degree that does not divide dp is refused."""
    if pins.ep is not None:
        if pins.ep > 1 and pins.ep not in ep_degrees(regions, dp):
            raise PartitaError(f"--ep {pins.ep} does not divide dp={dp}: expert groups are carved out of the "
                               "data-parallel group",
                               hint=f"pin --ep {' or '.join(map(str, ep_degrees(regions, dp)))}, or drop --ep")
        return [pins.ep]
    if tp > 1 or request.inference:
        return [1]
    return ep_degrees(regions, dp)


def pipeline_ep_pins(regions: Sequence[ExpertRegion], world: int, pins: Pins, request: TrainingRequest) -> list[Pins]:
    """The pins under which the pipeline search weighs each expert-parallel degree above 1 the experts
    divide into, unpinned (at tp = 1, without offload: what this version runs beside ep); none
    where ep is pinned, tp is, or the plan is for inference, sequence parallelism or offload."""
    if pins.ep is not None or _conflicts(pins, request):
        return []
    return [dataclasses.replace(pins, ep=e, offload=NO_OFFLOAD) for e in ep_degrees(regions, world)[1:]]


def expert_shards(numels: Mapping[str, int], experts: Collection[str], ep: int) -> dict[str, int]:
    """Each parameter's elements on one rank (``numels``: name -> elements, in order): a parameter
    stacked over experts holds ``E / ep`` of its experts, the others stay whole."""
    return {name: n // ep if name in experts else n for name, n in numels.items()}


def split_state(dense: ModelStateMemory, experts: int, state: StateBytes) -> ModelStateMemory:
    """``dense`` (the state of a rank's other parameters, ZeRO-sharded or not) and that of its
    ``experts`` elements (its E / ep slices), which stay out of ZeRO, whole on the rank with all of
    ``state`` each, as the runtime keeps them (docs/runtime.md, "Expert parallelism")."""
    e = model_state_memory(experts, state)
    return ModelStateMemory(dense.params + e.params, dense.grads + e.grads, dense.optimizer + e.optimizer)


def expert_optimizer_time(experts: float, state: StateBytes, cluster: ClusterSpec) -> float:
    """The optimizer's pass over a rank's ``experts`` elements: every one, whatever the ZeRO stage of
    the others (``zero_optimizer_time`` at stage 0)."""
    return zero_optimizer_time(experts, state, 0, 1, cluster)


def expert_links(cluster: ClusterSpec, *, dp: int, tp: int, ep: int) -> tuple[Link, Link]:
    """The links of an expert group (``ep`` consecutive dp ranks, ``tp`` apart) and of the ranks
    holding the same experts ("edp": ``dp / ep`` of them, ``ep x tp`` apart), core/mesh.py's layout."""
    return cluster.link_for_group(ep, stride=tp), cluster.link_for_group(dp // ep, stride=ep * tp)


@dataclass(frozen=True)
class AllToAll:
    """All-to-alls of one size over the expert group, per micro-batch."""

    nbytes: int  # one rank's send buffer: the whole array (cost_model.collective_time's S)
    calls: int
    purpose: str


def all_to_alls(regions: Sequence[ExpertRegion], micro_batch: int, batch: int, act_scale: float, *,
                inference: bool = False, recompute: bool = False,
                loads: Sequence[float] | None = None) -> tuple[AllToAll, ...]:
    """One micro-batch's all-to-alls on one rank, merged by (size, purpose): per MoE layer the
    counts (``E`` int64s), the dispatch of its ``rows x row_bytes``, the combine of its
    ``rows x out_bytes`` and each per-row value sent with the rows (``ExpertRegion.carried``),
    rows at the micro-batch (``rows x micro_batch / batch``, ``batch`` the captured one) and bytes
    at the precision's element size (``act_scale``); in backward each but the counts again, reversed
    (their gradients), and with ``recompute`` (whole layers rerun, core/recompute.py) the forward's
    again. ``loads``: each layer's slowest expert rank's rows over the mean (``ExpertLoad.loads``; None:
    balanced): that rank's rows, the all-to-all's largest buffer, set its time."""
    forward = 2 if recompute else 1
    passes = forward + (0 if inference else 1)
    calls: dict[tuple[int, str], int] = {}
    for r, load in zip(regions, loads or [1.0] * len(regions)):
        rows = r.rows * micro_batch / batch * load
        carried = [(round(rows * b * act_scale), CARRIED, passes) for _, _, b in r.carried]
        for nbytes, purpose, n in ((r.experts * COUNT_BYTES, COUNTS, forward),
                                   (round(rows * r.row_bytes * act_scale), DISPATCH, passes),
                                   (round(rows * r.out_bytes * act_scale), COMBINE, passes), *carried):
            calls[(nbytes, purpose)] = calls.get((nbytes, purpose), 0) + n
    return tuple(AllToAll(nbytes, n, purpose) for (nbytes, purpose), n in calls.items())


@dataclass(frozen=True)
class ExpertStep:
    """One rank's expert-parallel communication in one step (``expert_step``)."""

    seconds: Mapping[str, float]  # EP_ALL_TO_ALL (every micro-batch's), EDP_ALL_REDUCE
    traffic_bytes: Mapping[str, int]  # what the rank sends, by the same keys
    local_numel: int  # expert parameter elements the rank holds: E / ep of each layer's experts
    calls: tuple[AllToAll, ...]  # one micro-batch's all-to-alls (``all_to_alls``)


def expert_step(regions: Sequence[ExpertRegion], local_numels: Sequence[int], *, ep: int, dp: int, tp: int = 1,
                micro_batch: int, batch: int, grad_accum: int, precision: str, reduce_dtype: str, captured_dtype: str,
                cluster: ClusterSpec, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                recompute: bool = False, loads: Sequence[float] | None = None) -> ExpertStep:
    """The all-to-alls of ``grad_accum`` micro-batches over the expert group (``all_to_alls``,
    each ``collective_time("all_to_all", S, ep, link)``), then the all-reduce of the rank's expert
    gradients (``local_numels``: its shards' elements, bucketed as the runtime buckets them) over
    the ``dp / ep`` ranks holding the same experts, as stage 0 of ``zero_step_comm`` (sent in
    ``reduce_dtype``). ``recompute``: whole layers rerun in backward, their all-to-alls with them.
    ``loads``: routing as ``all_to_alls`` takes it."""
    ep_link, edp_link = expert_links(cluster, dp=dp, tp=tp, ep=ep)
    calls = all_to_alls(regions, micro_batch, batch, activation_scale(precision, captured_dtype),
                        recompute=recompute, loads=loads)
    elem = element_bytes(precision)  # gradients are held in the compute dtype
    edp = zero_step_comm(0, gradient_buckets(local_numels, elem, bucket_bytes), dp // ep, grad_accum, edp_link,
                         elem_bytes=elem, reduce_dtype=reduce_dtype)
    seconds = {EP_ALL_TO_ALL: grad_accum * sum(c.calls * collective_time("all_to_all", c.nbytes, ep, ep_link)
                                                for c in calls),
               EDP_ALL_REDUCE: edp.total_s}
    traffic = {EP_ALL_TO_ALL: round(grad_accum * sum(c.calls * collective_traffic("all_to_all", c.nbytes, ep)
                                                     for c in calls)),
               EDP_ALL_REDUCE: edp.total_bytes}
    return ExpertStep(seconds, traffic, sum(local_numels), calls)


def expert_node_costs(costs: NodeCosts, G: nx.DiGraph, ep: int, *, micro_batch: int, batch: int,
                      act_scale: float, link: Link, inference: bool = False,
                      loads: Sequence[float] | None = None) -> NodeCosts:
    """``costs`` (passes/pipeline/costs.py, at tp = 1) with the experts split over groups of ``ep``
    ranks on ``link``: each expert parameter's elements moved from ``param_numel`` to
    ``expert_numel`` at 1/ep, where ``node_costs`` put them (its first user's position), and each
    MoE layer's all-to-alls of one micro-batch (``all_to_alls``) added to its first grouped matmul:
    the counts, dispatch and combine to its forward, their gradients to its backward. So the stage
    holding a layer is charged them in its slot (the bubble, and a whole-layer recomputation's rerun
    of the forward, follow), and holds a rank's slices of its experts. ``loads``: routing
    (``ExpertLoad.loads``), the slowest rank's expert work and all-to-alls at it (``imbalanced``)."""
    experts = expert_param_names(G)
    if ep == 1 or not experts:
        return costs
    costs = imbalanced(costs, model_experts(G), loads)
    at = {n: i for i, n in enumerate(costs.order)}
    shared = {sp.name for sp in costs.shared}
    params, held = list(costs.param_numel), [0] * len(costs.order)
    by_name: dict[str, list[str]] = {}
    for n, a in G.nodes(data=True):
        if a["kind"] == "param":
            by_name.setdefault(a["param_name"], []).append(n)
    for name in experts - shared:
        nodes = by_name[name]
        numel = math.prod(G.nodes[nodes[0]]["shapes"][0])
        i = min([at[u] for n in nodes for u in G.successors(n)] or [at[n] for n in nodes])
        params[i] -= numel
        held[i] += numel // ep
    fwd, bwd, a2a = list(costs.forward_s), list(costs.backward_s), [(0.0, 0.0)] * len(costs.order)
    for r, load in zip(model_experts(G), loads or [1.0] * len(model_experts(G))):
        f, total = (sum(c.calls * collective_time("all_to_all", c.nbytes, ep, link)
                        for c in all_to_alls([r], micro_batch, batch, act_scale, inference=forward_only,
                                             loads=[load]))
                    for forward_only in (True, inference))
        i = at[r.first]
        fwd[i], bwd[i], a2a[i] = fwd[i] + f, bwd[i] + total - f, (a2a[i][0] + f, a2a[i][1] + total - f)
    return dataclasses.replace(costs, forward_s=tuple(fwd), backward_s=tuple(bwd), param_numel=tuple(params),
                               expert_numel=tuple(held), all_to_all_s=tuple(a2a), ep=ep)


def expert_costs(build: Callable[[int], NodeCosts], G: nx.DiGraph, ep: int, *, batch: int, precision: str,
                 captured_dtype: str, cluster: ClusterSpec, tp: int = 1, inference: bool = False,
                 load: ExpertLoad = BALANCED) -> Callable[[int], NodeCosts]:
    """``build`` (micro-batch -> per-node costs) with the experts split over ``ep`` (``expert_node_costs``),
    the all-to-alls on the expert groups' link, routing as ``load`` says: the pipeline search's costs at a
    pinned ep."""
    link = cluster.link_for_group(ep, stride=tp)
    act = activation_scale(precision, captured_dtype)
    loads = layer_loads(model_experts(G), ep, load)
    return lambda mb: expert_node_costs(build(mb), G, ep, micro_batch=mb, batch=batch, act_scale=act, link=link,
                                        inference=inference, loads=loads)


def layer_loads(regions: Sequence[ExpertRegion], ep: int, load: ExpertLoad) -> tuple[float, ...]:
    """Each MoE layer's slowest expert rank's rows over the mean at ``ep`` (core/experts.py ``ExpertLoad``)."""
    return load.loads([r.experts for r in regions], ep)


def routing(G: nx.DiGraph, ep: int, load: ExpertLoad) -> tuple[float, str]:
    """Routing as a plan at ``ep`` is priced: the highest layer load (1 at ep = 1 or balanced) and, for a
    model with experts, what it assumes and where from (the plan's ``sources``; "" without experts)."""
    regions = model_experts(G)
    if not regions:
        return 1.0, ""
    loads = layer_loads(regions, ep, load)
    if ep == 1:
        return 1.0, f"{load.source}; at ep = 1 every rank runs every expert on its own rows, so routing moves no time"
    low, high = min(loads), max(loads)
    spread = f"{high:.3g}x" if high - low < 5e-4 else f"{low:.3g}x to {high:.3g}x (by layer)"
    return high, f"{load.source}; priced: the slowest rank of each expert group at {spread} the mean rows at ep = {ep}"


def expert_rows(r: ExpertRegion) -> frozenset[str]:
    """The nodes of an MoE layer that run on its dispatched rows: its grouped matmuls and the ops between
    (``ExpertRegion.local``), not its weights' views. Their work grows with the rows a rank gets."""
    return (r.local | frozenset(r.matmuls)) - r.chains


def imbalanced(costs: NodeCosts, regions: Sequence[ExpertRegion], loads: Sequence[float] | None) -> NodeCosts:
    """``costs`` on the slowest rank of each expert group: each layer's ``expert_rows`` forward and
    backward seconds and saved bytes times its load (the rank's rows over the mean; ``costs`` as they
    are where every load is 1). The step waits for that rank (the all-to-all after the experts ends
    when it has), and that rank holds the most."""
    if loads is None or all(x == 1 for x in loads):
        return costs
    at = {n: i for i, n in enumerate(costs.order)}
    fwd, bwd, saved = list(costs.forward_s), list(costs.backward_s), list(costs.saved_bytes)
    for r, load in zip(regions, loads):
        for i in sorted(at[n] for n in expert_rows(r) if n in at):
            fwd[i], bwd[i], saved[i] = fwd[i] * load, bwd[i] * load, round(saved[i] * load)
    return dataclasses.replace(costs, forward_s=tuple(fwd), backward_s=tuple(bwd), saved_bytes=tuple(saved))


def imbalance(profile, cluster: ClusterSpec, request, micro_batch: int, loads: Sequence[float]) -> tuple[float, int]:
    """What one micro-batch costs the slowest expert rank beyond balanced routing: the seconds its
    forward and backward take longer, and the activation bytes it saves more (``imbalanced`` over
    the per-node costs at tp = 1, passes/pipeline/costs.py): what the mesh search adds at ep > 1."""
    if all(x == 1 for x in loads):
        return 0.0, 0
    costs = node_costs(profile, cluster, request, micro_batch, tp=1)
    slow = imbalanced(costs, model_experts(profile.graph), loads)
    return (sum(slow.forward_s) + sum(slow.backward_s) - sum(costs.forward_s) - sum(costs.backward_s),
            sum(slow.saved_bytes) - sum(costs.saved_bytes))


def stage_expert_steps(G: nx.DiGraph, node_stage: Mapping[str, int], recomputes: Sequence[bool], *, ep: int,
                       dp: int, tp: int = 1, micro_batch: int, batch: int, grad_accum: int, precision: str,
                       reduce_dtype: str, captured_dtype: str, cluster: ClusterSpec,
                       load: ExpertLoad = BALANCED) -> list[ExpertStep]:
    """Each (virtual) stage's ``expert_step``: the all-to-alls of the MoE layers whose first grouped
    matmul it runs (``recomputes[s]``: it reruns whole layers, their forward's again) and the edp
    all-reduce of the expert slices it holds (each parameter on its first user's stage)."""
    names, local, seen = expert_param_names(G), [[] for _ in recomputes], set()
    for n, a in G.nodes(data=True):
        if a["kind"] == "param" and a["param_name"] in names and a["param_name"] not in seen:
            seen.add(a["param_name"])
            local[node_stage[n]].append(math.prod(a["shapes"][0]) // ep)
    regions = model_experts(G)
    loads = dict(zip(regions, layer_loads(regions, ep, load)))
    return [expert_step(at, local[s], ep=ep, dp=dp, tp=tp, micro_batch=micro_batch, batch=batch, grad_accum=grad_accum,
                        precision=precision, reduce_dtype=reduce_dtype, captured_dtype=captured_dtype, cluster=cluster,
                        recompute=rerun, loads=[loads[r] for r in at])
            for s, rerun in enumerate(recomputes) for at in [[r for r in regions if node_stage[r.first] == s]]]


def expert_parts(compute_s: float, comm: Mapping[str, float], traffic: Mapping[str, int], dp_key: str,
                 moe: Sequence[ExpertStep], cost: PipelineStepCost, pp: int
                 ) -> tuple[float, dict[str, float], dict[str, int]]:
    """A pipeline step's compute, communication and traffic by kind, with the expert-parallel parts
    told apart: the slowest rank's all-to-alls out of its compute (its slots hold them:
    ``expert_node_costs``), the slowest tail's edp all-reduce out of its data-parallel collectives
    (``dp_key``). ``moe``: ``stage_expert_steps``; rank r runs stages r, r + pp, ..."""
    slow, tail = moe[cost.slowest_stage::pp], moe[cost.tail_stage::pp]
    a2a, edp = (sum(x.seconds[k] for x in of) for k, of in ((EP_ALL_TO_ALL, slow), (EDP_ALL_REDUCE, tail)))
    parts = {**comm, dp_key: comm.get(dp_key, 0.0) - edp, EP_ALL_TO_ALL: a2a, EDP_ALL_REDUCE: edp}
    sent = {k: sum(x.traffic_bytes[k] for x in of) for k, of in ((EP_ALL_TO_ALL, slow), (EDP_ALL_REDUCE, tail))}
    return compute_s - a2a, {k: v for k, v in parts.items() if v > 1e-12}, {**traffic, **{k: v for k, v in sent.items()
                                                                                         if v}}
