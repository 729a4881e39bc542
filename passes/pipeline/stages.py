"""The pipeline axis: where to cut the model into stages, how many micro-batches, which schedule.

Reads a ``ModelProfile``'s annotated graph (``kind``, ``inputs``, ``out_bytes``,
``dtypes``, ``flops_fwd``, ``flops_bwd``, ``requires_grad``, ``saved_bytes``,
``param_name``, ``layer``, ``module``, ``depends_on_input``), a ``ClusterSpec``, a
``TrainingRequest`` and ``Pins``. Writes nothing on the graph. Returns a
``PipelineDecision``: stages count p, micro-batches m, schedule and cuts, the
stages' time and memory, and every alternative weighed with why it lost.

This module enumerates (p, dp, micro-batch, schedule, shared-parameter policy) and, per
group, the ZeRO stages of passes/dp/zero.zero_stages (the first that fits is kept), and
joins the parts, each with its own home: the order, the allowed boundaries and the
per-node costs (recomputation's too) in passes/pipeline/costs.py; the exact cut DP in
passes/pipeline/cuts.py; the branch and bound in passes/pipeline/bounds.py; why each
candidate lost in passes/pipeline/decision.py. The search space, the dynamic program and
its cost, ZeRO, recomputation per stage and shared parameters: docs/cost-model.md,
"The pipeline search".
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from partita.core.buckets import unit_of
from partita.core.cluster import ClusterSpec, Link
from partita.core.errors import InfeasibleError, PartitaError
from partita.core.experts import expert_load
from partita.core.mesh import Mesh
from partita.core.optimizers import NO_OFFLOAD, OFFLOAD_OPTIMIZER
from partita.core.pins import Pins, TrainingRequest
from partita.core.precision import wire_bytes
from partita.core.recompute import NONE
from partita.core.schedule import SCHEDULES, chunk_counts, chunk_problem, in_flight
from partita.passes.context import context_costs, context_profile
from partita.passes.cost_model import (
    collective_time,
    offloaded_state,
    pipeline_step,
    state_bytes_per_param,
    zero_step_comm,
)
from partita.passes.dp.buckets import gradient_buckets
from partita.passes.dp.zero import STRATEGY_NAMES, zero_stages
from partita.passes.experts import expert_costs, expert_links, expert_optimizer_time
from partita.passes.explain import gb
from partita.passes.peak_memory import stage_buffers
from partita.passes.pipeline.bounds import AllPruned, PipelineBound, PrunedCandidate, cached_costs, cut_windows
from partita.passes.pipeline.costs import NodeCosts, Recompute, node_costs, pipeline_order, recompute_costs
from partita.passes.pipeline.cuts import Partition, StageSetup, any_cuts_fit, solve_cuts
from partita.passes.pipeline.decision import (
    PipelineCandidate,
    PipelineDecision,
    PipelineStage,
    infeasible_error,
    loss_reason,
    stage_modules,
)
from partita.passes.profile import ModelProfile
from partita.passes.space import pipeline_groups

INF = math.inf


def stage_links(cluster: ClusterSpec, pp: int, dp: int, tp: int, chunks: int = 1) -> tuple[Link, ...]:
    """The link between (virtual) stage s and s + 1 of a (pp, dp, tp) mesh (``ClusterSpec.stage_links``)."""
    return cluster.stage_links(Mesh(dp=dp, tp=tp, pp=pp), chunks)


def stage_of_nodes(profile: ModelProfile, cuts: Sequence[str]) -> dict[str, int]:
    """node -> stage for ``cuts`` (the last node of every stage but the last), over ``pipeline_order``.

    The one mechanism from a cut list to a node -> stage map (``split_module``'s
    ``split_callback``); a shared parameter's placeholder goes with its first user,
    and its other users' stages hold a copy (``PipelineDecision.shared``).
    """
    order = pipeline_order(profile.graph)
    at = {n: i for i, n in enumerate(order)}
    missing = [c for c in cuts if c not in at]
    if missing:
        raise ValueError(f"cut node(s) {', '.join(missing)} are not in the graph of {profile.name}")
    ends = [at[c] + 1 for c in cuts]
    if ends != sorted(set(ends)) or (ends and ends[-1] >= len(order)):
        raise ValueError(f"cuts {list(cuts)} are not strictly increasing positions before the last node")
    return {n: bisect.bisect_right(ends, i) for i, n in enumerate(order)}


def choose_pipeline(
    profile: ModelProfile,
    cluster: ClusterSpec,
    request: TrainingRequest,
    pins: Pins = Pins(),
    *,
    devices_per_stage: int = 1,
    schedules: Sequence[str] = SCHEDULES,
    costs: Callable[[int], NodeCosts] | None = None,
    floor_costs: Callable[[int], NodeCosts] | None = None,
    prune: bool = False,
    bound: float = INF,
    probe: bool = False,
) -> PipelineDecision:
    """Decide p, m, the schedule and the cuts jointly (docs/cost-model.md, "The pipeline search").

    Every device is used: pp x dp x devices_per_stage = devices (``pins.world_size``
    or the cluster's). ``costs(micro_batch)`` replaces the profile's per-node costs
    (a tensor-parallel solve at ``devices_per_stage``). ``schedules`` narrows the
    schedules weighed (a runtime that runs only GPipe).

    ``prune`` turns on branch and bound (``PipelineBound``): (p, micro-batch) groups
    are visited by their lower bound, and a group whose bound exceeds the fastest
    step found so far (or ``bound``, a step found elsewhere) is recorded in
    ``pruned`` without building its costs or cutting it; so is one that no cuts
    could fit even at ``floor_costs(micro_batch)`` (per-node costs never above
    ``costs``'; the profile's at tp = 1, which are exact there, by default). A ZeRO
    stage that no cuts fit is found by a greedy pass (``any_cuts_fit``) instead of a
    failed DP, and the least-memory DP of a group that fits nowhere is run only when
    nothing fits at all. The best candidate is the exhaustive search's: nothing
    pruned could have been faster. When everything here was pruned against an
    outside ``bound``, ``AllPruned`` carries the record. ``probe`` stops at the first group (the most
    promising first) with a candidate that fits: a bound to search the others under.
    """
    search = _CutSearch(profile, cluster, request, pins, devices_per_stage=devices_per_stage, schedules=schedules,
                        costs=costs, floor_costs=floor_costs, prune=prune, bound=bound)
    for index, group in search.visit_order():
        search.weigh_group(index, *group)
        if probe and any(c.fits for _, c in search.found):
            break
    if not probe:
        search.more_chunks()
    if search.bounder is not None and not any(c.fits for _, c in search.found):
        if probe or (bound < INF and (search.found or search.pruned or search.unfit)):
            raise AllPruned(tuple(search.pruned) + tuple(search.unfit_records()))
        # nothing fits anywhere: the exhaustive search names the least-memory plan
        return choose_pipeline(profile, cluster, request, pins, devices_per_stage=devices_per_stage,
                               schedules=search.schedules, costs=costs)
    return search.decision()


class _CutSearch:
    """One pipeline search's state: its settings, the per-micro-batch costs built so far, and
    what it found (candidates by group index), pruned and deferred (groups no cuts fit)."""

    def __init__(self, profile: ModelProfile, cluster: ClusterSpec, request: TrainingRequest, pins: Pins, *,
                 devices_per_stage: int, schedules: Sequence[str], costs: Callable[[int], NodeCosts] | None,
                 floor_costs: Callable[[int], NodeCosts] | None, prune: bool, bound: float) -> None:
        self.t0 = time.perf_counter()
        self.cluster, self.request, self.pins, self.bound = cluster, request, pins, bound
        self.devices = pins.world_size or cluster.world_size
        self.tp = tp = pins.tp or devices_per_stage
        bad = [s for s in schedules if s not in SCHEDULES]
        if bad or not schedules:
            raise PartitaError(f"schedule(s) {bad or '(none)'} are not among {', '.join(SCHEDULES)}",
                               hint="pass --schedule 1f1b or gpipe")
        # a pinned schedule: only pipelines (p > 1) that run it
        self.schedules = (pins.schedule,) if pins.schedule is not None else tuple(schedules)
        self.state = state_bytes_per_param(request.precision, request.optimizer, inference=request.inference)
        cp = pins.cp or 1
        profile = context_profile(profile, cp)  # one cp rank's share of every sequence (passes/context.py)
        self.step_buffers = stage_buffers(profile, request, tp)
        self.build = costs or (lambda mb: node_costs(profile, cluster, request, mb, tp=tp))
        if floor_costs is None and costs is None:
            floor_costs = self.build
        if (pins.ep or 1) > 1:  # a rank's slices of the experts, the all-to-alls in the slots (passes/experts.py)
            load = expert_load(pins.expert_load)  # routing: the slowest expert rank's rows
            self.build, floor_costs = (f and expert_costs(f, profile.graph, pins.ep, batch=profile.batch_size,
                                                          precision=request.precision, cluster=cluster, tp=tp,
                                                          captured_dtype=profile.param_dtype,
                                                          inference=request.inference, load=load)
                                       for f in (self.build, floor_costs))
        if cp > 1:  # each attention core's exchanges over the cp group in its slots (passes/context.py)
            self.build = context_costs(self.build, profile, request, cluster, cp, tp=tp, pinned=pins.cp_attention)
        self.cache: dict[int, NodeCosts] = {}
        self.groups = pipeline_groups(self.devices, tp, request.global_batch, pins)  # (p, dp, mb size, mbs)
        self.weigh_recompute = not request.inference and pins.recompute != NONE
        # where the optimizer's state may live, in the order weighed: the host only after the device, and
        # only where the device is not the host (on CPU processes a pinned offload runs, frees nothing)
        self.offloads = (pins.offload,) if pins.offload is not None else (NO_OFFLOAD, OFFLOAD_OPTIMIZER) \
            if cluster.host_bandwidth > 0 and cluster.device != "cpu" and not request.inference else (NO_OFFLOAD,)
        self.recompute_cache: dict[int, Recompute | None] = {}
        host = offloaded_state(self.state, OFFLOAD_OPTIMIZER, request.precision)[1] \
            if OFFLOAD_OPTIMIZER in self.offloads else None
        self.bounder = PipelineBound(cluster, request, self.state, tp, floor_costs,
                                     chunks=max(chunk_counts(s)[0] for s in self.schedules), host=host) \
            if prune and floor_costs else None
        self.found: list[tuple[int, PipelineCandidate]] = []  # (group index, candidate)
        self.pruned: list[PrunedCandidate] = []
        self.unfit: list[tuple[Partition, int, int]] = []  # (least-memory partition, dp, mb): the DP deferred
        self.solves = 0
        self.empty_chunks: tuple[str, int, int, int] | None = None  # a chunked schedule left out: too few parts

    def zero_options(self, p: int, dp: int) -> tuple[int, ...]:
        """The ZeRO stages weighed at (p, dp): not ZeRO-3 under pinned recomputation (docs/cost-model.md,
        "Activation recomputation")."""
        stages = zero_stages(self.pins.zero_stage, dp, self.request.inference, tp=self.tp, pp=p)
        return tuple(z for z in stages if z < 3) if self.pins.recomputes else stages

    def visit_order(self) -> list[tuple[int, tuple[int, int, int, int]]]:
        """The (p, dp, micro-batch size, micro-batches) groups by index; with branch and bound the most
        promising first, so that the incumbent falls early."""
        order = list(enumerate(self.groups))
        if self.bounder is not None:
            order.sort(key=lambda ig: self.bounder.step(*ig[1], self.zero_options(ig[1][0], ig[1][1])))
        return order

    def with_recompute(self, c: NodeCosts) -> Recompute | None:
        return recompute_costs(c, pin=self.pins.recompute) if self.weigh_recompute else None

    def weigh_group(self, index: int, p: int, dp: int, mb: int, m: int) -> None:
        """Every schedule, shared-parameter policy and ZeRO stage of one group, unless its bound prunes it."""
        zero_options = self.zero_options(p, dp)
        if not zero_options:
            return
        if self.bounder is not None and self._pruned(p, dp, mb, m, zero_options):
            return
        c = cached_costs(self.cache, self.build, mb)
        if p > len(c.boundaries) + 1:
            return
        if mb not in self.recompute_cache:
            self.recompute_cache[mb] = self.with_recompute(c)
        for schedule, v, zs in self._schedules(p, m, zero_options, c):
            for policy, forbid in _shared_policies(c, p * v):
                self._weigh_zero_stages(index, c, self._setups(p, m, schedule, v, dp, zs), mb, policy, forbid)

    def _schedules(self, p: int, m: int, zero_options: tuple[int, ...], c: NodeCosts
                   ) -> list[tuple[str, int, tuple[int, ...]]]:
        """(schedule, chunks per rank, ZeRO stages) weighed at p stages of m micro-batches: a chunked
        schedule at its fewest chunks (more: ``more_chunks``) where its chunks run (core/schedule.py
        ``chunk_problem``), there are boundaries for p v stages, and ZeRO is off (runtime/compose.py
        runs it with one chunk per rank only)."""
        out = []
        for schedule in (("none",) if p == 1 else self.schedules):
            v = chunk_counts(schedule)[0]
            # every chunk holds parameters of its own (passes/pipeline/cuts.py ``Partition.empty``)
            held = _holding(c) if v > 1 else 0
            if v > 1 and p * v > held and not chunk_problem(schedule, p, v, m):
                self.empty_chunks = (schedule, p, v, held)
            if v > 1 and not _chunks_run(schedule, p, v, m, c, held):
                continue
            zs = zero_options if v == 1 else tuple(z for z in zero_options if z == 0)
            if zs:
                out.append((schedule, v, zs))
        return out

    def more_chunks(self) -> None:
        """The fastest candidate's group cut again at every chunk count above the fewest (core/schedule.py
        ``chunk_counts``) of each chunked schedule weighed, without ZeRO, as far as the model has parts:
        the bubble falls as 1 / v and the sends grow as v, so the count is weighed once the rest of the
        plan is settled (every count on every group would multiply the cut programs: 175B's search went
        from 8 to 119 s)."""
        fitting = [(i, c) for i, c in self.found if c.fits]
        if not fitting:
            return
        index, _ = min(fitting, key=lambda ic: (ic[1].step_s, ic[1].memory.total, ic[1].schedule != "1f1b",
                                                 ic[1].pp))
        p, dp, mb, m = self.groups[index]
        c = self.cache[mb]
        if p == 1 or 0 not in self.zero_options(p, dp):
            return
        held = _holding(c)
        for schedule in self.schedules:
            for v in chunk_counts(schedule)[1:]:
                if not _chunks_run(schedule, p, v, m, c, held):
                    break  # more chunks have fewer parts each: none runs either
                for policy, forbid in _shared_policies(c, p * v):
                    self._weigh_zero_stages(index, c, self._setups(p, m, schedule, v, dp, (0,)), mb, policy, forbid)

    def _setups(self, p: int, m: int, schedule: str, v: int, dp: int, zs: tuple[int, ...]) -> list[StageSetup]:
        """The cut problems of p ranks x v chunks, in the order they are weighed: each ZeRO stage of
        ``zs`` with the optimizer's state on the device, then (where offload is weighed) on the host;
        p v virtual stages, each with 1/v of a device."""
        links = stage_links(self.cluster, p, dp, self.tp, v)
        return [StageSetup(p * v, m, schedule, links, self.cluster.usable_memory // v, self.state, z, dp,
                           self.step_buffers(z, dp, m), chunks=v, offload=offload,
                           host=offloaded_state(self.state, offload, self.request.precision)[1],
                           shared_host=self.cluster.device == "cpu")
                for offload in self.offloads for z in zs]

    def _pruned(self, p: int, dp: int, mb: int, m: int, zero_options: tuple[int, ...]) -> bool:
        """Record and skip a group whose lower bound loses to the best step so far, or that no cuts
        fit even at the floor costs."""
        lower = self.bounder.step(p, dp, mb, m, zero_options)
        best_s = self.best_s()
        if lower > best_s:
            self.pruned.append(PrunedCandidate(p, dp, self.tp, mb, m, zero_options[0], lower, False,
                                               f"not solved: lower bound {lower:.4g} s > best {best_s:.4g} s "
                                               f"({self.bounder.explain(p, dp, mb, m, zero_options)})"))
            return True
        floor = self.bounder.floor(mb)
        if p > len(floor.boundaries) + 1:
            return True
        for schedule, v, zs in self._schedules(p, m, zero_options, floor):
            for _, forbid in _shared_policies(floor, p * v):
                for setup in self._setups(p, m, schedule, v, dp, zs):
                    if any_cuts_fit(self.bounder.partition(mb, setup, forbid, self.with_recompute)):
                        return False
        self.pruned.append(PrunedCandidate(
            p, dp, self.tp, mb, m, zero_options[-1], lower, True,
            f"does not fit: no cuts keep every stage within {gb(self.cluster.usable_memory)} even at "
            f"1/{self.tp} of every layer's state and activations "
            f"({', '.join(STRATEGY_NAMES[z] for z in zero_options)})"))
        return True

    def best_s(self) -> float:
        """The fastest step found so far, here or elsewhere (``bound``): what a group must beat."""
        return min([self.bound] + [c.step_s for _, c in self.found])

    def slot_cap(self, setup: StageSetup, mb: int) -> float:
        """The slowest stage's slot at or above which cuts under ``setup`` cannot beat ``best_s``
        (``PipelineBound.slot_cap``); infinite without branch and bound."""
        if self.bounder is None:
            return INF
        return self.bounder.slot_cap(setup, mb, self.best_s())

    def _weigh_zero_stages(self, index: int, c: NodeCosts, setups: list[StageSetup], mb: int, policy: str,
                           forbid: tuple[int, ...]) -> None:
        """The ZeRO stages of one (group, schedule, policy) in increasing order, until one fits: larger
        stages only add traffic (passes/dp/zero.py), unless the fit recomputes, where a larger
        stage, holding less state, might not need to."""
        tp, request = self.tp, self.request
        missed: list[Partition] = []  # smaller ZeRO stages that did not fit
        fitted = False  # some stage fitted, but lost to the best found (``slot_cap``)
        best_here = INF  # this group's best fitting step so far (over the ZeRO stages)
        for setup in setups:
            p, m, dp, z = setup.stages, setup.micro_batches, setup.dp, setup.zero_stage
            if best_here < INF and self.bounder is not None \
                    and sum(self.bounder.parts(p, dp, mb, m, z)) > min(best_here, self.bound):
                return  # past a fit that recomputes: this stage's lower bound already loses to it
            part = Partition(c, setup, self.cluster, forbid=forbid, recompute=self.recompute_cache[mb])
            if self.bounder is not None and not any_cuts_fit(part):
                missed.append(part)
                continue
            cap = self.slot_cap(setup, mb)
            value, bounds = INF, ()
            windows = cut_windows(part, cap) if cap < INF else None
            if cap == INF or windows is not None:
                value, bounds = solve_cuts(part, cap=cap, windows=windows)
                self.solves += 1
            if value == INF and cap < INF:  # cuts fit (``any_cuts_fit``), but none beat the best
                # whether these cuts' fit would recompute, they were not finished to say: here, that no
                # cuts fit without recomputation says so (and decides as ``binds_memory`` would)
                recomputes = part.rc is not None and (
                    part.rc.forced or not any_cuts_fit(Partition(c, setup, self.cluster, forbid=forbid)))
                self.pruned.append(replace(self.bounder.capped(setup, dp, tp, mb, cap, self.best_s()),
                                           binds=recomputes or setup.offload != NO_OFFLOAD))
                missed, fitted = [], True
                if not recomputes or part.rc.forced:
                    return  # a larger ZeRO stage is weighed after a fit that recomputes (and not by pin)
                continue  # every fit recomputes: a larger stage, holding less state, might not
            if value == INF:
                missed.append(part)
                continue
            # the stages that did not fit, costed at the cuts that fit one larger
            self.found += [(index, replace(_candidate(x, bounds, dp, tp, mb, policy, False, request), cut_for=z))
                           for x in missed]
            missed = []
            candidate = _candidate(part, bounds, dp, tp, mb, policy, True, request)
            self.found.append((index, candidate))
            best_here = min(best_here, candidate.step_s)
            if part.rc is None or part.rc.forced or all(st.recompute == NONE for st in candidate.stages):
                return
        if best_here < INF or fitted or not missed:  # fitted, or no ZeRO stage the runtime executes here
            return
        part = missed[-1]  # the least memory: the largest stage weighed, least-memory cuts
        if self.bounder is not None:
            self.unfit.append((part, part.setup.dp, mb))
            return
        _, bounds = solve_cuts(part, part.memory_cost)
        self.solves += 1
        if bounds:
            self.found.append((index, _candidate(part, bounds, part.setup.dp, tp, mb, policy, False, request)))

    def unfit_records(self) -> list[PrunedCandidate]:
        return [_unfit_record(part, dp, self.tp, mb, self.cluster) for part, dp, mb in self.unfit]

    def decision(self) -> PipelineDecision:
        """The fastest fitting candidate, the others in order, and why each lost."""
        self.pruned += self.unfit_records()
        self.found.sort(key=lambda gc: gc[0])  # enumeration order, whatever order the groups were visited in
        candidates = [c for _, c in self.found]
        if not candidates and self.empty_chunks is not None and self.pins.schedule is not None:
            schedule, p, v, held = self.empty_chunks
            raise InfeasibleError(
                f"--schedule {schedule} cuts {p} pipeline ranks x {v} chunks = {p * v} model parts, each holding "
                f"parameters of its own, but the model holds parameters at {held} places of its graph",
                hint="pin --schedule 1f1b (one part per rank), or fewer --pp")
        if not candidates:
            raise PartitaError(
                f"no pipeline split matches: {self.devices} devices, {self.tp} per stage, global batch "
                f"{self.request.global_batch}, pins ({self.pins.describe()})",
                hint="the batch must divide over the data-parallel ranks; pp must divide devices / tp",
            )
        fitting = sorted((c for c in candidates if c.fits),
                         key=lambda c: (c.step_s, c.memory.total, c.schedule != "1f1b", c.pp))
        if not fitting:
            raise infeasible_error(candidates, self.cluster)
        best = fitting[0]
        reasons = {c.key: loss_reason(c, best, self.cluster) for c in candidates}
        ordered = fitting + sorted((c for c in candidates if not c.fits), key=lambda c: c.memory.total)
        any_costs = next(iter(self.cache.values()))
        return PipelineDecision(best, tuple(ordered), reasons, any_costs.order, any_costs.boundaries,
                                any_costs.shared, self.solves, time.perf_counter() - self.t0, tuple(self.pruned))


def _unfit_record(part: Partition, dp: int, tp: int, mb: int, cluster: ClusterSpec) -> PrunedCandidate:
    st = part.setup
    return PrunedCandidate(st.stages, dp, tp, mb, st.micro_batches, st.zero_stage, INF, True,
                           f"does not fit: no cuts keep every stage within {gb(cluster.usable_memory)} "
                           f"({st.schedule}, up to {STRATEGY_NAMES[st.zero_stage]}); least-memory cuts not searched",
                           st.schedule)


def _holding(c: NodeCosts) -> int:
    """Positions of the order that hold a parameter (their own, a shared one's user, an expert slice): a
    chunked schedule cuts no more chunks than these."""
    held = {i for i, n in enumerate(c.param_numel) if n} | {u for sp in c.shared for u in sp.users}
    return len(held | {i for i, n in enumerate(c.expert_numel) if n})


def _chunks_run(schedule: str, p: int, v: int, m: int, c: NodeCosts, held: int) -> bool:
    """Whether p ranks x v chunks of ``schedule`` run m micro-batches (core/schedule.py ``chunk_problem``)
    on a model with p v parts: boundaries for them, each holding parameters (``held``: ``_holding(c)``)."""
    return not chunk_problem(schedule, p, v, m) and p * v <= min(len(c.boundaries) + 1, held)


def _shared_policies(c: NodeCosts, p: int) -> list[tuple[str, tuple[int, ...]]]:
    if not c.shared or p == 1:
        return [("", ())]
    forbid = tuple(k for k in c.boundaries if any(sp.users[0] < k <= sp.users[-1] for sp in c.shared))
    return [("kept together", forbid), ("split", ())]


def _candidate(part: Partition, bounds: tuple[int, ...], dp: int, tp: int, mb: int, policy: str, fits: bool,
               request: TrainingRequest) -> PipelineCandidate:
    c, setup, cluster = part.costs, part.setup, part.cluster
    p, v = setup.stages, setup.chunks  # p counts virtual stages: p // v ranks, stage s on rank s mod (p // v)
    ranks = p // v
    grad_elem = 0 if request.inference else max(1, int(setup.state.grads))
    stages, dp_s, opt_s, dp_bytes = [], [], [], []
    for s, (j, k) in enumerate(zip(bounds, bounds[1:])):
        mem = part.memory(j, k, s)
        held = [i for i in range(j, k) if c.param_numel[i]]
        shared = part.shared_in(j, k)
        numels = [c.param_numel[i] for i in held] + [sp.numel for sp in shared]
        # ZeRO-3's units: a repeated layer's parameters one bucket (core/buckets.py), shared ones the root's
        units = [unit_of(c.modules[i], c.layers) for i in held] + [""] * len(shared) \
            if setup.zero_stage == 3 and c.modules else None
        buckets = gradient_buckets(numels, grad_elem, units=units) if grad_elem and dp > 1 else []
        link = cluster.link_for_group(dp, stride=tp)
        wire = dict(elem_bytes=grad_elem or 2, reduce_dtype=request.reduce_dtype)
        zc = zero_step_comm(setup.zero_stage, buckets, dp, setup.micro_batches, link, **wire)
        # a rank's expert slices (passes/experts.py): out of ZeRO, averaged over the dp / ep ranks holding them
        experts = [c.expert_numel[i] for i in range(j, k) if c.expert_numel and c.expert_numel[i]]
        edp = zero_step_comm(0, gradient_buckets(experts, grad_elem) if grad_elem else [], dp // c.ep,
                             setup.micro_batches, expert_links(cluster, dp=dp, tp=tp, ep=c.ep)[1], **wire)
        dp_s.append(zc.total_s + edp.total_s)
        dp_bytes.append(zc.total_bytes)
        opt_s.append(0.0 if request.inference else setup.optimizer_time(sum(numels), cluster)
                     + expert_optimizer_time(sum(experts), setup.state, cluster))
        stages.append(PipelineStage(
            index=s, start=j, stop=k, first_node=c.order[j], last_node=c.order[k - 1],
            params=sum(numels) + sum(experts),
            forward_s=part.fwd[k] - part.fwd[j], backward_s=part.compute_s(j, k, s) - (part.fwd[k] - part.fwd[j]),
            p2p_s=part.p2p(j, k, s), slot_s=part.slot(j, k, s), memory=mem,
            in_flight=in_flight(setup.schedule, s, p, setup.micro_batches, v),
            send_bytes=c.send_bytes[k] if s < p - 1 else 0, ranks=Mesh(dp=dp, tp=tp, pp=ranks).stage_ranks(s % ranks),
            modules=stage_modules(part.costs, j, k), recompute=part.recomputes(j, k, s),
        ))
    if v > 1:  # a device holds its rank's chunks: their memory together, against the whole device
        segments = list(zip(bounds, bounds[1:], range(p)))
        memory = [part.rank_memory(segments[r::ranks], cluster.usable_memory) for r in range(ranks)]
        stages = [replace(st, memory=memory[st.index % ranks]) for st in stages]
    tied = 0.0
    for sp in c.shared:
        holders = sorted({bisect.bisect_right(bounds[1:-1], u) % ranks for u in sp.users})  # by rank
        if len(holders) > 1 and grad_elem:
            span = stage_links(cluster, ranks, dp, tp)[holders[0]:holders[-1]]
            link = min(span, key=lambda ln: ln.bandwidth)
            tied += collective_time("all_reduce", sp.numel * wire_bytes("grads", grad_elem, request.reduce_dtype),
                                    len(holders), link)
    cost = pipeline_step(
        compute_s=[st.forward_s + st.backward_s for st in stages], p2p_s=[st.p2p_s for st in stages],
        micro_batches=setup.micro_batches, dp_all_reduce_s=dp_s, optimizer_s=opt_s, tied_all_reduce_s=tied,
        cluster=cluster, chunks=v,
    ) if fits else None
    return PipelineCandidate(
        pp=ranks, chunks=v, dp=dp, tp=tp, micro_batch_size=mb, micro_batches=setup.micro_batches,
        schedule=setup.schedule,
        shared_policy=policy, cuts=tuple(c.order[k - 1] for k in bounds[1:-1]), stages=tuple(stages), cost=cost,
        memory=max((st.memory for st in stages), key=lambda mm: mm.total), zero_stage=setup.zero_stage,
        dp_traffic_bytes=max(dp_bytes, default=0), offload=setup.offload, ep=c.ep,
    )
