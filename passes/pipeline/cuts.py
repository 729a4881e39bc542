"""The exact cut solver: a bottleneck partition of the pipeline order into p stages.

Over the K allowed boundaries of a ``NodeCosts`` (passes/pipeline/costs.py),

    f[s][k] = min_{j < k} max(f[s-1][j], slot(j, k, s))   subject to mem(j, k, s) <= budget

where slot is a stage's forward + backward + overhead + sends per micro-batch
(cost_model.stage_slot_time) and mem its model state plus the activations in
flight under the schedule (core/schedule.py ``in_flight``). ``Partition`` gives
every segment's time and memory in O(1) from prefix sums (plus one bisect per
shared parameter) and decides per segment how the stage recomputes (core/recompute.py);
``solve_cuts`` runs the dynamic program; ``any_cuts_fit`` says by one greedy pass
whether any cuts fit memory at all.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from partita.core.cluster import ClusterSpec, Link
from partita.core.optimizers import NO_OFFLOAD
from partita.core.plans.plan import MemoryBreakdown
from partita.core.recompute import NONE
from partita.core.schedule import in_flight, sends_held
from partita.passes.cost_model import (
    StateBytes,
    model_state_memory,
    offload_step_time,
    p2p_time,
    sharded_state,
    stage_slot_time,
    zero_optimizer_time,
)
from partita.passes.experts import split_state
from partita.passes.peak_memory import StepBuffers, peak_memory, peak_of
from partita.passes.pipeline.costs import NodeCosts, Recompute, SharedParam
from partita.passes.pipeline.ranges import first_turned

INF = math.inf


# -- the partition problem -------------------------------------------------------


@dataclass(frozen=True)
class StageSetup:
    """What is fixed while cuts are searched: stage count, schedule, links, budget."""

    stages: int
    micro_batches: int
    schedule: str
    links: tuple[Link, ...]  # links[s]: between stage s and s + 1
    capacity: int  # usable bytes per device
    state: StateBytes
    zero_stage: int = 0  # ZeRO over each stage's dp group
    dp: int = 1
    # training: the runtime's buffers of a stage holding this many parameter elements
    # (peak_memory.step_buffers); None for inference, whose ``live_bytes`` are its activations
    buffers: Callable[[int], StepBuffers] | None = None
    # virtual stages per rank (interleaved 1F1B): ``stages`` counts them all, ``links`` joins
    # them (ClusterSpec.stage_links), and ``capacity`` is each one's share of a device's bytes
    chunks: int = 1
    offload: str = NO_OFFLOAD  # the optimizer's state and masters in host memory (core/optimizers.py)
    host: float = 0.0  # bytes per parameter the host then holds (cost_model.offloaded_state), unsharded
    shared_host: bool = False  # host and device are one memory (a CPU cluster): the host's bytes are the device's

    @property
    def held(self) -> StateBytes:
        """Bytes per parameter one device holds: ``state`` sharded by ZeRO over the dp group, less
        what offload keeps on the host, unless the host's memory is the device's."""
        held = sharded_state(self.state, self.zero_stage, self.dp)
        if self.offload == NO_OFFLOAD:
            return held
        return replace(held, optimizer=self.host_share if self.shared_host else 0.0)

    @property
    def host_share(self) -> float:
        """Bytes per parameter one device's share of the host holds (sharded as the optimizer's state)."""
        return sharded_state(StateBytes(0.0, 0.0, self.host), self.zero_stage, self.dp).optimizer

    @property
    def host_held(self) -> float:
        """Of ``host_share``, what is held apart from the device's memory (none where they are one)."""
        return 0.0 if self.shared_host else self.host_share

    def optimizer_time(self, numel: int, cluster: ClusterSpec) -> float:
        return stage_optimizer_time(numel, self.state, self.zero_stage, self.dp, cluster,
                                    None if self.offload == NO_OFFLOAD else self.host)


def stage_optimizer_time(numel: float, state: StateBytes, zero_stage: int, dp: int, cluster: ClusterSpec,
                         host: float | None = None) -> float:
    """One step of the optimizer over a stage's ``numel`` parameters: the device's pass over its
    ZeRO share of the state, or, with ``host`` bytes per parameter offloaded there, the host's over
    that share's masters and state."""
    if host is None:
        return zero_optimizer_time(numel, state, zero_stage, dp, cluster)
    share = numel * sharded_state(StateBytes(0.0, 0.0, 1.0), zero_stage, dp).optimizer
    return offload_step_time(share, state, host, cluster)


class Partition:
    """Segment costs of one ``NodeCosts`` under one ``StageSetup``, from prefix sums.

    A segment is positions [j, k) on stage s.
    """

    def __init__(self, costs: NodeCosts, setup: StageSetup, cluster: ClusterSpec, *, forbid: Sequence[int] = (),
                 recompute: Recompute | None = None):
        self.costs, self.setup, self.cluster = costs, setup, cluster
        self.n = len(costs.order)
        # the prefix sums depend on the costs only: shared by every setup cut over them
        self.compute, self.fwd, self.saved, self.params = costs.prefix_sums
        # a rank's expert slices (passes/experts.py): out of ZeRO, every byte of the state each
        self.experts = costs.expert_sums[0] if costs.expert_numel else None
        self.rc = recompute if setup.zero_stage < 3 else None
        # per mode: (forward + backward, saved bytes) prefix sums, and its costs (whose ``live_peak``
        # holds a rerun region's rebuilt activations at its own positions)
        self._modes: dict[str, tuple[list[float], list[float], NodeCosts]] = {NONE: (self.compute, self.saved, costs)}
        self._peaks: dict[tuple[str, int, int], int] = {}  # (mode, j, k) -> the segment's backward peak
        for r in self.rc.options if self.rc is not None else ():
            compute, _, saved, _ = r.costs.prefix_sums
            self._modes[r.mode] = (compute, saved, r.costs)
        blocked = set(forbid)
        self.boundaries = tuple(k for k in costs.boundaries if k not in blocked)
        self.held = [in_flight(setup.schedule, s, setup.stages, setup.micro_batches, setup.chunks)
                     for s in range(setup.stages)]
        held = setup.held  # bytes per parameter, read once: memory_total is the DP's inner loop
        self._state_bytes = (held.params, held.grads, held.optimizer)
        # the DP asks for a segment's memory and then its time: each (j, k, s) is decided once, and
        # the buffers of a parameter count and the sends a stage holds are computed once
        self._sends_held = [sends_held(setup.schedule, s, setup.stages, setup.micro_batches, setup.chunks)
                            for s in range(setup.stages)]
        self._choices: dict[tuple[int, int, int], tuple[int, str]] = {}
        self._segments: dict[tuple[int, int], tuple[int, int, int, int]] = {}
        self._p2p_out: dict[tuple[int, int], float] = {}  # (k, s): the activations' send over boundary k
        self._p2p_back: dict[tuple[int, int], float] = {}  # (j, s): the gradients' send back over j
        # the mode a stage is first weighed in, and a bound on its sends over any boundaries
        # (``surely_fits_from``): the sends are the one part of a segment's bytes that need not grow with it
        self.first_mode = self.rc.options[0].mode if self.rc is not None and self.rc.forced else NONE
        send = max((costs.send_bytes[k] for k in (*self.boundaries, self.n)), default=0)
        grad = max((costs.grad_bytes[j] for j in (0, *self.boundaries)), default=0)
        self._sends_bound = [forward * send + backward * grad for forward, backward in self._sends_held]
        self._reach: dict[int, tuple[int, int]] = {}  # s -> (the last k asked, its first sure boundary)
        self._buffers_of: dict[int, StepBuffers] = {}

    def shared_in(self, j: int, k: int) -> list[SharedParam]:
        out = []
        for sp in self.costs.shared:
            i = bisect.bisect_left(sp.users, j)
            if i < len(sp.users) and sp.users[i] < k:
                out.append(sp)
        return out

    def param_numel(self, j: int, k: int) -> int:
        numel = self.params[k] - self.params[j]
        if self.costs.shared:
            numel += sum(sp.numel for sp in self.shared_in(j, k))
        return numel

    def expert_numel(self, j: int, k: int) -> int:
        """Elements of the expert slices stage [j, k) holds (``NodeCosts.expert_numel``)."""
        return round(self.experts[k] - self.experts[j]) if self.experts else 0

    def p2p(self, j: int, k: int, s: int) -> float:
        """Stage s's sends per micro-batch: activations over boundary k, gradients back over j."""
        out = self._p2p_out.get((k, s))
        if out is None:
            p, c = self.setup.stages, self.costs
            out = self._p2p_out[k, s] = p2p_time(c.send_bytes[k], self.setup.links[s]) if s < p - 1 else 0.0
        back = self._p2p_back.get((j, s))
        if back is None:
            back = self._p2p_back[j, s] = p2p_time(self.costs.grad_bytes[j], self.setup.links[s - 1]) if s > 0 \
                else 0.0
        return out + back

    def _choice(self, j: int, k: int, s: int) -> tuple[int, str]:
        """(bytes per device, recomputation mode) of stage s over [j, k): the one place the
        stage's recomputation is decided. Pinned, it takes the pinned mode; otherwise none where
        it fits, else the first mode (selective, then full) with which it fits. Whether a total
        fits never turns from no to yes as a segment grows: each total grows with the segment."""
        got = self._choices.get((j, k, s))
        if got is None:
            got = self._choices[j, k, s] = self._decide(j, k, s)
        return got

    def _decide(self, j: int, k: int, s: int, sends: bool = True) -> tuple[int, str]:
        """``_choice`` uncached; ``sends=False`` leaves the segment's sends out of its bytes (the
        relaxation branch and bound cuts by, ``bounds.cut_windows``)."""
        held = self._sends(j, k, s) if sends and self.setup.buffers is not None else 0
        segment = self._segment(j, k, held)
        plain = self._bytes(j, k, s, NONE, segment)
        rc, cap = self.rc, self.setup.capacity
        if rc is None or (not rc.forced and plain <= cap):
            return plain, NONE
        for r in rc.options:
            bytes_ = self._bytes(j, k, s, r.mode, segment)
            if rc.forced or bytes_ <= cap:
                return bytes_, r.mode
        return plain, NONE

    def _bytes(self, j: int, k: int, s: int, mode: str, segment: tuple[int, int, int, int, int]) -> int:
        """Stage s over [j, k)'s peak bytes in ``mode``, from what the segment holds (``_segment``): the
        one formula the DP's memory, its fit bound and ``rank_memory``'s total agree on."""
        state, collectives, step, tensors = segment
        _, saved, costs = self._modes[mode]
        peak = self._peaks.get((mode, j, k))
        if peak is None:
            peak = self._peaks[mode, j, k] = costs.backward_peak(j, k)
        # the other micro-batches in flight hold all their saved activations, the one in backward its peak
        return peak_of(state, (self.held[s] - 1) * (saved[k] - saved[j]) + peak + collectives,
                       step, tensors, self.cluster)

    def _segment(self, j: int, k: int, sends: int = 0) -> tuple[int, int, int, int]:
        """What a stage over [j, k) holds whichever stage and mode it is: its state's bytes and its
        buffers' collectives (plus ``sends``), step and tensors; computed once per segment."""
        got = self._segments.get((j, k))
        if got is None:
            state = self._state_total(j, k)
            if self.setup.buffers is None:
                got = (state, 0, 0, 0)
            else:
                buffers = self._base_buffers(self.param_numel(j, k) + self.expert_numel(j, k))
                got = (state, buffers.collectives, buffers.step, buffers.tensors)
            self._segments[j, k] = got
        if sends:
            state, collectives, step, tensors = got
            return state, collectives + sends, step, tensors
        return got

    def recomputes(self, j: int, k: int, s: int) -> str:
        """Stage s over [j, k)'s recomputation mode (``_choice``)."""
        return self._choice(j, k, s)[1]

    def _compute(self, j: int, k: int, mode: str) -> float:
        compute = self._modes[mode][0]
        return compute[k] - compute[j]

    def compute_s(self, j: int, k: int, s: int) -> float:
        """One micro-batch's forward + backward of the segment (recomputation included)."""
        return self._compute(j, k, self.recomputes(j, k, s))

    def slot(self, j: int, k: int, s: int) -> float:
        return stage_slot_time(self.compute_s(j, k, s), self.p2p(j, k, s), self.cluster)

    def _activations(self, j: int, k: int, s: int) -> int:
        """Bytes stage s over [j, k) holds saved for backward (a rerun's rebuilt ones are in ``_live``)."""
        _, saved, _ = self._modes[self.recomputes(j, k, s)]
        return self.held[s] * (saved[k] - saved[j])

    def _live(self, j: int, k: int, s: int) -> int:
        """What stage s over [j, k) holds beyond its saved activations at one micro-batch's peak
        (``NodeCosts.backward_peak``): an op's transient, with a rerun region's rebuilt activations
        where it is one of theirs, less what backward has freed by then of the positions after it."""
        _, saved, costs = self._modes[self.recomputes(j, k, s)]
        return costs.backward_peak(j, k) - round(saved[k] - saved[j])

    def memory(self, j: int, k: int, s: int) -> MemoryBreakdown:
        return self.rank_memory([(j, k, s)], self.setup.capacity)

    def rank_memory(self, segments: Sequence[tuple[int, int, int]], capacity: int) -> MemoryBreakdown:
        """One device's memory holding the stages ``segments`` ((j, k, s) each: one, or a rank's
        virtual stages): their state, activations and sends summed, the costliest op's live set."""
        numel = sum(self.param_numel(j, k) for j, k, _ in segments)
        experts = sum(self.expert_numel(j, k) for j, k, _ in segments)
        st = split_state(model_state_memory(numel, self.setup.held), experts, self.setup.state)
        act = sum(self._activations(j, k, s) for j, k, s in segments)
        live = max(self._live(j, k, s) for j, k, s in segments)
        if self.setup.buffers is None:  # inference: the forward's live set is its activations
            return peak_memory(st, activations=act + live, capacity=capacity, cluster=self.cluster)
        buffers = self._base_buffers(numel + experts)
        sends = sum(self._sends(j, k, s) for j, k, s in segments)
        if sends:
            buffers = replace(buffers, collectives=buffers.collectives + sends,
                              terms={**buffers.terms, "pipeline sends in flight": sends})
        return replace(peak_memory(st, activations=act, capacity=capacity, cluster=self.cluster, transient=live,
                                   buffers=buffers), host=round(numel * self.setup.host_held))

    def surely_fits_from(self, k: int, s: int) -> int:
        """The index of the first boundary j (in ``boundaries``) from which on every segment [j, k) of
        stage s fits in ``first_mode`` (so ``_choice`` would give that mode, fitting) by an upper bound
        on its bytes: the segment's own, with the largest sends over any boundaries. The bound grows
        with the segment at both ends, so the index never falls as k rises: one pointer per stage."""
        last_k, i = self._reach.get(s, (-1, 0))
        if k < last_k:
            i = 0
        ends, cap = self.boundaries, self.setup.capacity
        sends = self._sends_bound[s] if self.setup.buffers is not None else 0
        while i < len(ends) and ends[i] < k:
            if self._bytes(ends[i], k, s, self.first_mode, self._segment(ends[i], k, sends)) <= cap:
                break
            i += 1
        self._reach[s] = (k, i)
        return i

    def _sends(self, j: int, k: int, s: int) -> int:
        """Bytes of the activations stage s holds sent forward and of the gradients it holds sent
        back, of as many micro-batches as the runtime keeps sends of at once."""
        forward, backward = self._sends_held[s]
        return forward * self.costs.send_bytes[k] + backward * self.costs.grad_bytes[j]

    def _base_buffers(self, numel: int) -> StepBuffers:
        buffers = self._buffers_of.get(numel)
        if buffers is None:
            buffers = self._buffers_of[numel] = self.setup.buffers(numel)
        return buffers

    def _state_total(self, j: int, k: int) -> int:
        numel, experts = self.param_numel(j, k), self.expert_numel(j, k)
        params, grads, optimizer = self._state_bytes
        whole = self.setup.state
        return (round(numel * params) + round(numel * grads) + round(numel * optimizer)
                + (round(experts * whole.params) + round(experts * whole.grads) + round(experts * whole.optimizer)
                   if experts else 0))

    def memory_total(self, j: int, k: int, s: int) -> int:
        """``memory(j, k, s).total`` without building the records (the DP's inner loop)."""
        return self._choice(j, k, s)[0]

    def empty(self, j: int, k: int) -> bool:
        """Whether [j, k) would be a chunk of a chunked schedule holding no parameter: none is cut (a
        rank's chunk runs a model part of its own; an empty one only adds sends and slots)."""
        return self.setup.chunks > 1 and not self.param_numel(j, k) and not self.expert_numel(j, k)

    def time_cost(self, j: int, k: int, s: int) -> float:
        """The DP's segment cost: the slot, or infinity when the stage does not fit (or is an empty chunk)."""
        total, recompute = self._choice(j, k, s)
        if total > self.setup.capacity or self.empty(j, k):
            return INF
        return stage_slot_time(self._compute(j, k, recompute), self.p2p(j, k, s), self.cluster)

    def time_floor(self, j: int, k: int, s: int) -> float:
        """A lower bound on ``time_cost`` that never decreases as the segment grows (j falls):
        the compute without recomputation, which only adds time."""
        if self.memory_total(j, k, s) > self.setup.capacity:
            return INF
        mode = self.rc.options[0].mode if self.rc is not None and self.rc.forced else NONE
        return self._compute(j, k, mode) + self.cluster.step_overhead_s

    def memory_cost(self, j: int, k: int, s: int) -> float:
        return float(self.memory_total(j, k, s))



def solve_cuts(part: Partition, cost: Callable[[int, int, int], float] | None = None,
               floor: Callable[[int, int, int], float] | None = None, *,
               cap: float = INF, windows: Sequence[tuple[int, int]] | None = None) -> tuple[float, tuple[int, ...]]:
    """Exact bottleneck partition of positions 0..N into ``part.setup.stages`` segments at
    ``part.boundaries``, minimising the largest ``cost(j, k, s)`` (default: ``part.time_cost``).

    ``floor(j, k, s)`` is a lower bound on the cost that never decreases as a segment
    grows (default: ``part.time_floor`` for the time cost, the cost itself otherwise):
    segments ending at k are tried longest-last and the scan stops once the floor
    reaches the best found. Returns (objective, bounds) with bounds = (0, b_1, ..., N);
    objective ``inf`` when no partition has a finite cost (then bounds is empty).

    ``cap`` (the default cost only; branch and bound's: a bottleneck the caller has no use for) makes
    every bottleneck at or above it infinite, so the scans stop there: the result is the same where
    it is below ``cap``, and ``inf`` otherwise. ``windows`` (``cut_windows(part, cap)``) are where
    each stage of such cuts may end: the rows are weighed there only.
    """
    timed = cost is None and floor is None  # the default: the scan below, inlined (``_time_scan``)
    if cost is None:
        cost, floor = part.time_cost, floor or part.time_floor
    floor = floor or cost
    p, n = part.setup.stages, part.n
    ends = list(part.boundaries)
    if not timed:
        cap, windows = INF, None
    if windows is None:
        windows = [(0, n)] * (p - 1) + [(n, n)]
    if p == 1:
        v = cost(0, n, 0)
        return (v, (0, n)) if v < cap else (INF, ())
    if len(ends) < p - 1:
        return INF, ()
    # best[s][k]: the least bottleneck of stages 0..s ending at boundary k; back[s][k]: its previous boundary
    lo, hi = windows[0]
    best: list[dict[int, float]] = [dict.fromkeys(ends, INF)]
    for k in ends[bisect.bisect_left(ends, lo):bisect.bisect_right(ends, hi)]:
        v = cost(0, k, 0)
        best[0][k] = v if v < cap else INF
    back: list[dict[int, int]] = [{k: 0 for k in ends}]
    for s in range(1, p):
        lo, hi = windows[s]
        targets = [n] if s == p - 1 else ends[bisect.bisect_left(ends, lo):bisect.bisect_right(ends, hi)]
        row, prev = dict.fromkeys(ends, INF), dict.fromkeys(ends, -1)
        seed = -1  # the previous end's best cut: the best cut of the next end is at or after it, mostly
        for k in targets:
            if timed:
                row[k], prev[k] = _time_scan(part, ends, k, s, best[s - 1], seed, cap)
                seed = prev[k] if prev[k] >= 0 else seed
                continue
            v_best, j_best = INF, -1
            for j in reversed(ends[:bisect.bisect_left(ends, k)]):
                if floor(j, k, s) >= v_best:
                    break  # longer segments cost at least as much
                if best[s - 1][j] >= v_best:
                    continue
                v = max(best[s - 1][j], cost(j, k, s))
                if v < v_best:
                    v_best, j_best = v, j
            row[k], prev[k] = v_best, j_best
        best.append(row)
        back.append(prev)
    v = best[p - 1][n]
    if v >= cap:
        return INF, ()
    bounds, k = [n], n
    for s in range(p - 1, 0, -1):
        k = back[s][k]
        bounds.append(k)
    return v, tuple([0] + bounds[::-1])


def _time_scan(part: Partition, ends: Sequence[int], k: int, s: int, before: dict[int, float],
               seed: int = -1, cap: float = INF) -> tuple[float, int]:
    """``solve_cuts``' scan of the segments [j, k) of stage s under the default cost and floor
    (``time_cost``, ``time_floor``): the least bottleneck over every cut j that fits, and the
    largest j that gives it (what a scan from the top, stopping where a segment does not fit or its
    compute floor reaches the best found, returns). The DP's inner loop, with the layers of calls
    between it and the segment's numbers taken out.

    ``seed`` (a cut near the best: the previous end's) is weighed first, so that the scan from the
    top passes over every cut whose stages before it, or whose compute floor, already cost more
    than that without weighing its bytes; the comparisons are strict, so a cut that ties the best
    is still weighed and the largest such cut is the one returned, as without the seed. A bottleneck
    at or above ``cap`` is given as ``inf`` (``solve_cuts``): the scan starts from it as the best found."""
    choices, decide, budget, overhead, p2p, modes = part._choices, part._decide, part.setup.capacity, \
        part.cluster.step_overhead_s, part.p2p, part._modes
    floor = modes[part.first_mode][0]
    sure, first, chunked = part.surely_fits_from(k, s), part.first_mode, part.setup.chunks > 1
    top = bisect.bisect_left(ends, k)

    def value(i: int) -> float | None:
        """Cut ends[i]'s bottleneck; None when the segment does not fit (nor does any longer one)."""
        j = ends[i]
        if i >= sure:  # fits, in its first mode: no need to weigh its bytes
            mode = first
        else:
            got = choices.get((j, k, s))  # part._choice, inlined
            if got is None:
                got = choices[j, k, s] = decide(j, k, s)
            total, mode = got
            if total > budget:
                return None
        if chunked and part.empty(j, k):
            return INF
        compute = modes[mode][0]
        return max(before[j], compute[k] - compute[j] + overhead + p2p(j, k, s))

    v_best, j_best = cap, -1
    seeded = bisect.bisect_left(ends, seed) if 0 <= seed < k else -1
    if seeded >= 0 and ends[seeded] == seed and before[seed] < cap:
        v = value(seeded)
        if v is not None and v < v_best:
            v_best, j_best = v, seed
    for i in range(top - 1, -1, -1):
        j = ends[i]
        if floor[k] - floor[j] + overhead > v_best:
            break  # longer segments cost at least as much
        if before[j] > v_best or before[j] == INF or j == j_best:
            continue
        v = value(i)
        if v is None:
            break  # longer segments do not fit either
        if v < v_best or (v == v_best < INF and j > j_best):
            v_best, j_best = v, j
    return (v_best, j_best) if v_best < cap else (INF, -1)


def any_cuts_fit(part: Partition) -> bool:
    """Whether some cuts keep every stage of ``part`` within its memory (exactly what makes
    ``solve_cuts(part)`` finite), by one greedy pass: each stage takes the furthest boundary
    that still fits. Exact because a segment's memory never falls as it grows, and a
    partition into fewer fitting stages refines into p (a stage split in two holds no
    more, and a stage further on holds no more activations under any schedule)."""
    p, n, cap = part.setup.stages, part.n, part.setup.capacity
    ends = part.boundaries
    if p > 1 and len(ends) < p - 1:
        return False
    j, i = 0, 0  # i: the first boundary after j
    for s in range(p):
        if part.memory_total(j, n, s) <= cap:
            return True
        # the furthest boundary that still fits: a fit never turns from no to yes as the segment grows,
        # so the boundaries from i that fit are a run from i
        stop = first_turned(i, len(ends), lambda x, j=j, s=s: part.memory_total(j, ends[x], s) > cap)
        if stop == i:
            return False
        j, i = ends[stop - 1], stop
    return False
