"""The pipeline axis: where to cut the model into stages, how many micro-batches, which schedule.

Reads a ``ModelProfile``'s annotated graph (``kind``, ``inputs``, ``out_bytes``,
``dtypes``, ``flops_fwd``, ``flops_bwd``, ``requires_grad``, ``saved_bytes``,
``param_name``, ``layer``, ``module``, ``depends_on_input``), a ``ClusterSpec``, a
``TrainingRequest`` and ``Pins``. Writes nothing on the graph. Returns a
``PipelineDecision``: stages count p, micro-batches m, schedule and cuts, the
stages' time and memory, and every alternative weighed with why it lost.

The order. Stages are contiguous runs of ``pipeline_order``: the captured
(topological) order with every placeholder moved to just before its first
user, so a stage owns the parameters it uses and the last stage reads the
targets itself. Repeated layers run one after another in that order.

The search space. When the graph has repeated layers a cut may only fall
between two layers or between a layer and the code before or after the
layers (L + 1 places for L layers); otherwise after any call node. A cut at
boundary k (between positions k - 1 and k) sends every tensor live across it
(produced before k, used at or after k) forward per micro-batch, and the
gradients of those that carry one back.

The solver, per (p, dp, micro-batch size, schedule): an exact dynamic program
over the boundaries (a bottleneck partition). With K allowed boundaries,

    f[s][k] = min_{j < k} max(f[s-1][j], slot(j, k, s))   subject to mem(j, k, s) <= budget

where slot is a stage's forward + backward + overhead + sends per
micro-batch (cost_model.stage_slot_time) and mem its model state plus the
activations in flight under the schedule (cost_model.activations_in_flight).
For fixed (p, m) the step (m + p - 1) max_s slot_s is minimised exactly by
minimising the slowest slot, so the DP is exact for that part of the step;
the per-step tail (gradient all-reduce, optimizer) is added for the cuts found.
O(p K^2) segment evaluations, each O(1) from prefix sums (plus one bisect per
shared parameter); with 97 boundaries and p = 8 that is 75k evaluations.
OR-Tools is not used: the problem is one-dimensional and the DP is exact and
milliseconds fast (benchmarks/pp_planning_time.py), where a CP-SAT model of
the same min-max would need a variable per boundary and stage.

ZeRO. Each (p, dp, micro-batch, schedule, shared-parameter policy) is cut
at the ZeRO stages of passes/zero.zero_stages in order 0, 1, 2, 3, keeping the
first that fits (the rule, and why it is safe, in passes/zero.py): a stage's
model state is sharded over its dp group (``StageSetup.zero_stage``, ``dp``),
and its tail pays ZeRO's collectives (cost_model.zero_step_comm) and the
optimizer's 1/dp slice instead of the all-reduce and the whole state.

Activation recomputation, per stage where memory binds. A stage whose cuts do
not fit memory may recompute its repeated layers (``recompute_costs``): each
layer keeps only what crosses its first boundary (its inputs, what a
checkpoint keeps) and recomputes its forward in backward (backward + forward
time, the forward's TP collectives included), plus one layer's full
activations while it is recomputed. The DP decides it segment by segment: a
stage recomputes exactly when it does not fit without (``Partition.recomputes``),
so it never costs time where memory does not bind. ``Pins.recompute`` forces it
on every stage (True) or off (False). Not with ZeRO-3 (the runtime gathers its
parameters per node, which a recompute in backward would free under it).

Shared (tied) parameters. A parameter used in two stages (GPT-2's tied wte and
lm_head) is held by both, counted in both stages' memory, and its gradient is
all-reduced between them once per step. Both policies are weighed: cuts that
split a shared parameter's users forbidden ("kept together"), or allowed and
that all-reduce paid ("split").
"""

from __future__ import annotations

import bisect
import functools
import math
import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import networkx as nx

from partita.core.errors import InfeasibleError, PartitaError
from partita.core.plan import MemoryBreakdown, Mesh, Stage
from partita.core.precision import activation_scale as precision_activation_scale, is_floating
from partita.passes.cluster import ClusterSpec, Link
from partita.passes.constraints import Pins, TrainingRequest
from partita.passes.cost_model import (
    SCHEDULES,
    PipelineStepCost,
    StateBytes,
    activations_in_flight,
    collective_time,
    compute_time,
    model_state_memory,
    p2p_time,
    pipeline_step,
    sharded_state,
    stage_slot_time,
    state_bytes_per_param,
    zero_optimizer_time,
    zero_step_comm,
)
from partita.passes.data_parallel import gradient_buckets
from partita.passes.profile import ModelProfile
from partita.passes.zero import STRATEGY_NAMES, traffic_reason, zero_stages

_PLACEHOLDERS = ("param", "buffer", "input")
INF = math.inf


# -- the order and the search space ---------------------------------------------


def pipeline_order(G: nx.DiGraph) -> list[str]:
    """The graph's nodes in captured order, each placeholder moved to just before its first user."""
    position = {n: i for i, n in enumerate(G.nodes)}

    def key(n: str) -> tuple[int, int]:
        if G.nodes[n]["kind"] in _PLACEHOLDERS:
            users = [position[u] for u in G.successors(n)]
            return (min(users), 0) if users else (position[n], 0)
        return (position[n], 1)

    order = sorted(G.nodes, key=key)
    at = {n: i for i, n in enumerate(order)}
    assert all(at[u] < at[v] for u, v in G.edges), "pipeline order must be topological"
    return order


def allowed_boundaries(G: nx.DiGraph, order: Sequence[str]) -> tuple[int, ...]:
    """Boundaries k (a cut between positions k - 1 and k) the solver may cut at (module docstring)."""
    n = len(order)
    spans: dict[str, list[int]] = {}
    for i, name in enumerate(order):
        layer = G.nodes[name].get("layer")
        if layer:
            spans.setdefault(layer, [i, i])[1] = i
    after_call = [k for k in range(1, n) if G.nodes[order[k - 1]]["kind"] == "call" and G.nodes[order[k]]["kind"] != "output"]
    if not spans:
        return tuple(after_call)
    inside = set()
    for lo, hi in spans.values():
        inside.update(range(lo + 1, hi + 1))
    in_layer = lambda i: bool(G.nodes[order[i]].get("layer"))  # noqa: E731
    return tuple(k for k in after_call if k not in inside and (in_layer(k - 1) or in_layer(k)))


# -- the solver's input ----------------------------------------------------------


@dataclass(frozen=True)
class SharedParam:
    """A parameter whose users a cut can separate: every stage with a user holds a copy."""

    name: str
    numel: int  # on one device (after tensor-parallel sharding)
    users: tuple[int, ...]  # positions of its users, sorted


@dataclass(frozen=True)
class NodeCosts:
    """One micro-batch's costs per position of the pipeline order, on one device of a stage.

    The solver reads nothing else, so a tensor-parallel solve can hand in its own
    per-node costs at a TP degree. ``send_bytes[k]`` / ``grad_bytes[k]`` are the
    bytes crossing boundary k forward / backward (k = 0..N; 0 and N are empty).
    """

    order: tuple[str, ...]
    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    saved_bytes: tuple[int, ...]
    param_numel: tuple[int, ...]  # parameters used only at this position, local numel
    send_bytes: tuple[int, ...]
    grad_bytes: tuple[int, ...]
    boundaries: tuple[int, ...]
    shared: tuple[SharedParam, ...] = ()
    modules: tuple[str, ...] = ()  # per position: its layer ("transformer.h.3"), a parameter's module, or ""
    layers: frozenset[str] = frozenset()  # the repeated layers' names
    live_bytes: tuple[int, ...] = ()  # inference: activations alive while each position runs (activations.py)

    @functools.cached_property
    def _live_table(self) -> list[list[int]]:
        """Sparse table of ``live_bytes``: row r holds the max over each window of 2**r positions."""
        table = [list(self.live_bytes)]
        while 2 ** len(table) <= len(self.live_bytes):
            prev, half = table[-1], 2 ** (len(table) - 1)
            table.append([max(prev[i], prev[i + half]) for i in range(len(prev) - half)])
        return table

    def live_peak(self, j: int, k: int) -> int:
        """The largest live set over positions [j, k): an inference stage's activations (0 in training)."""
        if not self.live_bytes or k <= j:
            return 0
        r = (k - j).bit_length() - 1
        row = self._live_table[r]
        return max(row[j], row[k - 2 ** r])

    @functools.cached_property
    def prefix_sums(self) -> tuple[list[float], list[float], list[float], list[float]]:
        """Prefix sums of (forward + backward, forward, saved bytes, parameters) over the order."""
        return (_prefix([f + b for f, b in zip(self.forward_s, self.backward_s)]), _prefix(self.forward_s),
                _prefix(self.saved_bytes), _prefix(self.param_numel))

    def __post_init__(self) -> None:
        n = len(self.order)
        for name in ("forward_s", "backward_s", "saved_bytes", "param_numel"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"NodeCosts.{name} has {len(getattr(self, name))} entries for {n} positions")
        if len(self.send_bytes) != n + 1 or len(self.grad_bytes) != n + 1:
            raise ValueError(f"NodeCosts needs {n + 1} boundary byte counts")


@dataclass(frozen=True)
class Recompute:
    """A stage's costs when its repeated layers recompute their activations (``recompute_costs``)."""

    costs: NodeCosts  # saved bytes: only each layer's inputs; backward: + the layer's forward
    transient_bytes: int  # one layer's full activations, rebuilt while its backward runs
    forced: bool = False  # every stage recomputes (``Pins.recompute``), not only where memory binds


def recompute_costs(c: NodeCosts, *, forced: bool = False) -> Recompute | None:
    """``c`` with every repeated layer checkpointed at its boundaries; None without layers.

    A layer keeps ``send_bytes`` at its first position (every tensor live across
    that boundary: its inputs, an upper bound when something is relayed past it)
    and nothing else; its backward runs its forward again first. The largest
    layer's saved bytes are held once more while that layer is recomputed."""
    if not c.layers:
        return None
    fwd, bwd, saved = list(c.forward_s), list(c.backward_s), list(c.saved_bytes)
    per_layer: dict[str, int] = {}
    current = ""  # the layer the previous position belonged to
    for i, label in enumerate(c.modules):
        # a layer's own nodes carry its name; its parameters (placed before their first user)
        # their module's, below it
        layer = label if label in c.layers else current if current and label.startswith(current + ".") else ""
        if not layer:
            current = ""
            continue
        per_layer[layer] = per_layer.get(layer, 0) + saved[i]
        bwd[i] += fwd[i]
        saved[i] = c.send_bytes[i] if layer != current else 0
        current = layer
    return Recompute(replace(c, backward_s=tuple(bwd), saved_bytes=tuple(saved)), max(per_layer.values()), forced)


def activation_scale(profile: ModelProfile, request: TrainingRequest) -> float:
    """The precision's element size over the captured one: the profile measured saved and sent
    bytes at the capture's dtype, the plan holds floating tensors at the precision's."""
    return precision_activation_scale(request.precision, profile.param_dtype)


def kv_ratio(profile: ModelProfile, request: TrainingRequest) -> float:
    """An attention op's KV cache over the keys and values it reads at the captured sequence:
    prompt + new tokens over the captured tokens (0 unless generating; activations.annotate_kv_cache)."""
    return request.kv_tokens / profile.seq_len if request.inference and request.kv_tokens and profile.seq_len else 0.0


def node_costs(profile: ModelProfile, cluster: ClusterSpec, request: TrainingRequest, micro_batch: int,
               *, tp: int = 1) -> NodeCosts:
    """Per-node costs from the profile, scaled from the captured batch to ``micro_batch``.

    Batch-dependent nodes (``depends_on_input``) scale linearly, the rest stay; float
    tensors take the precision's element size. ``tp > 1`` divides compute, parameters
    and saved activations (an inference step's KV cache) evenly (ideal tensor + sequence parallelism, Korthikanti's
    (s b h / t)(34 + 5 a s / h), and no TP communication): pass the TP solver's per-node
    costs instead for real numbers. What crosses a cut stays whole (b s h, not b s h / t).
    """
    G = profile.graph
    order = pipeline_order(G)
    at = {n: i for i, n in enumerate(order)}
    batch = micro_batch / profile.batch_size
    act = activation_scale(profile, request)
    kv = kv_ratio(profile, request)

    def scale(a: dict) -> float:
        return batch if a["depends_on_input"] else 1.0

    def nbytes(a: dict) -> float:
        floating = any(is_floating(d) for d in a["dtypes"])
        return a["out_bytes"] * scale(a) * (act if floating else 1.0)

    fwd, bwd, saved, params = [], [], [], [0] * len(order)
    for name in order:
        a = G.nodes[name]
        fwd.append(compute_time(a["flops_fwd"] * scale(a) / tp, cluster, request.precision))
        bwd.append(0.0 if request.inference else compute_time(a["flops_bwd"] * scale(a) / tp, cluster, request.precision))
        saved.append(round(a.get("kv_bytes", 0) * scale(a) * act * kv / tp) if request.inference
                     else round(a["saved_bytes"] * scale(a) * act / tp))
    live = [round((a["live_batch"] * batch + a["live_fixed"]) * act / tp) for a in map(G.nodes.__getitem__, order)] \
        if request.inference else []
    send = [0.0] * (len(order) + 2)
    grad = [0.0] * (len(order) + 2)
    users_by_param: dict[str, list[int]] = {}
    numel_by_param: dict[str, int] = {}
    for name in order:
        a = G.nodes[name]
        users = sorted(at[u] for u in G.successors(name))
        if a["kind"] == "param":
            pname = a.get("param_name", name)
            users_by_param.setdefault(pname, []).extend(users or [at[name]])
            numel_by_param[pname] = math.prod(a["shapes"][0]) // tp if a["shapes"] else 0
            continue
        if a["kind"] == "buffer" or not users or users[-1] <= at[name] + 1:
            continue
        first, last = at[name] + 1, users[-1]  # live across boundaries first..last
        b = nbytes(a)
        send[first] += b
        send[last + 1] -= b
        if a.get("requires_grad") and not request.inference:
            grad[first] += b
            grad[last + 1] -= b
    boundaries = allowed_boundaries(G, order)
    shared = []
    for pname, users in users_by_param.items():
        users = sorted(set(users))
        lo, hi = users[0], users[-1]
        i = bisect.bisect_right(boundaries, lo)  # the first boundary after the first user
        if i < len(boundaries) and boundaries[i] <= hi:
            shared.append(SharedParam(pname, numel_by_param[pname], tuple(users)))
        else:
            params[lo] += numel_by_param[pname]
    return NodeCosts(
        order=tuple(order), forward_s=tuple(fwd), backward_s=tuple(bwd), saved_bytes=tuple(saved),
        param_numel=tuple(params), send_bytes=_running(send), grad_bytes=_running(grad),
        boundaries=boundaries, shared=tuple(shared),
        modules=tuple(G.nodes[n].get("layer") or (G.nodes[n]["module"] if G.nodes[n]["kind"] == "param" else "")
                      for n in order),
        layers=frozenset(a["layer"] for _, a in G.nodes(data=True) if a.get("layer")),
        live_bytes=tuple(live),
    )


def _running(diff: list[float]) -> tuple[int, ...]:
    out, acc = [], 0.0
    for d in diff[:-1]:
        acc += d
        out.append(round(acc))
    return tuple(out)


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

    @property
    def held(self) -> StateBytes:
        """Bytes per parameter one device holds: ``state`` sharded by ZeRO over the dp group."""
        return sharded_state(self.state, self.zero_stage, self.dp)


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
        self.rc = recompute if setup.zero_stage < 3 else None
        if self.rc is not None:
            self._rc_compute, _, self._rc_saved, _ = self.rc.costs.prefix_sums
        blocked = set(forbid)
        self.boundaries = tuple(k for k in costs.boundaries if k not in blocked)
        self.held = [activations_in_flight(setup.schedule, s, setup.stages, setup.micro_batches)
                     for s in range(setup.stages)]
        held = setup.held  # bytes per parameter, read once: memory_total is the DP's inner loop
        self._state_bytes = (held.params, held.grads, held.optimizer)

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

    def p2p(self, j: int, k: int, s: int) -> float:
        """Stage s's sends per micro-batch: activations over boundary k, gradients back over j."""
        p, c = self.setup.stages, self.costs
        out = p2p_time(c.send_bytes[k], self.setup.links[s]) if s < p - 1 else 0.0
        back = p2p_time(c.grad_bytes[j], self.setup.links[s - 1]) if s > 0 else 0.0
        return out + back

    def _choice(self, j: int, k: int, s: int) -> tuple[int, bool]:
        """(bytes per device, whether it recomputes) of stage s over [j, k): the one place the
        stage's recomputation is decided. Forced, it always recomputes; otherwise exactly when
        it does not fit without and does with. Whether the total fits never turns from no to
        yes as a segment grows: each of the two totals grows with the segment."""
        state = self._state_total(j, k) + self.costs.live_peak(j, k)
        plain = state + self.held[s] * (self.saved[k] - self.saved[j])
        rc, cap = self.rc, self.setup.capacity
        if rc is None or (not rc.forced and plain <= cap):
            return plain, False
        total = state + self.held[s] * (self._rc_saved[k] - self._rc_saved[j]) + rc.transient_bytes
        if rc.forced or total <= cap:
            return total, True
        return plain, False

    def recomputes(self, j: int, k: int, s: int) -> bool:
        """Whether stage s over [j, k) recomputes its layers (``_choice``)."""
        return self._choice(j, k, s)[1]

    def _compute(self, j: int, k: int, recompute: bool) -> float:
        compute = self._rc_compute if recompute else self.compute
        return compute[k] - compute[j]

    def compute_s(self, j: int, k: int, s: int) -> float:
        """One micro-batch's forward + backward of the segment (recomputation included)."""
        return self._compute(j, k, self.recomputes(j, k, s))

    def slot(self, j: int, k: int, s: int) -> float:
        return stage_slot_time(self.compute_s(j, k, s), self.p2p(j, k, s), self.cluster)

    def memory(self, j: int, k: int, s: int) -> MemoryBreakdown:
        st = model_state_memory(self.param_numel(j, k), self.setup.held)
        held = activations_in_flight(self.setup.schedule, s, self.setup.stages, self.setup.micro_batches)
        if self.recomputes(j, k, s):
            act = held * (self._rc_saved[k] - self._rc_saved[j]) + self.rc.transient_bytes
        else:
            act = held * (self.saved[k] - self.saved[j]) + self.costs.live_peak(j, k)
        return MemoryBreakdown(st.params, st.grads, st.optimizer, act, self.setup.capacity)

    def _state_total(self, j: int, k: int) -> int:
        numel = self.param_numel(j, k)
        params, grads, optimizer = self._state_bytes
        return round(numel * params) + round(numel * grads) + round(numel * optimizer)

    def memory_total(self, j: int, k: int, s: int) -> int:
        """``memory(j, k, s).total`` without building the records (the DP's inner loop)."""
        return self._choice(j, k, s)[0]

    def time_cost(self, j: int, k: int, s: int) -> float:
        """The DP's segment cost: the slot, or infinity when the stage does not fit."""
        total, recompute = self._choice(j, k, s)
        if total > self.setup.capacity:
            return INF
        return stage_slot_time(self._compute(j, k, recompute), self.p2p(j, k, s), self.cluster)

    def time_floor(self, j: int, k: int, s: int) -> float:
        """A lower bound on ``time_cost`` that never decreases as the segment grows (j falls):
        the compute without recomputation, which only adds time."""
        if self.memory_total(j, k, s) > self.setup.capacity:
            return INF
        forced = self.rc is not None and self.rc.forced
        return self._compute(j, k, forced) + self.cluster.step_overhead_s

    def memory_cost(self, j: int, k: int, s: int) -> float:
        return float(self.memory_total(j, k, s))


def _prefix(values: Sequence[float]) -> list[float]:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out


def solve_cuts(part: Partition, cost: Callable[[int, int, int], float] | None = None,
               floor: Callable[[int, int, int], float] | None = None) -> tuple[float, tuple[int, ...]]:
    """Exact bottleneck partition of positions 0..N into ``part.setup.stages`` segments at
    ``part.boundaries``, minimising the largest ``cost(j, k, s)`` (default: ``part.time_cost``).

    ``floor(j, k, s)`` is a lower bound on the cost that never decreases as a segment
    grows (default: ``part.time_floor`` for the time cost, the cost itself otherwise):
    segments ending at k are tried longest-last and the scan stops once the floor
    reaches the best found. Returns (objective, bounds) with bounds = (0, b_1, ..., N);
    objective ``inf`` when no partition has a finite cost (then bounds is empty).
    """
    if cost is None:
        cost, floor = part.time_cost, floor or part.time_floor
    floor = floor or cost
    p, n = part.setup.stages, part.n
    ends = list(part.boundaries)
    if p == 1:
        v = cost(0, n, 0)
        return (v, (0, n)) if v < INF else (INF, ())
    if len(ends) < p - 1:
        return INF, ()
    # best[s][k]: the least bottleneck of stages 0..s ending at boundary k; back[s][k]: its previous boundary
    best: list[dict[int, float]] = [{k: cost(0, k, 0) for k in ends}]
    back: list[dict[int, int]] = [{k: 0 for k in ends}]
    for s in range(1, p):
        targets = [n] if s == p - 1 else ends
        row, prev = {}, {}
        for k in targets:
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
    if v == INF:
        return INF, ()
    bounds, k = [n], n
    for s in range(p - 1, 0, -1):
        k = back[s][k]
        bounds.append(k)
    return v, tuple([0] + bounds[::-1])


# -- the decision ------------------------------------------------------------------


@dataclass(frozen=True)
class PipelineStage:
    """One stage of a candidate: positions [start, stop) of the pipeline order."""

    index: int
    start: int
    stop: int
    first_node: str
    last_node: str
    params: int  # parameters held by one device (shared ones counted in every stage using them)
    forward_s: float  # one micro-batch
    backward_s: float
    p2p_s: float  # its sends per micro-batch
    slot_s: float  # forward + backward + overhead + sends
    memory: MemoryBreakdown  # per device
    in_flight: int  # micro-batches of activations held at the peak
    send_bytes: int  # activations sent to the next stage per micro-batch
    ranks: tuple[int, ...]
    modules: tuple[str, ...]
    recompute: bool = False  # its repeated layers recompute their activations in backward

    def to_plan(self, micro_batches: int) -> Stage:
        return Stage(
            index=self.index, nodes=self.stop - self.start, first_node=self.first_node, last_node=self.last_node,
            params=self.params, predicted_time_s=micro_batches * self.slot_s, memory_bytes=self.memory.total,
            forward_s=self.forward_s, backward_s=self.backward_s, ranks=self.ranks, modules=self.modules,
            send_bytes=self.send_bytes, recompute=self.recompute,
        )


@dataclass(frozen=True)
class PipelineCandidate:
    pp: int
    dp: int
    tp: int
    micro_batch_size: int
    micro_batches: int  # per data-parallel rank per step
    schedule: str  # "none" (p = 1), "1f1b" or "gpipe"
    shared_policy: str  # "" (no shared parameter), "kept together" or "split"
    cuts: tuple[str, ...]  # the last node of every stage but the last
    stages: tuple[PipelineStage, ...]
    cost: PipelineStepCost | None  # None when it does not fit
    memory: MemoryBreakdown  # the most loaded stage (with the least-memory cuts when none fits)
    zero_stage: int = 0
    dp_traffic_bytes: int = 0  # the slowest tail's data-parallel bytes sent per step
    cut_for: int | None = None  # not fitting: None when cut for least memory, else the ZeRO stage whose cuts it shows

    @property
    def fits(self) -> bool:
        return self.cost is not None

    @property
    def step_s(self) -> float:
        return self.cost.step_s if self.cost else INF

    @property
    def key(self) -> tuple[int, int, int, str, str, int]:
        return (self.pp, self.dp, self.micro_batch_size, self.schedule, self.shared_policy, self.zero_stage)


@dataclass(frozen=True)
class PipelineDecision:
    best: PipelineCandidate
    candidates: tuple[PipelineCandidate, ...]  # the fitting ones fastest first, then the rest by memory
    reasons: dict[tuple[int, int, int, str, str, int], str]  # candidate.key -> why it lost ("chosen: ..." for best)
    order: tuple[str, ...]  # the pipeline order stages are runs of
    boundaries: tuple[int, ...]  # where cuts were allowed
    shared: tuple[SharedParam, ...]  # parameters a cut could split (tied embeddings)
    solves: int  # dynamic programs run
    seconds: float
    pruned: tuple["PrunedCandidate", ...] = ()  # groups the pruned search did not cut (choose_pipeline)

    @property
    def stages(self) -> tuple[PipelineStage, ...]:
        return self.best.stages

    def plan_stages(self) -> tuple[Stage, ...]:
        return tuple(s.to_plan(self.best.micro_batches) for s in self.best.stages)


def stage_links(cluster: ClusterSpec, pp: int, dp: int, tp: int) -> tuple[Link, ...]:
    """The link between stage s and s + 1 of a (pp, dp, tp) mesh (``ClusterSpec.stage_links``)."""
    return cluster.stage_links(Mesh(dp=dp, tp=tp, pp=pp))


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
) -> PipelineDecision:
    """Decide p, m, the schedule and the cuts jointly; see the module docstring.

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
    outside ``bound``, ``AllPruned`` carries the record.
    """
    t0 = time.perf_counter()
    devices = pins.world_size or cluster.world_size
    tp = pins.tp or devices_per_stage
    if devices % tp:
        raise PartitaError(f"{tp} devices per stage do not divide {devices} devices")
    bad = [s for s in schedules if s not in SCHEDULES]
    if bad or not schedules:
        raise PartitaError(f"schedule(s) {bad or '(none)'} are not among {', '.join(SCHEDULES)}")
    if pins.pp and (devices // tp) % pins.pp:
        raise PartitaError(f"--pp {pins.pp} does not divide {devices // tp} devices ({devices} / {tp} per stage)")
    state = state_bytes_per_param(request.precision, request.optimizer, inference=request.inference)
    build = costs or (lambda mb: node_costs(profile, cluster, request, mb, tp=tp))
    if floor_costs is None and costs is None:
        floor_costs = build
    cache: dict[int, NodeCosts] = {}
    B = request.global_batch
    groups: list[tuple[int, int, int, int]] = []  # (p, dp, micro-batch size, micro-batches), in enumeration order
    if pins.schedule is not None:  # a pinned schedule: only pipelines (p > 1) that run it
        schedules = (pins.schedule,)
    for p in [pins.pp] if pins.pp else _divisors(devices // tp):
        dp = devices // (tp * p)
        if (pins.dp and pins.dp != dp) or B % dp or (pins.schedule is not None and p == 1):
            continue
        share = B // dp
        for mb in [pins.micro_batch_size] if pins.micro_batch_size else _divisors(share):
            m = share // mb
            if share % mb or (pins.grad_accum_steps and pins.grad_accum_steps != m):
                continue
            groups.append((p, dp, mb, m))
    weigh_rc = not request.inference and pins.recompute is not False
    rc_cache: dict[int, Recompute | None] = {}

    def with_rc(c: NodeCosts) -> Recompute | None:
        return recompute_costs(c, forced=bool(pins.recompute)) if weigh_rc else None

    bounder = PipelineBound(cluster, request, state, tp, floor_costs) if prune and floor_costs else None
    visit = list(enumerate(groups))
    if bounder is not None:  # the most promising first, so the incumbent falls early
        visit.sort(key=lambda ig: bounder.step(*ig[1], zero_stages(pins.zero_stage, ig[1][1], request.inference,
                                                                    tp=tp, pp=ig[1][0])))
    found: list[tuple[int, PipelineCandidate]] = []  # (group index, candidate)
    pruned: list[PrunedCandidate] = []
    unfit: list[tuple[int, Partition, int, int, str]] = []  # groups no cuts fit at any ZeRO stage: DP deferred
    solves = 0
    for g, (p, dp, mb, m) in visit:
        zs = zero_stages(pins.zero_stage, dp, request.inference, tp=tp, pp=p)
        if pins.recompute:  # pinned recomputation: not under ZeRO-3 (see the module docstring)
            zs = tuple(z for z in zs if z < 3)
        if not zs:
            continue
        links = stage_links(cluster, p, dp, tp)
        if bounder is not None:
            lb = bounder.step(p, dp, mb, m, zs)
            best_s = min([bound] + [c.step_s for _, c in found])
            if lb > best_s:
                pruned.append(PrunedCandidate(p, dp, tp, mb, m, zs[0], lb, False,
                                              f"not solved: lower bound {lb:.4g} s > best {best_s:.4g} s "
                                              f"({bounder.explain(p, dp, mb, m, zs)})"))
                continue
            if p > len(bounder.floor(mb).boundaries) + 1:
                continue
            plans = [(sch, forbid) for sch in (("none",) if p == 1 else schedules)
                     for _, forbid in _shared_policies(bounder.floor(mb), p)]
            if not any(any_cuts_fit(bounder.partition(mb, StageSetup(p, m, sch, links, cluster.usable_memory, state,
                                                                     z, dp), forbid, with_rc))
                       for sch, forbid in plans for z in zs):
                pruned.append(PrunedCandidate(
                    p, dp, tp, mb, m, zs[-1], lb, True,
                    f"does not fit: no cuts keep every stage within {_gb(cluster.usable_memory)} even at "
                    f"1/{tp} of every layer's state and activations ({', '.join(STRATEGY_NAMES[z] for z in zs)})"))
                continue
        c = _cached(cache, build, mb)
        if p > len(c.boundaries) + 1:
            continue
        if mb not in rc_cache:
            rc_cache[mb] = with_rc(c)
        for schedule, policy, forbid in [(sch, pol, fb) for sch in (("none",) if p == 1 else schedules)
                                         for pol, fb in _shared_policies(c, p)]:
            missed: list[Partition] = []  # smaller ZeRO stages that did not fit
            fitted = False
            best_here = INF  # this group's best fitting step so far (over the ZeRO stages)
            for z in zs:
                if fitted and bounder is not None and sum(bounder.parts(p, dp, mb, m, z)) > min(best_here, bound):
                    break  # past a fit that recomputes: this stage's lower bound already loses to it
                part = Partition(c, StageSetup(p, m, schedule, links, cluster.usable_memory, state, z, dp), cluster,
                                 forbid=forbid, recompute=rc_cache[mb])
                if bounder is not None and not any_cuts_fit(part):
                    missed.append(part)
                    continue
                value, bounds = solve_cuts(part)
                solves += 1
                if value < INF:
                    # the stages that did not fit, costed at the cuts that fit one larger
                    found += [(g, replace(_candidate(x, bounds, dp, tp, mb, policy, False, request), cut_for=z))
                              for x in missed]
                    missed = []
                    cand = _candidate(part, bounds, dp, tp, mb, policy, True, request)
                    found.append((g, cand))
                    fitted = True
                    best_here = min(best_here, cand.step_s)
                    # Larger stages only add traffic (passes/zero.py), unless this one fits by
                    # recomputing where a larger one, holding less state, might not need to.
                    if part.rc is None or part.rc.forced or not any(st.recompute for st in cand.stages):
                        break
                    continue
                missed.append(part)
            if not fitted:
                if not missed:  # no ZeRO stage the runtime executes at this (tp, p)
                    continue
                part = missed[-1]  # the least memory: the largest stage weighed, least-memory cuts
                if bounder is not None:
                    unfit.append((g, part, dp, mb, policy))
                    continue
                value, bounds = solve_cuts(part, part.memory_cost)
                solves += 1
                if bounds:
                    found.append((g, _candidate(part, bounds, dp, tp, mb, policy, False, request)))
    if bounder is not None and not any(c.fits for _, c in found):
        if bound < INF and (found or pruned or unfit):
            raise AllPruned(tuple(pruned) + tuple(_unfit_record(part, dp, tp, mb, cluster) for _, part, dp, mb, _ in unfit))
        # nothing fits anywhere: the exhaustive search names the least-memory plan
        return choose_pipeline(profile, cluster, request, pins, devices_per_stage=devices_per_stage,
                               schedules=schedules, costs=costs)
    for g, part, dp, mb, policy in unfit:
        pruned.append(_unfit_record(part, dp, tp, mb, cluster))
    found.sort(key=lambda gc: gc[0])  # enumeration order, whatever order the groups were visited in
    candidates = [c for _, c in found]
    if not candidates:
        raise PartitaError(
            f"no pipeline split matches: {devices} devices, {tp} per stage, global batch {B}, pins {pins}",
            hint="the batch must divide over the data-parallel ranks; pp must divide devices / tp",
        )
    fitting = sorted((c for c in candidates if c.fits),
                     key=lambda c: (c.step_s, c.memory.total, c.schedule != "1f1b", c.pp))
    if not fitting:
        raise _infeasible(candidates, cluster)
    best = fitting[0]
    reasons = {c.key: _reason(c, best, cluster) for c in candidates}
    ordered = fitting + sorted((c for c in candidates if not c.fits), key=lambda c: c.memory.total)
    any_costs = next(iter(cache.values()))
    return PipelineDecision(best, tuple(ordered), reasons, any_costs.order, any_costs.boundaries, any_costs.shared,
                            solves, time.perf_counter() - t0, tuple(pruned))


def _cached(cache: dict[int, NodeCosts], build: Callable[[int], NodeCosts], mb: int) -> NodeCosts:
    if mb not in cache:
        cache[mb] = build(mb)
    return cache[mb]


def _unfit_record(part: Partition, dp: int, tp: int, mb: int, cluster: ClusterSpec) -> PrunedCandidate:
    st = part.setup
    return PrunedCandidate(st.stages, dp, tp, mb, st.micro_batches, st.zero_stage, INF, True,
                           f"does not fit: no cuts keep every stage within {_gb(cluster.usable_memory)} "
                           f"({st.schedule}, up to {STRATEGY_NAMES[st.zero_stage]}); least-memory cuts not searched",
                           st.schedule)


# -- branch and bound ----------------------------------------------------------------


@dataclass(frozen=True)
class PrunedCandidate:
    """A (p, micro-batch) group the pruned search did not cut, and why that loses nothing."""

    pp: int
    dp: int
    tp: int
    micro_batch_size: int
    micro_batches: int
    zero_stage: int  # the smallest ZeRO stage weighed (time bound) or the largest (memory)
    lower_bound_s: float  # inf when it was pruned for memory
    memory: bool  # pruned because no cuts fit, not because it was slower
    reason: str
    schedule: str = ""  # the one schedule no cuts fit ("": the whole group)


class AllPruned(PartitaError):
    """Every (p, micro-batch) group of a ``choose_pipeline(prune=True)`` call was pruned or fits
    nowhere, while a plan found elsewhere (its ``bound``) fits: nothing here can win."""

    def __init__(self, pruned: tuple[PrunedCandidate, ...]):
        super().__init__(f"{len(pruned)} pipeline groups pruned: none can beat the bound")
        self.pruned = pruned


class PipelineBound:
    """A lower bound on the step of every candidate of a (p, dp, micro-batch, m) group.

    From ``pipeline_step``: step = (m + p - 1) max_s slot_s + max_s tail_s + tied.
    The slowest slot is at least the mean, sum(forward + backward) / p + overhead
    (sends >= 0), and the sum is at least the floor costs' (per-node compute at 1/tp
    of the FLOPs, no TP collectives: every strategy's compute fraction is 1/tp or
    1). The slowest tail is at least that of a stage holding 1/p of the local
    parameters (at least 1/tp of each): its data-parallel collectives, one bucket's
    latency plus the bandwidth of all its bytes, and its optimizer pass, both
    non-decreasing in the parameters held (cost_model.zero_step_comm,
    zero_optimizer_time). The tied all-reduce is >= 0. Over the ZeRO stages weighed
    the least of these bounds is taken: which one fits is not known before cutting.
    """

    _SLACK = 1 - 1e-6  # float sums in another order, and the linear read-off of ``compute``

    def __init__(self, cluster: ClusterSpec, request: TrainingRequest, state: StateBytes, tp: int,
                 floor_costs: Callable[[int], NodeCosts]):
        self.cluster, self.request, self.state, self.tp = cluster, request, state, tp
        self._build = floor_costs
        self._floors: dict[int, NodeCosts] = {}
        self.grad_elem = 0 if request.inference else max(1, int(state.grads))

    def floor(self, mb: int) -> NodeCosts:
        return _cached(self._floors, self._build, mb)

    def partition(self, mb: int, setup: StageSetup, forbid: Sequence[int],
                  recompute: Callable[[NodeCosts], Recompute | None] = lambda c: None) -> Partition:
        """The floor costs cut under ``setup``, with a byte of slack per 1e6 for rounding (and the
        floor of recomputation's memory where it is weighed: a layer's inputs and its largest
        layer's activations never exceed the real ones either)."""
        floor = self.floor(mb)
        return Partition(floor, replace(setup, capacity=round(setup.capacity * (1 + 1e-6))), self.cluster,
                         forbid=forbid, recompute=recompute(floor))

    def compute(self, mb: int) -> float:
        """The floor costs' forward + backward of one micro-batch of ``mb``, summed. Each node's
        is a + b mb (node_costs scales batch-dependent nodes linearly), so the sum is read off
        the floors at micro-batches 1 and 2 rather than built at every size: only the groups
        the bound does not prune need their floors position by position."""
        one, two = self.floor(1).prefix_sums[0][-1], self.floor(2).prefix_sums[0][-1]
        return one + (two - one) * (mb - 1)

    def parts(self, p: int, dp: int, mb: int, m: int, z: int) -> tuple[float, float, float]:
        """(compute + bubble, data-parallel collectives, optimizer) lower bounds, seconds."""
        f = self.floor(1)  # parameters do not depend on the micro-batch
        compute = self.compute(mb) * self._SLACK
        numel = (f.prefix_sums[3][-1] + sum(sp.numel for sp in f.shared)) / p
        slots = (m + p - 1) * (compute / p + self.cluster.step_overhead_s)
        if self.request.inference or numel <= 0:
            return slots, 0.0, 0.0
        comm = 0.0
        if dp > 1:
            link = self.cluster.link_for_group(dp, stride=self.tp)
            comm = zero_step_comm(z, [numel * self.grad_elem], dp, m, link, elem_bytes=self.grad_elem).total_s
        return slots, comm * self._SLACK, zero_optimizer_time(numel, self.state, z, dp, self.cluster) * self._SLACK

    def step(self, p: int, dp: int, mb: int, m: int, zs: Sequence[int]) -> float:
        return min((sum(self.parts(p, dp, mb, m, z)) for z in zs), default=INF)

    def explain(self, p: int, dp: int, mb: int, m: int, zs: Sequence[int]) -> str:
        z = min(zs, key=lambda z: sum(self.parts(p, dp, mb, m, z)))
        slots, comm, opt = self.parts(p, dp, mb, m, z)
        return (f"pp={p} dp={dp} tp={self.tp}, {m} x {mb}: compute + bubble >= {slots:.4g} s, "
                f"data-parallel collectives >= {comm:.3g} s, optimizer >= {opt:.3g} s at {STRATEGY_NAMES[z]}")


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
        reach = -1
        while i < len(ends) and part.memory_total(j, ends[i], s) <= cap:
            reach = ends[i]
            i += 1
        if reach < 0:
            return False
        j = reach
    return False


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _shared_policies(c: NodeCosts, p: int) -> list[tuple[str, tuple[int, ...]]]:
    if not c.shared or p == 1:
        return [("", ())]
    forbid = tuple(k for k in c.boundaries if any(sp.users[0] < k <= sp.users[-1] for sp in c.shared))
    return [("kept together", forbid), ("split", ())]


def _candidate(part: Partition, bounds: tuple[int, ...], dp: int, tp: int, mb: int, policy: str, fits: bool,
               request: TrainingRequest) -> PipelineCandidate:
    c, setup, cluster = part.costs, part.setup, part.cluster
    p = setup.stages
    grad_elem = 0 if request.inference else max(1, int(setup.state.grads))
    stages, dp_s, opt_s, dp_bytes = [], [], [], []
    for s, (j, k) in enumerate(zip(bounds, bounds[1:])):
        mem = part.memory(j, k, s)
        numels = [n for n in c.param_numel[j:k] if n] + [sp.numel for sp in part.shared_in(j, k)]
        buckets = gradient_buckets(numels, grad_elem) if grad_elem and dp > 1 else []
        link = cluster.link_for_group(dp, stride=tp)
        zc = zero_step_comm(setup.zero_stage, buckets, dp, setup.micro_batches, link, elem_bytes=grad_elem or 2)
        dp_s.append(zc.total_s)
        dp_bytes.append(zc.total_bytes)
        opt_s.append(0.0 if request.inference else
                     zero_optimizer_time(sum(numels), setup.state, setup.zero_stage, dp, cluster))
        stages.append(PipelineStage(
            index=s, start=j, stop=k, first_node=c.order[j], last_node=c.order[k - 1], params=sum(numels),
            forward_s=part.fwd[k] - part.fwd[j], backward_s=part.compute_s(j, k, s) - (part.fwd[k] - part.fwd[j]),
            p2p_s=part.p2p(j, k, s), slot_s=part.slot(j, k, s), memory=mem,
            in_flight=activations_in_flight(setup.schedule, s, p, setup.micro_batches),
            send_bytes=c.send_bytes[k] if s < p - 1 else 0, ranks=Mesh(dp=dp, tp=tp, pp=p).stage_ranks(s),
            modules=_modules(part, j, k), recompute=part.recomputes(j, k, s),
        ))
    tied = 0.0
    for sp in c.shared:
        holders = sorted({bisect.bisect_right(bounds[1:-1], u) for u in sp.users})
        if len(holders) > 1 and grad_elem:
            span = setup.links[holders[0]:holders[-1]]
            link = min(span, key=lambda ln: ln.bandwidth)
            tied += collective_time("all_reduce", sp.numel * grad_elem, len(holders), link)
    cost = pipeline_step(
        compute_s=[st.forward_s + st.backward_s for st in stages], p2p_s=[st.p2p_s for st in stages],
        micro_batches=setup.micro_batches, dp_all_reduce_s=dp_s, optimizer_s=opt_s, tied_all_reduce_s=tied,
        cluster=cluster,
    ) if fits else None
    return PipelineCandidate(
        pp=p, dp=dp, tp=tp, micro_batch_size=mb, micro_batches=setup.micro_batches, schedule=setup.schedule,
        shared_policy=policy, cuts=tuple(c.order[k - 1] for k in bounds[1:-1]), stages=tuple(stages), cost=cost,
        memory=max((st.memory for st in stages), key=lambda mm: mm.total), zero_stage=setup.zero_stage,
        dp_traffic_bytes=max(dp_bytes, default=0),
    )


def _modules(part: Partition, j: int, k: int) -> tuple[str, ...]:
    """Layers as ``prefix.a-b`` runs, then the other modules owning parameters, in order."""
    out: list[str] = []
    run: list[str] = []  # [prefix, first index, last index] of the current run of layers
    for label in part.costs.modules[j:k]:
        prefix, _, index = label.rpartition(".")
        if label and index.isdigit() and label in part.costs.layers:
            if run and run[0] == prefix and int(index) in (int(run[2]), int(run[2]) + 1):
                run[2] = index
                continue
            if run:
                out.append(_run_name(run))
            run = [prefix, index, index]
        elif label and label not in out:
            if run:
                out.append(_run_name(run))
                run = []
            out.append(label)
    if run:
        out.append(_run_name(run))
    return tuple(out)


def _run_name(run: list[str]) -> str:
    prefix, a, b = run
    return f"{prefix}.{a}" if a == b else f"{prefix}.{a}-{b}"


def _label(c: PipelineCandidate) -> str:
    sched = "" if c.schedule == "none" else f" {c.schedule.upper()}"
    zero = f", {STRATEGY_NAMES[c.zero_stage]}" if c.zero_stage else ""
    return f"pp={c.pp} x dp={c.dp}, {c.micro_batches} micro-batch(es) of {c.micro_batch_size}{sched}{zero}"


def _binding(c: PipelineCandidate) -> str:
    """The most loaded stage of ``c``, in words and GB."""
    st = max(c.stages, key=lambda s: s.memory.total)
    m = st.memory
    return (f"stage {st.index} needs {_gb(m.total)} (params {_gb(m.params)} + grads {_gb(m.grads)} + "
            f"optimizer {_gb(m.optimizer)} + activations of {st.in_flight} micro-batch(es) "
            f"{_gb(m.activations)}), budget {_gb(m.capacity)}")


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.3g} MB"


def _reason(c: PipelineCandidate, best: PipelineCandidate, cluster: ClusterSpec) -> str:
    if c is best:
        return "chosen: fastest predicted step that fits"
    if not c.fits:
        zero = f"{STRATEGY_NAMES[c.zero_stage]} " if c.zero_stage else ""
        if c.cut_for is not None:
            return (f"{zero}does not fit: no cuts fit; at the cuts that fit {STRATEGY_NAMES[c.cut_for]}, "
                    f"{_binding(c)}")
        return f"{zero}does not fit even with its least-memory cuts: {_binding(c)}"
    a, b = c.cost, best.cost
    assert a is not None and b is not None
    if c.step_s <= best.step_s * (1 + 1e-9):
        return (f"same step time, more memory: {_gb(c.memory.total)} vs {_gb(best.memory.total)}"
                + (" (GPipe holds all m micro-batches, 1F1B at most p)" if c.schedule == "gpipe" else ""))
    parts = [f"{name} {x * 1e3:.3g} ms vs {y * 1e3:.3g} ms"
             for name, x, y in (("compute", a.compute_s, b.compute_s), ("bubble", a.bubble_s, b.bubble_s),
                                ("p2p", a.p2p_s, b.p2p_s), ("data-parallel collectives" if c.zero_stage or best.zero_stage else "gradient all-reduce",
                                 a.dp_all_reduce_s, b.dp_all_reduce_s),
                                ("tied all-reduce", a.tied_all_reduce_s, b.tied_all_reduce_s),
                                ("optimizer", a.optimizer_s, b.optimizer_s))
             if x > y * 1.001 + 1e-12]
    if c.zero_stage and a.dp_all_reduce_s > b.dp_all_reduce_s * 1.001:
        parts.append(traffic_reason(c.zero_stage, c.dp_traffic_bytes, cluster.link_for_group(c.dp, stride=c.tp),
                                    a.dp_all_reduce_s))
    return f"{c.step_s / best.step_s:.2f}x slower: " + "; ".join(parts or ["slower overall"])


def _infeasible(candidates: list[PipelineCandidate], cluster: ClusterSpec) -> InfeasibleError:
    least = min(candidates, key=lambda c: (c.memory.total, -c.pp))
    return InfeasibleError(
        f"no pipeline plan fits: the least memory, {_label(least)}, with the cuts that minimise the largest "
        f"stage: {_binding(least)} ({cluster.memory_bytes / 1e9:.0f} GB less {cluster.memory_reserve:.0%} reserve)",
        hint="add devices (more stages), use smaller micro-batches, tensor parallelism within a stage, "
        "or ZeRO to shard the optimizer state",
    )
