"""The (dp, tp) mesh: how many ways each layer is split, how many replicas, how each splits its batch.

Reads a ``ModelProfile`` (its annotated graph, repeated layers, captured
batch), the parameter sizes, a ``ClusterSpec``, a ``TrainingRequest`` and
``Pins``. Returns a ``MeshDecision``: the tensor-parallel degree tp, the
data-parallel degree dp = world / tp, the expert-parallel degree ep (a model's
experts split over groups of ep dp ranks), the micro-batch size and
accumulation steps, the strategy of every node (from the TP ILP,
passes/tp/ilp.py), the predicted step time and memory by part, the solver's
report, and every alternative weighed with the reason it lost. Writes nothing on the graph;
the compile pipeline turns the decision into a plan (``layout_decisions``).

One ILP, repeated layers tied, per (tp, micro-batch, ep, ZeRO stage): tp over the divisors of
``gpus_per_node`` that divide the world (a TP group never spans nodes), micro-batch sizes
over the divisors of B / dp, smallest first, the expert-parallel degrees of a model with
experts (passes/experts.py ``ep_choices``: at tp = 1) and the ZeRO stages of
passes/dp/zero.zero_stages in order, keeping the first that fits. A candidate's step is
cost_model.mesh_step over the dense parameters' buckets, plus passes/experts.expert_step where
ep > 1 (the expert slices stay out of ZeRO: ``split_state``). The objective: the fastest
predicted step that fits; ties go to the smaller ZeRO stage, then the larger micro-batch, then
the smaller tp, then the smaller ep. The space, the cost of a candidate and what is reused
between solves: docs/cost-model.md, "The (dp, tp) mesh" and "Expert parallelism".
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from partita.core.buckets import unit_of
from partita.core.cluster import ClusterSpec
from partita.core.errors import InfeasibleError, PartitaError
from partita.core.experts import expert_load
from partita.core.mesh import Mesh
from partita.core.pins import Pins, TrainingRequest
from partita.core.placement import shard_dim
from partita.core.plans.plan import Alternative, MemoryBreakdown
from partita.core.precision import dtype_bytes, element_bytes
from partita.core.tp.strategies import node_strategies
from partita.core.tp.vocabulary import Strategy
from partita.passes.cost_model import (
    StepCost,
    mesh_step,
    model_state_memory,
    state_bytes_per_param,
    zero_optimizer_time,
)
from partita.passes.dp.buckets import DEFAULT_BUCKET_BYTES, gradient_buckets
from partita.passes.dp.zero import STRATEGY_NAMES, zero_stages, zero_units
from partita.passes.experts import (
    EDP_ALL_REDUCE,
    EP_ALL_TO_ALL,
    ep_choices,
    expert_links,
    expert_optimizer_time,
    expert_param_names,
    expert_shards,
    expert_step,
    imbalance,
    layer_loads,
    model_experts,
    split_state,
)
from partita.passes.explain import CHOSEN, gb, peak_terms, slower, slower_parts, traffic_reason
from partita.passes.peak_memory import (
    NO_BUFFERS,
    StepBuffers,
    graph_autocast,
    graph_transient,
    peak_memory,
    step_buffers,
)
from partita.passes.pipeline.costs import kv_ratio
from partita.passes.profile import ModelProfile
from partita.passes.space import micro_batches, tp_degrees, world_size
from partita.passes.tp.ilp import SOLVER, solve_tp
from partita.passes.tp.problem import StrategyFn, TPSetting, TPSolution, TPSolveReport, build_problem


@dataclass(frozen=True)
class MeshCandidate:
    """One (tp, micro-batch) weighed; ``cost``/``solver`` are None when it does not fit."""

    tp: int
    dp: int
    micro_batch_size: int
    grad_accum_steps: int
    memory_bytes: int  # of the chosen layout, or of the smallest layout when it does not fit
    fits: bool
    cost: StepCost | None
    memory: MemoryBreakdown | None
    solver: TPSolveReport | None
    reason: str = ""
    zero_stage: int = 0
    ep: int = 1  # experts split over groups of ep dp ranks (passes/experts.py)

    @property
    def step_s(self) -> float | None:
        return self.cost.step_s if self.cost is not None else None

    @property
    def mesh(self) -> Mesh:
        return Mesh(dp=self.dp, tp=self.tp, ep=self.ep)


@dataclass(frozen=True)
class MeshDecision:
    tp: int
    dp: int
    micro_batch_size: int
    grad_accum_steps: int
    choice: Mapping[str, Strategy]  # every graph node -> its strategy at this tp
    cost: StepCost  # comm_s keys: tp_forward, tp_backward, tp_internal, dp_all_reduce (+ ep > 1: passes/experts.py's)
    memory: MemoryBreakdown  # per device
    solver: TPSolveReport  # of the chosen (tp, micro-batch) solve
    alternatives: tuple[MeshCandidate, ...]  # every candidate, chosen first, then fitting by time, then misses
    buckets: tuple[int, ...]  # gradient bucket payloads of the local shards averaged over dp (ep > 1: no experts)
    bucket_bytes: int
    tp_link: str
    dp_link: str
    solves: int  # ILPs solved
    seconds: float
    zero_stage: int = 0
    unit_buckets: tuple[int, ...] = ()  # ZeRO-3's buckets (one per unit) at the chosen layout, bytes
    ep: int = 1  # experts split over groups of ep dp ranks (passes/experts.py)
    ep_link: str = ""  # the expert groups' link (ep > 1)
    edp_link: str = ""  # the link of the ranks holding the same experts (ep > 1)

    @property
    def step_s(self) -> float:
        return self.cost.step_s

    @property
    def mesh(self) -> Mesh:
        return Mesh(dp=self.dp, tp=self.tp, ep=self.ep)


def choose_mesh(
    profile: ModelProfile,
    param_numels: Sequence[int],
    cluster: ClusterSpec,
    request: TrainingRequest,
    pins: Pins = Pins(),
    *,
    strategies: StrategyFn | None = None,
    solver: str = SOLVER,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> MeshDecision:
    """Search (tp, micro-batch, ep), solving the TP ILP for each (docs/cost-model.md, "The (dp, tp) mesh")."""
    t0 = time.perf_counter()
    world = world_size(cluster, pins)
    B = request.global_batch
    G = profile.graph
    if sum(param_numels) != _graph_param_numel(G):
        raise ValueError(f"param_numels sum to {sum(param_numels):,} but the graph's parameters to "
                         f"{_graph_param_numel(G):,}: they describe different models")
    if strategies is None:
        strategies = node_strategies
    # the default strategies cache themselves on the graph (and their per-t lists in build_problem)
    cached = None if strategies is node_strategies else functools.lru_cache(maxsize=None)(
        lambda node, t: tuple(strategies(G, node, t)))

    state_per_param = state_bytes_per_param(request.precision, request.optimizer, inference=request.inference)
    grad_elem = 0 if request.inference else int(state_per_param.grads)
    layer_units = zero_units(profile.repeated)
    regions, experts, whole = model_experts(G), expert_param_names(G), _param_numels(G)
    candidates: list[MeshCandidate] = []
    best: tuple[MeshCandidate, TPSolution, tuple[int, ...], tuple[int, ...]] | None = None
    solves = 0
    slow: dict[tuple[int, int], tuple[float, int]] = {}  # (micro-batch, ep) -> routing's cost (ZeRO does not move it)
    for tp in _degrees(cluster, world, pins):
        dp = world // tp
        if B % dp:
            candidates.append(MeshCandidate(tp, dp, 0, 0, 0, False, None, None, None,
                                            f"global batch {B} does not divide over dp={dp}"))
            continue
        eps = ep_choices(regions, dp, tp, pins, request)
        # (ZeRO stage, ep) -> (micro-batch, bytes) of the first that did not fit
        too_big: dict[tuple[int, int], tuple[int, int]] = {}
        for mb in micro_batches(B // dp, pins):
            accum = B // dp // mb
            for ep in eps:
                # what a rank holds of each parameter, each at most 1/tp of it, of the experts E/ep (ep > 1)
                split = experts if ep > 1 else frozenset()
                shards = expert_shards(whole, split, ep)
                held = [-(-n // tp) for n in (param_numels if ep == 1 else shards.values())]
                for z in zero_stages(pins.zero_stage, dp, request.inference, tp=tp):
                    if (z, ep) in too_big:
                        mb0, need = too_big[z, ep]
                        candidates.append(MeshCandidate(tp, dp, mb, accum, need, False, None, None, None,
                                                        f"does not fit: {_zero(z)}{_ep(ep)}micro-batch {mb0} already "
                                                        f"needs {need / 1e9:.1f} GB > "
                                                        f"{cluster.usable_memory / 1e9:.1f} GB", z, ep))
                        continue
                    # the ILP bounds the state and the saved activations; the backward's other terms are
                    # held back from its budget (each node whole, ZeRO's buffers at 1/tp of each parameter),
                    # and the whole peak is priced at the chosen layout below
                    worst = _step_extras(profile, cluster, request, mb, dp, z, held,
                                         [-(-n // tp) for n in _unit_numels({k: n for k, n in shards.items()
                                                                             if k not in split}, layer_units)]
                                         if z == 3 else [], bucket_bytes, None)
                    # the ILP counts every parameter whole (tp = 1) under ZeRO z; a rank holds E/ep of the
                    # experts, whole, out of ZeRO (passes/experts.py split_state): the budget takes the difference
                    moe_whole = sum(whole[k] for k in split)
                    excess = (model_state_memory(moe_whole, state_per_param, zero_stage=z, dp=dp).total
                              - model_state_memory(moe_whole // ep, state_per_param).total)
                    setting = TPSetting(tp, mb, profile.batch_size, request.precision, request.optimizer,
                                        request.inference, _ilp_budget(cluster, worst) + excess, dp=dp,
                                        grad_accum=accum, zero_stage=z, kv_ratio=kv_ratio(profile, request),
                                        captured_dtype=profile.param_dtype, reduce_dtype=request.reduce_dtype)
                    problem = build_problem(G, setting, cluster,
                                            strategies=None if cached is None else lambda _G, n, t: cached(n, t),
                                            repeated=profile.repeated)
                    solves += 1
                    try:
                        sol = solve_tp(problem, solver=solver)
                    except InfeasibleError as e:
                        if getattr(e, "constraint", None) != "memory":
                            raise
                        # what the layout needs at the step's peak: its state and activations, and what was held back
                        too_big[z, ep] = (mb, round(e.needed_bytes + cluster.usable_memory - setting.memory_budget))
                        candidates.append(MeshCandidate(tp, dp, mb, accum, too_big[z, ep][1], False, None, None, None,
                                                        f"does not fit: {_ep(ep)}{e.message}", z, ep))
                        continue
                    by_name = _local_numels(G, sol.choice, tp, ep, split)
                    local = list(by_name.values())
                    # at ep > 1 the experts stay out of the dp buckets and out of ZeRO: their gradients are
                    # averaged over the ranks holding them (passes/experts.py)
                    dense = {k: n for k, n in by_name.items() if k not in split}
                    mine = [n for k, n in by_name.items() if k in split]
                    units = [unit_of(k, layer_units) for k in dense]
                    buckets = tuple(gradient_buckets(list(dense.values()), grad_elem, bucket_bytes,
                                                     units if z == 3 else None)) if grad_elem else ()
                    state = split_state(model_state_memory(sum(dense.values()), state_per_param, zero_stage=z, dp=dp),
                                        sum(mine), state_per_param)
                    transient, buffers, autocast, backward_grads = _step_extras(
                        profile, cluster, request, mb, dp, z, local, _unit_numels(dense, layer_units)
                        if z == 3 else [], bucket_bytes, sol.choice, accum)
                    # routing as pinned or measured: the slowest expert rank's work and activations (passes/experts.py)
                    loads = layer_loads(regions, ep, expert_load(pins.expert_load))
                    slow_s, slow_bytes = slow.get((mb, ep)) or slow.setdefault(
                        (mb, ep), imbalance(profile, cluster, request, mb, loads) if ep > 1 else (0.0, 0))
                    memory = peak_memory(state, activations=sol.activation_bytes + slow_bytes,
                                         capacity=cluster.usable_memory,
                                         cluster=cluster, transient=transient, buffers=buffers, autocast=autocast,
                                         backward_grads=backward_grads)
                    if not memory.fits:  # at the optimizer step (its fp32 gradients), or ZeRO's buffers at this layout
                        too_big[z, ep] = (mb, memory.total)
                        candidates.append(MeshCandidate(tp, dp, mb, accum, memory.total, False, None, memory, None,
                                                        f"does not fit: {_ep(ep)}{_peak_reason(memory)}", z, ep))
                        continue
                    cost = mesh_step(
                        micro_batch_s={"compute": sol.compute_s, "tp_forward": sol.tp_forward_s,
                                       "tp_backward": sol.tp_backward_s, "tp_internal": sol.tp_internal_s},
                        grad_accum=accum, dp=dp, tp=tp, grad_buckets=list(buckets), state=state, cluster=cluster,
                        reduce_dtype=request.reduce_dtype, zero_stage=z, local_params=sum(dense.values()),
                        state_bytes=state_per_param)
                    if ep > 1:
                        moe = expert_step(regions, mine, ep=ep, dp=dp, tp=tp, micro_batch=mb, batch=profile.batch_size,
                                          grad_accum=accum, precision=request.precision,
                                          reduce_dtype=request.reduce_dtype, captured_dtype=profile.param_dtype,
                                          cluster=cluster, bucket_bytes=bucket_bytes, loads=loads)
                        opt = (zero_optimizer_time(sum(dense.values()), state_per_param, z, dp, cluster)
                               + expert_optimizer_time(sum(mine), state_per_param, cluster))
                        cost = StepCost(cost.compute_s + accum * slow_s, {**cost.comm_s, **moe.seconds}, opt,
                                        {**cost.traffic_bytes, **moe.traffic_bytes})
                    if request.inference:
                        cost = StepCost(cost.compute_s, {k: v for k, v in cost.comm_s.items() if k.startswith("tp_")},
                                        0.0)
                    cand = MeshCandidate(tp, dp, mb, accum, memory.total, True, cost, memory, sol.report, "", z, ep)
                    candidates.append(cand)
                    if best is None or _key(cand) < _key(best[0]):
                        unit_buckets = tuple(gradient_buckets(list(dense.values()), grad_elem, bucket_bytes, units)
                                             ) if grad_elem else ()
                        best = (cand, sol, buckets, unit_buckets)
                    break  # the first ZeRO stage that fits: larger ones only add traffic (passes/dp/zero.py)
    if best is None:
        raise _infeasible(candidates, cluster, world)
    chosen, sol, buckets, unit_buckets = best
    ordered = _ordered(candidates, chosen, cluster)
    ep_link, edp_link = expert_links(cluster, dp=chosen.dp, tp=chosen.tp, ep=chosen.ep)
    return MeshDecision(
        tp=chosen.tp, dp=chosen.dp, micro_batch_size=chosen.micro_batch_size,
        grad_accum_steps=chosen.grad_accum_steps, choice=sol.choice, cost=chosen.cost, memory=chosen.memory,
        solver=sol.report, alternatives=ordered, buckets=buckets, bucket_bytes=bucket_bytes,
        tp_link=cluster.link_for_group(chosen.tp).name,
        dp_link=cluster.link_for_group(chosen.dp, stride=chosen.tp).name,
        solves=solves, seconds=time.perf_counter() - t0, zero_stage=chosen.zero_stage, unit_buckets=unit_buckets,
        ep=chosen.ep, ep_link=ep_link.name if chosen.ep > 1 else "", edp_link=edp_link.name if chosen.ep > 1 else "",
    )


def _degrees(cluster: ClusterSpec, world: int, pins: Pins) -> list[int]:
    """The TP degrees to weigh (passes/space.py ``tp_degrees``); tp = 1 alone under a pinned ep > 1
    (passes/experts.py: experts split at tp = 1 only)."""
    degrees = tp_degrees(cluster, world, pins)
    if (pins.ep or 1) == 1:
        return degrees
    if 1 not in degrees:
        raise PartitaError(f"--ep {pins.ep} splits experts at tp=1 only, but {pins.describe()} leaves tp={degrees[0]}",
                           hint=f"pin --dp {world}, or drop --ep")
    return [1]


def plan_alternatives(decision: MeshDecision, limit: int = 12) -> tuple[Alternative, ...]:
    """The alternatives in the plan's form: the chosen one, the fastest per (tp, ep, ZeRO stage), then the
    nearest misses."""
    chosen = decision.alternatives[0]
    picked = [chosen]
    seen = {(chosen.tp, chosen.ep, chosen.zero_stage)}
    for c in decision.alternatives[1:]:
        if c.fits and (c.tp, c.ep, c.zero_stage) not in seen:
            picked.append(c)
            seen.add((c.tp, c.ep, c.zero_stage))
    picked += [c for c in decision.alternatives[1:] if c.fits and c not in picked][:2]
    misses = [c for c in decision.alternatives if not c.fits and c.micro_batch_size]
    by_zero = {}
    for c in misses:  # the nearest miss of each (ZeRO stage, ep), then the nearest others
        by_zero.setdefault((c.zero_stage, c.ep), c)
    picked += list(by_zero.values()) + [c for c in misses if c not in by_zero.values()][:2]
    return tuple(
        Alternative(mesh=c.mesh, micro_batch_size=c.micro_batch_size,
                    grad_accum_steps=c.grad_accum_steps, zero_stage=c.zero_stage, step_time_s=c.step_s,
                    memory_bytes=c.memory_bytes, fits=c.fits, chosen=c is chosen, reason=c.reason)
        for c in picked[:limit]
    )


# -- memory at the step's peak ------------------------------------------------------


def _step_extras(profile: ModelProfile, cluster: ClusterSpec, request: TrainingRequest, mb: int, dp: int, z: int,
                 numels: Sequence[int], unit_numels: Sequence[int], bucket_bytes: int,
                 choice: Mapping[str, Strategy] | None,
                 accum: int = 1) -> tuple[float, StepBuffers, float, float | None]:
    """What a step holds beyond the state and the saved activations at (micro-batch, dp, ZeRO z), for
    the layout ``choice`` (None: every node whole): the costliest op's transient, the runtime's
    buffers and autocast's fp32 copies (cost_model: graph_transient, step_buffers, graph_autocast);
    and where the step frees its gradients between steps (one micro-batch, no data parallelism:
    runtime/engine.py), the gradients alive at the backward's peak (else None: all of them)."""
    if request.inference:
        return 0.0, NO_BUFFERS, 0.0, None
    G = profile.graph
    share = None if choice is None else (lambda n: choice[n].memory_fraction)
    args = dict(micro_batch=mb, batch=profile.batch_size, precision=request.precision, device=cluster.device,
                captured=profile.param_dtype, fraction=share)
    # the runtime frees gradients between steps (one micro-batch, no data parallelism): backward makes them as it
    # goes (measured on CPU, fp32). Under mixed precision the H200 record's peak lies above that account by about
    # a gradient's bytes (docs/cost-model.md, "Memory at the step's peak"), so there every gradient is counted.
    frees = z == 0 and dp == 1 and accum == 1 and not request.precision.endswith("-mixed")
    whole = _graph_param_numel(G)
    grads_share = (element_bytes(request.precision) / dtype_bytes(profile.param_dtype or "float32")
                   * sum(numels) / whole) if frees and whole else None
    transient, _, grads = graph_transient(G, **args, grads_share=grads_share)
    buffers = step_buffers(precision=request.precision, reduce_dtype=request.reduce_dtype, zero_stage=z, dp=dp,
                           numel=sum(numels), largest=max(numels, default=0),
                           unit_numel=max(unit_numels, default=0), bucket_bytes=bucket_bytes,
                           tensors=G.graph.get("step_peak_tensors", 0), accumulates=not frees)
    return transient, buffers, graph_autocast(G, **args), grads if frees else None


def _ilp_budget(cluster: ClusterSpec, extras: tuple[float, StepBuffers, float, float | None]) -> float:
    """The ILP's budget for the state and the saved activations (autocast's copies among them): the
    device's usable memory less the allocator's share and the backward's other terms
    (peak_memory.peak_total: (state + max(activations + transient + collectives, step) + rounding)
    x (1 + fragmentation)); the step's side is checked once the layout is known."""
    transient, buffers, _, _ = extras
    rounding = buffers.tensors * cluster.alloc_granularity if cluster.alloc_granularity > 1 else 0
    return cluster.usable_memory / (1 + cluster.fragmentation) - rounding - transient - buffers.collectives


def _peak_reason(m: MemoryBreakdown) -> str:
    """Why a layout the ILP fitted does not fit at the step's peak, in GB by term."""
    return (f"{gb(m.total)} at the step's peak > {gb(m.capacity)}: model state {gb(m.state)} + activations "
            f"{gb(m.activations)}{peak_terms(m)}")


def _unit_numels(numels: Mapping[str, int], layer_units: Sequence[str]) -> list[int]:
    """Elements of each ZeRO-3 unit on one device (``numels``: its parameters' local shards by name)."""
    per: dict[str, int] = {}
    for name, n in numels.items():
        u = unit_of(name, layer_units)
        per[u] = per.get(u, 0) + n
    return list(per.values())


# -- the space -----------------------------------------------------------------------


def _param_numels(G) -> dict[str, int]:
    """Elements of each distinct parameter, in graph (registration) order."""
    seen: dict[str, int] = {}
    for _, a in G.nodes(data=True):
        if a["kind"] == "param":
            seen.setdefault(a["param_name"], _numel(a["shapes"][0]))
    return seen


def _graph_param_numel(G) -> int:
    return sum(_param_numels(G).values())


def _local_numels(G, choice: Mapping[str, Strategy], tp: int, ep: int = 1,
                  experts: Collection[str] = ()) -> dict[str, int]:
    """Elements of each distinct parameter's local shard, in graph (registration) order: 1/tp where
    ``choice`` shards it, E/ep of the ``experts``' (passes/experts.py ``expert_shards``)."""
    out: dict[str, int] = {}
    for n, a in G.nodes(data=True):
        if a["kind"] == "param" and a["param_name"] not in out:
            st = choice[n]
            sharded = bool(st.out) and shard_dim(st.out[0]) is not None
            out[a["param_name"]] = _numel(a["shapes"][0]) // (tp if sharded else 1)
    return expert_shards(out, experts, ep)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# -- choosing and explaining ----------------------------------------------------------


def _key(c: MeshCandidate) -> tuple:
    return (c.step_s, c.zero_stage, -c.micro_batch_size, c.tp, c.ep)


def _zero(z: int) -> str:
    return f"{STRATEGY_NAMES[z]}, " if z else ""


def _ep(ep: int) -> str:
    return f"experts split over ep={ep}, " if ep > 1 else ""


def _ordered(candidates: list[MeshCandidate], chosen: MeshCandidate,
             cluster: ClusterSpec) -> tuple[MeshCandidate, ...]:
    fitting = sorted((c for c in candidates if c.fits), key=_key)
    misses = sorted((c for c in candidates if not c.fits), key=lambda c: (c.memory_bytes == 0, c.memory_bytes))
    out = []
    for c in fitting + misses:
        reason = c.reason if not c.fits else _reason(c, chosen, cluster)
        out.append(c if c.reason == reason else _with_reason(c, reason))
    return tuple(out)


def _with_reason(c: MeshCandidate, reason: str) -> MeshCandidate:
    return dataclasses.replace(c, reason=reason)


def _reason(c: MeshCandidate, best: MeshCandidate, cluster: ClusterSpec | None = None) -> str:
    if c is best:
        return CHOSEN
    a, b = c.cost, best.cost
    tp_a = sum(v for k, v in a.comm_s.items() if k.startswith("tp_"))
    tp_b = sum(v for k, v in b.comm_s.items() if k.startswith("tp_"))
    dp_a, dp_b = _dp_comm(a), _dp_comm(b)
    parts = slower_parts((("compute", a.compute_s, b.compute_s), ("TP communication", tp_a, tp_b),
                          ("gradient all-reduce" if not c.zero_stage and not best.zero_stage
                           else "data-parallel collectives", dp_a, dp_b),
                          ("expert all-to-alls", a.comm_s.get(EP_ALL_TO_ALL, 0.0), b.comm_s.get(EP_ALL_TO_ALL, 0.0)),
                          ("optimizer", a.optimizer_s, b.optimizer_s)), slack=1e-9)
    if not parts:
        parts.append("equal time; the smaller ZeRO stage, the larger micro-batch, the smaller tp, then the smaller "
                     "ep, break the tie")
    if c.zero_stage and dp_a > dp_b * 1.001 and cluster is not None:
        parts.append(traffic_reason(c.zero_stage, _dp_bytes(a), cluster.link_for_group(c.dp, stride=c.tp), dp_a))
    return slower(c.step_s / best.step_s, parts)


def _dp_comm(cost: StepCost) -> float:
    """The step's gradient averaging: over dp, ZeRO's collectives, and the experts' over "edp"."""
    return sum(v for k, v in cost.comm_s.items() if k in ("dp_all_reduce", EDP_ALL_REDUCE) or k.startswith("zero_"))


def _dp_bytes(cost: StepCost) -> float:
    return sum(v for k, v in cost.traffic_bytes.items() if k == "dp_all_reduce" or k.startswith("zero_"))


def _infeasible(candidates: list[MeshCandidate], cluster: ClusterSpec, world: int) -> InfeasibleError:
    sized = [c for c in candidates if c.memory_bytes]
    if not sized:
        reasons = "; ".join(sorted({c.reason for c in candidates if c.reason})) or (
            "no tensor-parallel degree divides both the devices per node and the world")
        return InfeasibleError(f"no (dp, tp) mesh of {world} devices is possible: {reasons}",
                               hint="choose a global batch divisible by the data-parallel degree")
    least = min(sized, key=lambda c: c.memory_bytes)
    gb = 1e9
    return InfeasibleError(
        f"memory: no (dp, tp) mesh fits; the smallest layout (tp={least.tp}, {_zero(least.zero_stage)}"
        f"{_ep(least.ep)}micro-batch {least.micro_batch_size}) "
        f"needs {least.memory_bytes / gb:.1f} GB per device, budget {cluster.usable_memory / gb:.1f} GB "
        f"({cluster.memory_bytes / gb:.0f} GB less {cluster.memory_reserve:.0%} reserve)",
        hint=f"tp is at most {cluster.gpus_per_node} (one node); add pipeline stages, a higher ZeRO stage, "
        "use devices with more memory, or lower the micro-batch")
