"""The joint search: mesh (dp, tp, pp), micro-batches, schedule, stage cuts and tensor splits, together.

Reads a ``ModelProfile`` (the annotated graph), the parameter sizes, a
``ClusterSpec``, a ``TrainingRequest`` and ``Pins``. Returns a ``Decision``:
everything a plan records, with the predicted step time and memory, and every
alternative weighed with the reason it lost. Writes nothing on the graph.

Each part has one home; this module only joins them. tp runs over the divisors of the
GPUs per node (passes/space.py). At pp = 1, passes/tp/mesh.choose_mesh solves the TP ILP
(passes/tp/ilp.py); at pp > 1, passes/pipeline/stages.choose_pipeline cuts the model by
the per-node costs of the layout the ILP chooses at that tp and micro-batch
(passes/tp/layout_costs.py ``tp_node_costs``, solved once per (tp, micro-batch) in
``_Layouts`` and shared by every p, dp and ZeRO stage). Both weigh the ZeRO stages of passes/dp/zero.py. With
``prune=True`` (the default) the fastest step found so far bounds the next
choose_pipeline (passes/pipeline/bounds.py); ``prune=False`` cuts everything and gives
the same plan (tests/unit/test_search_pruning.py).

Expert parallelism (passes/experts.py, tp = 1) is weighed by the mesh search (every ep, beside
every ZeRO stage) and by the pipeline search (a pinned ``--ep``, else each degree the experts
divide into, without offload), on each rank's share of the experts with the all-to-alls in the
slots (``expert_costs``).

The objective: the fastest predicted step that fits; ties go to fewer stages, then to
the smaller ZeRO stage, then to the smaller tp. How the space is covered and pruned, and
why: docs/cost-model.md, "The joint search".
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from partita.core.axes import check_pins
from partita.core.axes.context import RING
from partita.core.buckets import DEFAULT_BUCKET_BYTES
from partita.core.cluster import ClusterSpec
from partita.core.errors import InfeasibleError, PartitaError
from partita.core.experts import expert_load
from partita.core.mesh import Mesh
from partita.core.optimizers import NO_OFFLOAD, OFFLOAD_OPTIMIZER
from partita.core.pins import Pins, TrainingRequest
from partita.core.plans.plan import Alternative, MemoryBreakdown, Stage
from partita.core.recompute import FULL, NONE
from partita.core.tp.vocabulary import Strategy
from partita.passes.context import (
    CP_KEYS,
    context_calls,
    context_costs,
    context_parts,
    context_profile,
    context_traffic,
    cp_note,
    cp_queue,
    sequence_binds,
    stage_context_s,
)
from partita.passes.cost_model import model_state_memory, state_bytes_per_param, zero_optimizer_time, zero_step_comm
from partita.passes.dp.buckets import gradient_buckets
from partita.passes.dp.zero import STRATEGY_NAMES
from partita.passes.experts import (
    check_ep_pin,
    expert_parts,
    model_experts,
    pipeline_ep_pins,
    routing,
    stage_expert_steps,
)
from partita.passes.explain import traffic_reason
from partita.passes.facts import model_facts
from partita.passes.peak_memory import peak_memory, step_buffers
from partita.passes.pipeline.bounds import AllPruned, PrunedCandidate
from partita.passes.pipeline.costs import NodeCosts, node_costs
from partita.passes.pipeline.decision import PipelineCandidate, PipelineDecision, binds_memory
from partita.passes.pipeline.stages import choose_pipeline, stage_of_nodes
from partita.passes.profile import ModelProfile
from partita.passes.space import tp_degrees, world_size
from partita.passes.tp.layout_costs import tp_choice, tp_node_costs
from partita.passes.tp.mesh import MeshDecision, choose_mesh, plan_alternatives
from partita.passes.tp.sequence import residual_nodes


@dataclass(frozen=True)
class Decision:
    """What the compile pipeline turns into a plan."""

    mesh: Mesh
    micro_batch_size: int
    grad_accum_steps: int  # micro-batches per data-parallel rank per step
    schedule: str  # "none", or one of core/schedule.py SCHEDULES
    zero_stage: int
    choice: Mapping[str, Strategy]  # node -> tensor-parallel strategy
    node_stage: Mapping[str, int]  # node -> pipeline stage
    stages: tuple[Stage, ...]
    step_s: float
    compute_s: float
    comm_s: Mapping[str, float]  # kind -> exposed seconds per step
    optimizer_s: float
    traffic_bytes: Mapping[str, int]
    memory: MemoryBreakdown  # the most loaded device
    buckets: tuple[int, ...]  # gradient buckets of one rank's local parameters (its stage's), bytes
    bucket_bytes: int
    alternatives: tuple[Alternative, ...]
    method: str
    status: str
    gap: float
    candidates: int  # solved
    seconds: float
    notes: tuple[str, ...] = field(default_factory=tuple)
    pruned: int = 0  # pipeline (p, micro-batch) groups not cut: they could not win (plan_search)
    unit_buckets: tuple[int, ...] = ()  # ZeRO-3's buckets (one per unit) at this layout, bytes, where known
    chunks: int = 1  # virtual stages per pipeline rank (interleaved 1F1B): ``stages`` holds pp x chunks
    offload: str = NO_OFFLOAD  # the optimizer's state and masters in host memory (core/optimizers.py)
    sequence_parallel: bool = False  # the residual stream split along the sequence (passes/tp/sequence.py)
    cp_attention: str = RING  # how attention meets the rest of its sequence at mesh.cp > 1 (passes/context.py)
    expert_load: float = 1.0  # the slowest expert rank's rows over the mean, as priced (passes/experts.py routing)
    routing: str = ""  # what the expert load assumes, and where from ("" without experts)


def plan_search(
    profile: ModelProfile,
    param_numels: Sequence[int],
    cluster: ClusterSpec,
    request: TrainingRequest,
    pins: Pins = Pins(),
    *,
    prune: bool = True,
) -> Decision:
    """Decide every axis together (docs/cost-model.md, "The joint search").

    ``prune=False`` solves every candidate (the exhaustive search the pruned one is
    tested against): the same plan, slower, with every candidate's own numbers.
    """
    t0 = time.perf_counter()
    world = world_size(cluster, pins)
    tp_degrees(cluster, world, pins, pp=pins.pp)  # the pins checked once, before any solve
    options: list[Decision] = []
    errors: list[InfeasibleError] = []
    pruned: list[PrunedCandidate] = []
    layouts: dict[int, _Layouts] = {}  # per cp: one cp rank's view of the profile (passes/context.py)

    def layouts_at(cp: int) -> _Layouts:
        if cp not in layouts:
            layouts[cp] = _Layouts(context_profile(profile, cp), cluster, request)
        return layouts[cp]

    tried_pipeline = False
    # A pinned schedule asks for a pipeline; pinned recomputation is weighed by the pipeline search
    # alone (at p = 1 too), which decides it per stage.
    # every axis's rules, now with the facts the graph and the cluster give (core/axes)
    facts = model_facts(profile, cluster)
    check_pins(pins, inference=request.inference, facts=facts)
    check_ep_pin(model_experts(profile.graph), pins)
    # the pipeline search alone weighs these (at p = 1 too), per stage; and context parallelism
    pinned_pipeline = (pins.recomputes or pins.offload == OFFLOAD_OPTIMIZER or bool(pins.sequence_parallel)
                       or (pins.cp or 1) > 1)
    if pins.pp in (None, 1) and pins.schedule is None and not pinned_pipeline:
        try:
            options.append(_from_mesh(choose_mesh(profile, param_numels, cluster, request,
                                                  replace(pins, pp=None, cp=None)), profile, cluster))
        except InfeasibleError as e:
            errors.append(e)
    residual = bool(residual_nodes(profile.graph))

    def pipelines(queue: list[tuple[int, bool, Pins]]) -> None:
        """Run the pipeline search at each (tp, sequence parallel, pins) of ``queue``, adding to it the
        split stream where memory binds."""
        nonlocal pruned

        def search(tp: int, sp: bool, at: Pins, bound: float, probe: bool = False) -> PipelineDecision:
            lay = layouts_at(at.cp or 1)
            return choose_pipeline(profile, cluster, request, replace(at, tp=tp), devices_per_stage=tp,
                                   costs=lambda mb: lay.node_costs(mb, tp, sp), floor_costs=lay.floor(tp),
                                   prune=prune, bound=bound, probe=probe)

        # Branch and bound's incumbent, early: each entry's most promising groups (by their lower bound)
        # up to the first that fits, so that every full search below prunes against the best of them
        # all. Those groups are weighed again in their own full search: what is chosen does not change.
        probed = math.inf
        for tp, sp, at in queue if prune and len(queue) > 1 else ():
            try:
                probed = min(probed, search(tp, sp, at, math.inf, probe=True).best.step_s)
            except PartitaError:
                pass  # nothing fits in those groups: the full search says why
        while queue:
            tp, sp, at = queue.pop(0)
            best_s = min([probed] + [o.step_s for o in options])
            decision, unfit, lost = None, False, False
            cp = at.cp or 1
            try:
                decision = search(tp, sp, at, best_s)
            except AllPruned as e:
                pruned += [replace(x, cp=cp, ep=at.ep or 1) for x in e.pruned]
                unfit = all(x.memory for x in e.pruned)
                lost = any(x.binds for x in e.pruned)  # groups fit, by recomputing or offloading, and lost
            except InfeasibleError as e:
                errors.append(e)
                unfit = True
            except PartitaError:
                pass  # this tp leaves no pipeline split of the batch (e.g. dp does not divide it)
            if decision is not None:
                pruned += [replace(x, cp=cp, ep=at.ep or 1) for x in decision.pruned]
                options.append(_from_pipeline(decision, profile, cluster, request, tp, layouts_at(cp), sp, at))
            # the split stream holds less: weighed where memory binds, after the rest (a tighter bound); and
            # where groups fit only by recomputing or offloading, and lost to the best found
            if (not sp and tp > 1 and residual and pins.sequence_parallel is None
                    and (unfit or lost or _memory_binds(decision))):
                queue.append((tp, True, at))
    # where the plain mesh does not fit, the pipeline search weighs recomputation and offload at p = 1 too
    if (pins.pp != 1 and world > 1) or pinned_pipeline or (not options and pins.recompute is None):
        tried_pipeline = (pins.pp != 1 and world > 1) or pinned_pipeline  # not only as the fallback
        # With a pp = 1 plan in hand that needs no ZeRO, pipelines are weighed at tp = 1 only (cheap:
        # no ILP), so the plan can say what a pipeline would cost; otherwise at every tp (a pipeline
        # divides the state ZeRO would otherwise move every step).
        fits_plain = bool(options) and options[0].zero_stage == 0
        degrees = tp_degrees(cluster, world, pins, pp=pins.pp) if (pins.pp or not fits_plain) else [pins.tp or 1]
        degrees = [1] if (pins.ep or 1) > 1 else degrees  # experts split at tp = 1 (passes/experts.py)
        pipelines([(t, bool(pins.sequence_parallel) and t > 1, pins) for t in degrees] + [
            (1, False, at) for at in pipeline_ep_pins(model_experts(profile.graph), world, pins, request)])
    # context parallelism, unpinned, where the sequence binds memory: weighed after the rest (passes/context.py)
    if pins.cp is None and sequence_binds(options, facts, request, pins):
        tried_pipeline = True
        pipelines(cp_queue(cluster, world, pins, facts, request, residual))
    if not options:
        if errors:
            raise errors[-1] if tried_pipeline else errors[0]
        from partita.passes.dp.zero import RUNTIME_ZERO

        raise PartitaError(f"no plan matches the pins ({pins.describe()}) on {world} devices"
                           + (f" ({RUNTIME_ZERO})" if pins.zero_stage else ""),
                           hint="drop a pin to let partita choose that decision")
    options.sort(key=lambda d: (d.step_s, d.mesh.pp, d.zero_stage, d.mesh.tp, d.mesh.cp))
    best = options[0]
    alternatives = _name_faster_unweighed(_merge_alternatives(options), _pruned_zero(best, cluster, request, pins)) \
        + _pruned_pipelines(pruned, best)
    solved = sum(o.candidates for o in options)
    notes = best.notes + cp_note(best, options, pins) + (f"{len(options)} mesh families weighed "
                          f"({', '.join(sorted({f'pp={o.mesh.pp} tp={o.mesh.tp}' for o in options}))})",
                          "ZeRO: per (mesh, micro-batch) the first stage of 0-3 that fits is weighed; larger "
                          "stages are priced at the chosen layout, not planned unless pinned (passes/dp/zero.py)"
                          if pins.zero_stage is None
                          else f"ZeRO-{pins.zero_stage} pinned")
    if prune:
        slower = sum(not x.memory for x in pruned)
        notes += (f"{solved} candidates solved; {len(pruned)} pipeline (p, micro-batch) groups pruned before "
                  f"cutting: {slower} by a lower bound above the best step found, {len(pruned) - slower} "
                  "because no cuts fit memory (passes/pipeline/bounds.py PipelineBound)",)
    load, said = routing(profile.graph, best.mesh.ep, expert_load(pins.expert_load))
    return replace(best, alternatives=alternatives, seconds=time.perf_counter() - t0, notes=notes,
                   candidates=solved, pruned=len(pruned), expert_load=load, routing=said)


def _pruned_pipelines(pruned: Sequence[PrunedCandidate], best: Decision, limit: int = 8) -> tuple[Alternative, ...]:
    """The pipeline groups not cut, in the plan's form: per (pp, tp) the one nearest to winning
    (the lowest bound), the slower-bound ones first; each says why it could not win."""
    nearest: dict[tuple[int, int, int], PrunedCandidate] = {}
    for x in sorted(pruned, key=lambda x: (x.memory, x.lower_bound_s)):
        nearest.setdefault((x.pp, x.tp, x.cp, x.ep), x)
    return tuple(
        Alternative(mesh=Mesh(dp=x.dp, tp=x.tp, pp=x.pp, cp=x.cp, ep=x.ep), micro_batch_size=x.micro_batch_size,
                    grad_accum_steps=x.micro_batches, zero_stage=x.zero_stage, step_time_s=None, memory_bytes=0,
                    fits=False, chosen=False, reason=x.reason)
        for x in list(nearest.values())[:limit])


class _Layouts:
    """The TP ILP's layout and per-node costs per (tp, micro-batch), solved once per plan_search and
    shared by every p, dp, micro-batch count and ZeRO stage cut over them (the layout is by time
    alone, so none of those change it), and by the chosen plan's record."""

    def __init__(self, profile: ModelProfile, cluster: ClusterSpec, request: TrainingRequest):
        self.profile, self.cluster, self.request = profile, cluster, request
        self._choice: dict[tuple[int, int, bool], Mapping[str, Strategy]] = {}
        self._costs: dict[tuple[int, int, bool], NodeCosts] = {}
        self._floors: dict[tuple[int, int], NodeCosts] = {}  # (micro-batch, tp), shared by every pipeline search

    def choice(self, micro_batch: int, tp: int, sp: bool = False) -> Mapping[str, Strategy]:
        key = (micro_batch, tp, sp)
        if key not in self._choice:
            self._choice[key] = tp_choice(self.profile, self.cluster, self.request, micro_batch, tp, sp=sp)
        return self._choice[key]

    def node_costs(self, micro_batch: int, tp: int, sp: bool = False) -> NodeCosts:
        """``sp``: the layout with the residual stream split along the sequence (passes/tp/sequence.py)."""
        key = (micro_batch, tp, sp and tp > 1)
        if key not in self._costs:
            self._costs[key] = tp_node_costs(self.profile, self.cluster, self.request, micro_batch, tp,
                                             choice=self.choice(*key) if tp > 1 else None,
                                             base=self.node_costs(micro_batch, 1) if tp > 1 else None, sp=key[2])
        return self._costs[key]

    def floor(self, tp: int) -> Callable[[int], NodeCosts]:
        """Per-node costs never above ``node_costs(., tp)``'s, without the ILP: node_costs at tp
        divides every node's FLOPs, saved bytes and parameters by tp (every strategy's compute and
        memory fractions are 1/tp or 1) and charges no TP collectives. Exact at tp = 1. Both scale
        the saved bytes by the same ``activation_scale``."""
        return lambda mb: self._floor(mb, tp) if tp > 1 else self.node_costs(mb, 1)

    def _floor(self, micro_batch: int, tp: int) -> NodeCosts:
        if (micro_batch, tp) not in self._floors:
            self._floors[micro_batch, tp] = node_costs(self.profile, self.cluster, self.request, micro_batch, tp=tp)
        return self._floors[micro_batch, tp]


def _pruned_zero(best: Decision, cluster: ClusterSpec, request: TrainingRequest, pins: Pins) -> tuple[Alternative, ...]:
    """The ZeRO stages above the chosen one, which the solvers did not weigh at its (mesh, micro-batch)
    (passes/dp/zero.py), priced at the chosen layout and cuts: the chosen step with its data-parallel
    collectives replaced by theirs, so the plan says what each would have cost."""
    dp, z0 = best.mesh.dp, best.zero_stage
    if pins.zero_stage is not None or dp <= 1 or request.inference or z0 == 3 or best.mesh.ep > 1:
        return ()  # priced without experts split only (their slices stay out of ZeRO: passes/experts.py)
    state = state_bytes_per_param(request.precision, request.optimizer)
    elem = int(state.grads)
    numel = max(s.params for s in best.stages) if best.stages else sum(best.buckets) / elem
    buckets = list(best.buckets) or gradient_buckets([round(numel)], elem, best.bucket_bytes)
    link = cluster.link_for_group(dp, stride=best.mesh.tp)
    dp_s = sum(v for k, v in best.comm_s.items() if k == "dp_all_reduce" or k.startswith("zero"))
    wire = dict(elem_bytes=elem, reduce_dtype=request.reduce_dtype)
    dp_bytes = zero_step_comm(z0, buckets, dp, best.grad_accum_steps, link, **wire).total_bytes
    out = []
    for z in range(z0 + 1, 4):
        # ZeRO-3 by units (core/buckets.py) where the layout's units are known, else the chosen buckets
        of_z = list(best.unit_buckets) if z == 3 and best.unit_buckets else buckets
        comm = zero_step_comm(z, of_z, dp, best.grad_accum_steps, link, **wire)
        opt = zero_optimizer_time(numel, state, z, dp, cluster)
        step = best.step_s - dp_s - best.optimizer_s + comm.total_s + opt
        out.append(Alternative(
            mesh=best.mesh, micro_batch_size=best.micro_batch_size, grad_accum_steps=best.grad_accum_steps,
            zero_stage=z, step_time_s=step, fits=True, chosen=False,
            memory_bytes=peak_memory(
                model_state_memory(round(numel), state, zero_stage=z, dp=dp), activations=best.memory.activations,
                capacity=best.memory.capacity, cluster=cluster, transient=best.memory.transient,
                buffers=step_buffers(precision=request.precision, reduce_dtype=request.reduce_dtype, zero_stage=z,
                                     dp=dp, numel=round(numel), unit_numel=round(max(of_z) / elem),
                                     bucket_bytes=best.bucket_bytes)).total,
            reason=f"not weighed: {STRATEGY_NAMES[z0]} already fits this mesh and micro-batch; "
                   f"{traffic_reason(z, comm.total_bytes, link, comm.total_s)}, "
                   f"{comm.total_bytes / max(dp_bytes, 1):.3g}x the traffic; optimizer {opt * 1e3:.3g} ms vs "
                   f"{best.optimizer_s * 1e3:.3g} ms; {step / best.step_s:.2f}x the step at this layout"))
    return tuple(out)


def _name_faster_unweighed(weighed: tuple[Alternative, ...], unweighed: tuple[Alternative, ...]
                           ) -> tuple[Alternative, ...]:
    """``weighed + unweighed``, where an unweighed ZeRO row predicted faster than the chosen one says so
    and how to have it (a pin), and the chosen row says it is the fastest of those weighed, naming it:
    no row is faster than the chosen one without a word why."""
    chosen = next((a for a in weighed if a.chosen), None)
    faster = [a for a in unweighed if chosen is not None and a.step_time_s < chosen.step_time_s]
    if not faster:
        return weighed + unweighed
    quickest = min(faster, key=lambda a: a.step_time_s)
    note = (f"chosen: fastest predicted step that fits of those weighed; ZeRO-{quickest.zero_stage} at this layout "
            f"is predicted {quickest.step_time_s / chosen.step_time_s:.2f}x (its sharded optimizer step), not weighed: "
            f"pin --zero {quickest.zero_stage} to plan it")
    return tuple(replace(a, reason=note) if a.chosen else a for a in weighed) + tuple(
        replace(a, reason=a.reason.replace("not weighed:", f"faster here but not weighed (pin --zero {a.zero_stage} "
                                           "to plan it):", 1)) if a in faster else a for a in unweighed)


# -- pp = 1: the mesh search ----------------------------------------------------


def _from_mesh(d: MeshDecision, profile: ModelProfile, cluster: ClusterSpec) -> Decision:
    return Decision(
        mesh=d.mesh, micro_batch_size=d.micro_batch_size, grad_accum_steps=d.grad_accum_steps, schedule="none",
        zero_stage=d.zero_stage, choice=d.choice, node_stage={n: 0 for n in profile.graph.nodes}, stages=(),
        step_s=d.step_s, compute_s=d.cost.compute_s, comm_s={k: v for k, v in d.cost.comm_s.items() if v > 0},
        optimizer_s=d.cost.optimizer_s, traffic_bytes=dict(d.cost.traffic_bytes), memory=d.memory,
        buckets=d.buckets, bucket_bytes=d.bucket_bytes, alternatives=plan_alternatives(d), unit_buckets=d.unit_buckets,
        method=f"(tp, micro-batch) enumeration with a tensor-parallel ILP each ({d.solver.solver}, "
               f"{d.solver.classes} node classes, repeated layers tied)",
        status=d.solver.status, gap=d.solver.gap, candidates=len(d.alternatives), seconds=d.seconds,
        notes=(f"{sum(c.fits for c in d.alternatives)} of {len(d.alternatives)} (tp, micro-batch) candidates fit "
               f"memory; {d.solves} ILPs solved", f"TP group on {d.tp_link}, DP group on {d.dp_link}")
        + ((f"experts split over groups of ep={d.ep} on {d.ep_link}; their gradients averaged over the "
            f"{d.dp // d.ep} ranks holding the same experts (edp) on {d.edp_link}",) if d.ep > 1 else ()),
    )


# -- pp > 1: the pipeline with the TP layout's costs ----------------------------


def _memory_binds(decision: PipelineDecision | None) -> bool:
    """Whether a pipeline search shows memory binding: a candidate that fits recomputes or offloads
    (any, not only its best: the split stream, holding less, may make another group the fastest). There
    (and where nothing fit) the layout with the residual stream split along the sequence
    (passes/tp/sequence.py) is weighed too; elsewhere the plan is plain Megatron tensor parallelism,
    nothing split along the sequence (sequence parallelism's norms and dropouts at 1/t are not weighed
    there: one more ILP and pipeline search per tp). Branch and bound's groups cut under a cap say the
    same of themselves (``PrunedCandidate.binds``)."""
    return decision is not None and any(c.fits and binds_memory(c) for c in decision.candidates)


def _from_pipeline(d: PipelineDecision, profile: ModelProfile, cluster: ClusterSpec, request: TrainingRequest,
                   tp: int, layouts: _Layouts, sp: bool = False, pins: Pins = Pins()) -> Decision:
    best = d.best
    c = best.cost
    assert c is not None
    choice = layouts.choice(best.micro_batch_size, tp, sp and tp > 1)
    node_stage = stage_of_nodes(profile, best.cuts) if best.pp > 1 else {n: 0 for n in profile.graph.nodes}
    dp_key = "dp_all_reduce" if best.zero_stage == 0 else f"zero{best.zero_stage}_collectives"
    comm = {k: v for k, v in (("pp_send_recv", c.p2p_s), ("pp_bubble", c.bubble_s),
                              (dp_key, c.dp_all_reduce_s), ("tied_all_reduce", c.tied_all_reduce_s)) if v > 0}
    compute_s, traffic = c.compute_s, {dp_key: best.dp_traffic_bytes} if best.dp_traffic_bytes else {}
    if best.ep > 1:  # the slowest slot's all-to-alls and the slowest tail's edp all-reduce, told apart
        compute_s, comm, traffic = expert_parts(compute_s, comm, traffic, dp_key, stage_expert_steps(
            profile.graph, node_stage, [st.recompute == FULL for st in best.stages], ep=best.ep, dp=best.dp, tp=tp,
            micro_batch=best.micro_batch_size, batch=profile.batch_size, grad_accum=best.micro_batches,
            precision=request.precision, reduce_dtype=request.reduce_dtype, captured_dtype=profile.param_dtype,
            cluster=cluster, load=expert_load(pins.expert_load)), c, best.pp)
    cp, strategy = pins.cp or 1, RING
    if cp > 1:  # the slowest rank's exchanges around attention, told apart from its compute (passes/context.py)
        costs = context_costs(lambda mb: layouts.node_costs(mb, tp, sp and tp > 1), layouts.profile, request, cluster,
                              cp, tp=tp, pinned=pins.cp_attention)(best.micro_batch_size)
        strategy = costs.cp_attention
        per_stage = stage_context_s(costs, node_stage, [st.recompute != NONE for st in best.stages])
        compute_s, comm = context_parts(compute_s, comm, per_stage, strategy, c.slowest_stage, best.pp,
                                        best.micro_batches)
        calls = context_calls(layouts.profile, request, cluster, cp=cp, tp=tp, micro_batch=best.micro_batch_size,
                              strategy=strategy)
        traffic = {**traffic, CP_KEYS[strategy]: context_traffic(calls, cp, best.micro_batches)}
    heaviest = max(best.stages, key=lambda s: s.memory.total)
    return Decision(
        mesh=Mesh(dp=best.dp, tp=tp, pp=best.pp, ep=best.ep, cp=cp), micro_batch_size=best.micro_batch_size,
        grad_accum_steps=best.micro_batches, schedule=best.schedule, zero_stage=best.zero_stage, choice=choice,
        node_stage=node_stage, stages=d.plan_stages(), step_s=best.step_s, compute_s=compute_s, comm_s=comm,
        optimizer_s=c.optimizer_s, traffic_bytes=traffic,
        memory=heaviest.memory, buckets=(), bucket_bytes=DEFAULT_BUCKET_BYTES,
        alternatives=tuple(_pipeline_alternative(x, x is best, d.reasons[x.key], cp) for x in _diverse(d.candidates)),
        method=f"exact cut DP over layer boundaries x (p, m, schedule) enumeration; TP ILP per (tp={tp}, micro-batch)",
        status="OPTIMAL", gap=0.0, candidates=len(d.candidates), seconds=d.seconds,
        notes=(f"{d.solves} cut programs solved", f"bubble {c.bubble_s / best.step_s:.1%} of the step"),
        chunks=best.chunks, offload=best.offload, sequence_parallel=sp and tp > 1, cp_attention=strategy,
    )


def _pipeline_alternative(c: PipelineCandidate, chosen: bool, reason: str, cp: int = 1) -> Alternative:
    return Alternative(mesh=Mesh(dp=c.dp, tp=c.tp, pp=c.pp, ep=c.ep, cp=cp), micro_batch_size=c.micro_batch_size,
                       grad_accum_steps=c.micro_batches, zero_stage=c.zero_stage,
                       step_time_s=c.step_s if c.fits else None,
                       memory_bytes=c.memory.total, fits=c.fits, chosen=chosen, reason=reason)


def _diverse(candidates: Sequence[PipelineCandidate], limit: int = 16) -> list[PipelineCandidate]:
    """The chosen candidate, the fastest of each (pp, ZeRO stage), the nearest miss of each ZeRO
    stage, then the rest in order (``candidates`` is fitting-fastest-first, then misses)."""
    return _spread(candidates, lambda c: c.fits, lambda c: (c.pp, c.tp, c.zero_stage), lambda c: c.zero_stage, limit)


def _spread(items: Sequence[Any], fits: Any, family: Any, stage: Any, limit: int) -> list[Any]:
    """``items`` ordered best first: the first, one per family among the fitting, one per ZeRO stage
    among the misses, then the rest, at most ``limit``."""
    if not items:
        return []
    picked = [items[0]]
    seen_family = {family(items[0])}
    seen_stage: set[int] = set()
    for x in items[1:]:
        if fits(x) and family(x) not in seen_family:
            seen_family.add(family(x))
            picked.append(x)
        elif not fits(x) and stage(x) not in seen_stage:
            seen_stage.add(stage(x))
            picked.append(x)
    picked += [x for x in items if x not in picked]
    return sorted(picked[:limit], key=lambda x: (x is not items[0], not fits(x), items.index(x)))


def _merge_alternatives(options: Sequence[Decision], limit: int = 24) -> tuple[Alternative, ...]:
    """The chosen plan first, then each family's alternatives; the other families' winners say why they lost.
    Every (pp, tp, ep, ZeRO stage) family that fits keeps its fastest, every ZeRO stage its nearest miss."""
    best = options[0]
    out: list[Alternative] = []
    for i, o in enumerate(options):
        for a in o.alternatives:
            if a.chosen and i > 0:
                slower = a.step_time_s / best.step_s if a.step_time_s else float("inf")
                a = replace(a, chosen=False,
                            reason=f"{slower:.2f}x slower than {best.mesh} ({a.reason.removeprefix('chosen: ')})")
            out.append(a)
    seen: set[tuple[Any, ...]] = set()
    unique = []
    for a in sorted(out, key=lambda a: (not a.chosen, not a.fits, a.step_time_s or float("inf"))):
        key = (a.mesh, a.micro_batch_size, a.grad_accum_steps, a.zero_stage)
        if key not in seen:
            seen.add(key)
            unique.append(a)
    picked = _spread(unique, lambda a: a.fits, lambda a: (a.mesh.pp, a.mesh.tp, a.mesh.ep, a.mesh.cp, a.zero_stage),
                     lambda a: a.zero_stage, limit)
    # a plan splitting its sequences lists the fastest one that does not, whatever the families above it
    whole = [a for a in unique if a.fits and a.mesh.cp == 1]
    if best.mesh.cp > 1 and whole and whole[0] not in picked:
        picked.append(whole[0])
    return tuple(picked)
