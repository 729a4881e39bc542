"""The tensor-parallel ILP's input and output: every node class's strategies priced, every edge
class's reshards priced, and the cost of a choice.

``build_problem`` reads the annotated DiGraph of a ``ModelProfile`` (node
attributes ``kind``, ``shapes``, ``dtypes``, ``inputs``, ``flops_fwd``,
``flops_bwd``, ``saved_bytes``, ``depends_on_input``, ``param_name``, ``layer``) and
the candidate strategies of every node (``strategies.node_strategies``, those
valid at the micro-batch: ``strategies.valid_at``), prices them with the one
per-node TP cost (passes/tp/costs.py ``TPCosts``) and returns a ``TPProblem``;
``evaluate`` prices one choice of strategy per class. The formulation the solver
builds over it is in passes/tp/ilp.py. Writes nothing on the graph.

Classes (passes/tp/classes.py ``tying_classes``): the node at position p of every identical
repeated layer shares one class, each member keeping its own strategy list (``_own_strategies``) and a member
whose strategies differ in anything else getting its own class (``split_unlike``);
parameter nodes with one ``param_name`` (tied weights) share a class, their state counted
once; edges between layers become one edge class with multiplicity L - 1. Why these are
exact, what tying the layers restricts, and why elementwise chains are not merged:
docs/cost-model.md, "Node and edge classes".
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import networkx as nx

from partita.core.cluster import ClusterSpec
from partita.core.model.graph import per_graph
from partita.core.placement import is_shard
from partita.core.tp.layout import may_regather
from partita.core.tp.strategies import input_index, valid_at
from partita.core.tp.vocabulary import Strategy
from partita.passes.activations import peak_live_bytes
from partita.passes.cost_model import param_step_time, sharded_state, state_bytes_per_param
from partita.passes.repeats import RepeatedBlock
from partita.passes.tp.classes import split_unlike, tying_classes
from partita.passes.tp.costs import TPCosts
from partita.passes.tp.sequence import honour_sequence_parallel

StrategyFn = Callable[[nx.DiGraph, str, int], Sequence[Strategy]]


# -- inputs ---------------------------------------------------------------------


@dataclass(frozen=True)
class TPSetting:
    """What the costs are evaluated for: the TP degree, one micro-batch, the training set-up."""

    t: int
    micro_batch: int
    captured_batch: int
    precision: str
    optimizer: str = "adamw"
    inference: bool = False
    memory_budget: float = math.inf  # bytes per device
    dp: int = 1  # data-parallel degree the step's gradient all-reduce runs over
    grad_accum: int = 1  # micro-batches per step: per-step costs are amortised over them
    zero_stage: int = 0  # ZeRO over the dp group: shards model state (memory) and sets the dp collectives
    kv_ratio: float = 0.0  # inference with generation: KV cache / keys and values read (passes/pipeline/costs.kv_ratio)
    captured_dtype: str = ""  # the dtype floating tensors were captured in ("": the graph's parameters')
    sequence_parallel: bool = False  # linears regather their sequence-split inputs (core/tp/layout.py regathers)
    reduce_dtype: str = "fp32"  # what the dp collectives send gradients in (Training.reduce_dtype)

    def __post_init__(self) -> None:
        if self.t < 1 or self.micro_batch < 1 or self.captured_batch < 1:
            raise ValueError(f"t={self.t}, micro_batch={self.micro_batch}, captured_batch={self.captured_batch} "
                             "must all be positive")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage={self.zero_stage} must be 0, 1, 2 or 3")


@dataclass(frozen=True)
class StrategyCost:
    """One strategy of one class, summed over the class's members."""

    compute_s: float  # local FLOPs, forward + backward
    internal_s: float  # collectives the op runs itself
    fwd_s: float = 0.0  # edges folded into the class (both ends in it), forward
    bwd_s: float = 0.0
    param_numel: float = 0.0  # local parameter elements on one device (after sharding)
    step_s: float = 0.0  # per-step work for those parameters: dp all-reduce share + optimizer
    activation_bytes: float = 0.0  # saved for backward, local
    valid: bool = True  # False when a folded edge would need an invalid reshard

    def memory(self, bytes_per_param: float) -> float:
        return self.param_numel * bytes_per_param + self.activation_bytes

    @property
    def time_s(self) -> float:
        return self.compute_s + self.internal_s + self.fwd_s + self.bwd_s

    def objective(self, grad_accum: int) -> float:
        """Seconds per micro-batch, the per-step work amortised over ``grad_accum`` micro-batches."""
        return self.time_s + self.step_s / grad_accum


@dataclass(frozen=True)
class NodeClass:
    """Nodes that share one choice variable set."""

    key: str  # representative node
    members: tuple[str, ...]
    strategies: tuple[Strategy, ...]
    costs: tuple[StrategyCost, ...]


@dataclass(frozen=True)
class EdgeClass:
    """Edges from class ``src`` to class ``dst``; ``fwd_s[i][j]`` is None where the pair is invalid."""

    src: str
    dst: str
    count: int  # graph edges it stands for
    fwd_s: tuple[tuple[float | None, ...], ...]
    bwd_s: tuple[tuple[float | None, ...], ...]

    def cost(self, i: int, j: int) -> float | None:
        f = self.fwd_s[i][j]
        return None if f is None else f + self.bwd_s[i][j]


@dataclass(frozen=True)
class TPProblem:
    """The solver's whole input: classes, edge classes, the memory budget."""

    setting: TPSetting
    classes: tuple[NodeClass, ...]
    edges: tuple[EdgeClass, ...]
    class_of: Mapping[str, str]  # node -> class key
    strategies_of: Mapping[str, tuple[Strategy, ...]]  # node -> its own strategies, index for index its class's
    bytes_per_param: float
    num_nodes: int
    num_edges: int
    live_bytes: float = 0.0  # inference: the forward's largest live set, whole tensors (activations.peak_live_bytes)

    @property
    def combinations(self) -> int:
        return math.prod(len(c.strategies) for c in self.classes)


# -- outputs --------------------------------------------------------------------


@dataclass(frozen=True)
class TPSolveReport:
    solver: str
    status: str  # "OPTIMAL" | "FEASIBLE" | "INFEASIBLE" | "EXHAUSTIVE"
    objective_s: float
    bound_s: float
    gap: float
    solve_seconds: float
    build_seconds: float
    variables: int
    constraints: int
    classes: int
    nodes: int


@dataclass(frozen=True)
class TPSolution:
    """The chosen strategy of every node and what it costs per micro-batch on one device."""

    choice: Mapping[str, Strategy]
    class_choice: Mapping[str, int]  # class key -> strategy index
    compute_s: float
    tp_forward_s: float
    tp_backward_s: float
    tp_internal_s: float
    param_step_s: float  # per step: the local parameters' dp all-reduce share (bandwidth) and optimizer
    param_numel: float  # local parameter elements per device
    activation_bytes: float
    memory_bytes: float
    report: TPSolveReport

    @property
    def time_s(self) -> float:
        """One micro-batch's forward + backward on one device."""
        return self.compute_s + self.tp_forward_s + self.tp_backward_s + self.tp_internal_s


# -- building the problem --------------------------------------------------------


def build_problem(
    G: nx.DiGraph,
    setting: TPSetting,
    cluster: ClusterSpec,
    *,
    strategies: StrategyFn | None = None,
    repeated: Sequence[RepeatedBlock] = (),
) -> TPProblem:
    """Cost every strategy of every node class and every edge class (the formulas: docs/cost-model.md,
    "Formulation").

    What depends on the layout alone (classes, compute, TP collectives, reshards: the TP degree,
    the micro-batch, the precision and the cluster) is built once per graph and reused by every
    setting that differs only in dp, ZeRO stage, micro-batch count, optimizer or memory budget
    (``_layout_costs``); the per-step parameter work is priced here for this setting."""
    if strategies is None:
        from partita.core.tp.strategies import node_strategies as strategies  # type: ignore[attr-defined]
    lay = _layout_costs(G, setting, cluster, strategies, repeated)
    dp_link = cluster.link_for_group(setting.dp, stride=setting.t)
    state = state_bytes_per_param(setting.precision, setting.optimizer, inference=setting.inference)
    classes = []
    for key, members in lay.groups.items():
        costs = []
        for (compute, internal, act, fwd_s, bwd_s, valid), numel in zip(lay.class_costs[key], lay.param_numel[key]):
            step = (param_step_time(numel, state, setting.dp, dp_link, cluster, reduce_dtype=setting.reduce_dtype,
                                    zero_stage=setting.zero_stage, micro_batches=setting.grad_accum)
                    if numel and not setting.inference else 0.0)
            costs.append(StrategyCost(compute, internal, fwd_s, bwd_s, numel, step, act, valid))
        classes.append(NodeClass(key, tuple(members), lay.strat[key], tuple(costs)))
    held = sharded_state(state, setting.zero_stage, setting.dp)
    return TPProblem(setting, tuple(classes), lay.edges, lay.class_of, lay.own_of, held.total,
                     G.number_of_nodes(), lay.num_edges, lay.live_bytes)


@dataclass(frozen=True)
class _Layout:
    """The part of a ``TPProblem`` that depends on the layout alone (``_layout_costs``)."""

    groups: dict[str, list[str]]
    class_of: dict[str, str]
    strat: dict[str, tuple[Strategy, ...]]
    own_of: dict[str, tuple[Strategy, ...]]
    # class -> per strategy (compute_s, internal_s, activation_bytes, folded fwd_s, folded bwd_s, valid)
    class_costs: dict[str, list[tuple[float, float, float, float, float, bool]]]
    param_numel: dict[str, list[float]]  # class -> per strategy: local parameter elements
    edges: tuple[EdgeClass, ...]
    num_edges: int
    live_bytes: float


# graph -> {layout key: _Layout} (graph.per_graph); at most _MAX_LAYOUTS per graph
_LAYOUTS: weakref.WeakKeyDictionary[nx.DiGraph, tuple[int, dict]] = weakref.WeakKeyDictionary()
_MAX_LAYOUTS = 64


def _layout_costs(G: nx.DiGraph, setting: TPSetting, cluster: ClusterSpec, strategies: StrategyFn,
                  repeated: Sequence[RepeatedBlock]) -> _Layout:
    """Classes, their strategies' compute / collective / activation costs and the edge classes'
    reshard matrices at ``setting``'s TP degree and micro-batch: everything ``build_problem``
    prices that dp, ZeRO, the micro-batch count, the optimizer and the budget do not change;
    cached per graph (a search asks for one (t, micro-batch) under many dp x ZeRO settings)."""
    key = (setting.t, setting.micro_batch, setting.captured_batch, setting.precision, setting.inference,
           setting.kv_ratio, setting.captured_dtype, setting.sequence_parallel, repr(cluster), strategies,
           G.graph.get("batch_shapes"),
           tuple((b.prefix, tuple(b.indices), b.nodes_per_layer) for b in repeated))
    cache = per_graph(_LAYOUTS, G)
    if key not in cache:
        if len(cache) >= _MAX_LAYOUTS:
            cache.pop(next(iter(cache)))
        cache[key] = _price_layout(G, setting, cluster, strategies, repeated)
    return cache[key]


def _price_layout(G: nx.DiGraph, setting: TPSetting, cluster: ClusterSpec, strategies: StrategyFn,
                  repeated: Sequence[RepeatedBlock]) -> _Layout:
    t = setting.t
    price = TPCosts(G, cluster, t, setting.micro_batch, setting.captured_batch, setting.precision,
                    setting.inference, setting.kv_ratio, setting.captured_dtype, setting.sequence_parallel)
    own = _own_strategies(G, t, strategies, setting.micro_batch, setting.sequence_parallel)
    static = per_graph(_STATIC, G)  # what no setting changes: the edges and the classes
    edge_table = static.get("edges")
    if edge_table is None:
        edge_table = static["edges"] = _edge_table(G)
    tying = ("classes", tuple((b.prefix, tuple(b.indices), b.nodes_per_layer) for b in repeated))
    if tying not in static:
        static[tying] = tying_classes(G, repeated)
    groups = split_unlike(G, static[tying], own)
    class_of = {n: key for key, members in groups.items() for n in members}
    strat = {key: own[key] for key in groups}
    for key, ss in strat.items():
        if not ss:
            raise ValueError(f"node {key} ({G.nodes[key]['op']}) has no strategy at t={t}")

    # node costs
    folded: dict[str, list[list[float]]] = {k: [[0.0, 0.0, 1.0] for _ in strat[k]] for k in groups}
    edge_acc: dict[tuple[str, str], dict[tuple, int]] = {}  # edge class -> {matrix key: edges}
    matrix_cache: dict[tuple, tuple] = {}
    num_edges = len(edge_table)
    for u, v, j, i_out, regathers in edge_table:
        cu, cv = class_of[u], class_of[v]
        nbytes = price.tensor_bytes(u, i_out)
        # each end's own strategies: members of a class agree on layouts, not on which inputs carry gradients
        # a regathered input's backward overlaps the consumer's (TPCosts.reshard_s)
        consumer = v if setting.sequence_parallel and regathers else ""
        key = (id(own[u]), id(own[v]), i_out, j, nbytes, price.node_key(v) if consumer else None)
        if key not in matrix_cache:
            matrix_cache[key] = _edge_matrix(own[u], own[v], i_out, j, nbytes, price, consumer)
        fwd, bwd = matrix_cache[key]
        if cu == cv:  # both ends run the same strategy
            for s in range(len(strat[cu])):
                if fwd[s][s] is None:
                    folded[cu][s][2] = 0.0
                else:
                    folded[cu][s][0] += fwd[s][s]
                    folded[cu][s][1] += bwd[s][s]
            continue
        # identical edges (the same position in every repeated layer) are summed once, times their count
        same = edge_acc.setdefault((cu, cv), {})
        same[key] = same.get(key, 0) + 1

    class_costs: dict[str, list[tuple[float, float, float, float, float, bool]]] = {}
    param_numel: dict[str, list[float]] = {}
    priced: dict[tuple, list[tuple[float, float, float]]] = {}  # (node key, strategies) -> per strategy
    for key, members in groups.items():
        totals = [[0.0, 0.0, 0.0] for _ in strat[key]]
        for n in members:
            k = (price.node_key(n), id(own[n]))
            if k not in priced:  # a repeated layer's members price alike: once per distinct node
                priced[k] = [(sum(price.compute_s(n, st)), price.internal_s(n, st), price.saved_bytes(n, st))
                             for st in own[n]]
            for total, each in zip(totals, priced[k]):
                for i in range(3):
                    total[i] += each[i]
        class_costs[key] = [(compute, internal, act, *folded[key][s][:2], bool(folded[key][s][2]))
                            for s, (compute, internal, act) in enumerate(totals)]
        param_numel[key] = [_param_numel(G, members, st, t) for st in strat[key]]
    edges = []
    for (cu, cv), same in edge_acc.items():
        fwd = bwd = None
        for key, count in same.items():
            fwd = _add_matrix(fwd, matrix_cache[key][0], count)
            bwd = _add_matrix(bwd, matrix_cache[key][1], count)
        edges.append(EdgeClass(cu, cv, sum(same.values()), fwd, bwd))
    live = (peak_live_bytes(G, G.nodes, setting.micro_batch, setting.captured_batch, price.act_scale)
            if setting.inference else 0)
    return _Layout(groups, class_of, strat, {n: own[n] for n in class_of}, class_costs, param_numel, tuple(edges),
                   num_edges, live)


def _own_strategies(G: nx.DiGraph, t: int, strategies: StrategyFn, micro_batch: int,
                    sequence_parallel: bool) -> dict[str, tuple[Strategy, ...]]:
    """Every node's own strategy list, those valid at ``micro_batch`` (``strategies.valid_at``: a
    shard of a batch-sized dim may not divide there) under the sequence-parallel setting
    (passes/tp/sequence.py ``honour_sequence_parallel``: off, nothing split along the sequence);
    equal lists are one object (the edge costs are cached by identity)."""
    from partita.core.tp.strategies import node_strategies

    shaped = G.graph.get("batch_shapes") == "linear" and micro_batch != G.graph.get("batch")
    key = (t, micro_batch if shaped else None, sequence_parallel)
    cache = G.graph.get("tp_own_strategies")
    if strategies is node_strategies and cache is not None and cache[0] == G.number_of_nodes() and key in cache[1]:
        return cache[1][key]
    interned: dict[tuple[Strategy, ...], tuple[Strategy, ...]] = {}
    own = {}
    for n in G.nodes:
        ss = [s for s in strategies(G, n, t) if not shaped or valid_at(G, n, s, t, micro_batch)]
        ss = honour_sequence_parallel(G, n, ss, t, micro_batch, sequence_parallel)
        own[n] = interned.setdefault(ss, ss)
    if strategies is node_strategies:  # the lists depend on t, the micro-batch and the setting only
        if cache is None or cache[0] != G.number_of_nodes():
            cache = G.graph["tp_own_strategies"] = (G.number_of_nodes(), {})
        cache[1][key] = own
    return own


# graph -> {"edges": _edge_table, ("classes", blocks): tying_classes} (graph.per_graph)
_STATIC: weakref.WeakKeyDictionary[nx.DiGraph, tuple[int, dict]] = weakref.WeakKeyDictionary()


def _edge_table(G: nx.DiGraph) -> tuple[tuple[str, str, int, int, bool], ...]:
    """Every edge in graph order: (producer, consumer, which input, which output of the producer,
    whether the consumer may regather that input under sequence parallelism)."""
    return tuple((u, v, j, input_index(G, v, j), may_regather(G.nodes[v]["op"], j))
                 for v in G.nodes for j, u in enumerate(G.nodes[v].get("inputs", [])))


def _edge_matrix(src: Sequence[Strategy], dst: Sequence[Strategy], i_out: int, j: int, nbytes: float,
                 costs: TPCosts, consumer: str = "") -> tuple:
    """Forward and backward reshard seconds of one edge for every (producer, consumer) strategy
    pair (``TPCosts.reshard_s``); None where the pair has no valid reshard. ``consumer``: the node
    reading it, where its op and backward change the price (a regathered input)."""
    op = costs.G.nodes[consumer]["op"] if consumer else ""
    back = [costs.compute_s(consumer, sv)[1] if consumer else 0.0 for sv in dst]
    fwd: list[list[float | None]] = []
    bwd: list[list[float | None]] = []
    for su in src:
        if i_out >= len(su.out):
            raise ValueError(f"strategy {su.name} has {len(su.out)} outputs; an edge reads output {i_out}")
        pairs = [costs.reshard_s(su.out[i_out], sv, j, nbytes, op, b) for sv, b in zip(dst, back)]
        fwd.append([None if p is None else p[0] for p in pairs])
        bwd.append([None if p is None else p[1] for p in pairs])
    return fwd, bwd


def _add_matrix(acc, m, count: int = 1):
    """``acc + count * m`` entry by entry (None, an invalid pair, stays None); ``acc`` None: ``count * m``."""
    if acc is None:
        return tuple(tuple(None if b is None else count * b for b in row) for row in m)
    return tuple(tuple(None if a is None or b is None else a + count * b for a, b in zip(ra, rb))
                 for ra, rb in zip(acc, m))


def _param_numel(G: nx.DiGraph, members: Sequence[str], st: Strategy, t: int) -> float:
    """Local parameter elements of the class's distinct parameters under ``st``."""
    seen: set[str] = set()
    total = 0.0
    for n in members:
        a = G.nodes[n]
        if a["kind"] != "param" or a["param_name"] in seen:
            continue
        seen.add(a["param_name"])
        sharded = bool(st.out) and is_shard(st.out[0])
        total += math.prod(a["shapes"][0]) / (t if sharded else 1)
    return total


# -- evaluating a choice -----------------------------------------------------------------


def evaluate(problem: TPProblem, pick: Mapping[str, int], report: TPSolveReport | None = None) -> TPSolution:
    """The cost and memory of choosing strategy ``pick[c]`` for every class ``c``."""
    compute = internal = fwd = bwd = numel = act = step = 0.0
    for c in problem.classes:
        cost = c.costs[pick[c.key]]
        if not cost.valid:
            raise ValueError(f"strategy {pick[c.key]} of {c.key} is invalid inside its class")
        compute += cost.compute_s
        internal += cost.internal_s
        fwd += cost.fwd_s
        bwd += cost.bwd_s
        numel += cost.param_numel
        step += cost.step_s
        act += cost.activation_bytes
    for ec in problem.edges:
        i, j = pick[ec.src], pick[ec.dst]
        if ec.fwd_s[i][j] is None:
            raise ValueError(f"edge {ec.src}->{ec.dst}: strategies {i}, {j} need an invalid reshard")
        fwd += ec.fwd_s[i][j]
        bwd += ec.bwd_s[i][j]
    act += problem.live_bytes
    memory = numel * problem.bytes_per_param + act
    total = compute + internal + fwd + bwd + step / problem.setting.grad_accum
    if report is None:
        report = TPSolveReport("evaluate", "EVALUATED", total, total, 0.0, 0.0, 0.0, 0, 0,
                               len(problem.classes), problem.num_nodes)
    choice = {n: problem.strategies_of[n][pick[k]] for n, k in problem.class_of.items()}
    return TPSolution(choice, dict(pick), compute, fwd, bwd, internal, step, numel, act, memory, report)
