"""The tensor-parallel ILP: one strategy per node, for one TP degree t and one micro-batch.

Reads the annotated DiGraph of a ``ModelProfile`` (node attributes ``kind``,
``shapes``, ``dtypes``, ``inputs``, ``flops_fwd``, ``flops_bwd``,
``saved_bytes``, ``depends_on_input``, ``param_name``, ``layer``) and the
candidate strategies of every node (``tp_strategies.node_strategies``), those valid at the micro-batch
(``tp_strategies.valid_at``: a shard of a dim that grows with the batch must still divide there).
Writes nothing on the graph: it returns a ``TPSolution`` (node -> Strategy,
the cost and memory of that choice, and a ``TPSolveReport``).

Formulation
-----------
Sets. V: the graph's nodes, grouped into classes c in C (below); S_c the
strategies of class c; E the data edges u -> v, grouped into edge classes
k = (c(u), c(v)) in K with c(u) != c(v) (an edge inside one class is folded
into that class's node cost, see "Classes").

Variables (``_add_choice_variables``, ``_add_edge_variables``):
    x[c,s] in {0,1}        class c runs strategy s
    e[k,i,j] in [0,1]      edge class k joins producer strategy i and consumer
                           strategy j (continuous: integral once x is)

Objective (``_set_objective``): predicted seconds of one micro-batch's
forward + backward on one device, plus the step's per-parameter work
amortised over the A = grad_accum micro-batches of a step,

    min  sum_c sum_s  n[c,s] x[c,s]  +  sum_k sum_(i,j) w[k,i,j] e[k,i,j]

    n[c,s] = sum_{v in c} compute_time((F_fwd(v) + F_bwd(v)) * frac_s * beta(v))
                          + sum over s's internal collectives of collective_time
                          + the edges folded into the class
                          + param_step_time(local elements of c's parameters under s) / A

(param_step_time: the local shard's bandwidth share of the step's data-parallel
collectives on ``link_for_group(dp, stride=t)``, under the setting's ZeRO stage z
(2, 2, A + 1 or 3A elements per local element for z = 0..3, A micro-batches:
cost_model.zero_collectives), and the optimizer's pass over the local state (its
1/dp slice under z >= 1); this is what makes a sharded embedding pay off at dp > 1.)
    w[k,i,j] = sum_{u->v in k} sum_{input slots of v fed by u}
                 reshard_time(reshard_kind(out_i, in_j), bytes)               (forward)
               + reshard_time(reshard_kind(grad_j, grad_convention(out_i)), bytes) (backward)

with beta(v) = micro_batch / captured batch for nodes that depend on a model
input (1 otherwise), tensor bytes at the training precision for floating
tensors, and every collective on the TP group's link ``cluster.link_for_group(t)``.
All time formulas are passes/cost_model.py's, composed per node by passes/tp_costs.py (``TPCosts``),
the cost the pipeline search prices the chosen layout with too.

Constraints, each family named (the name prefixes every row of the family):
    one_strategy[c]     sum_s x[c,s] = 1                      (_add_choice_variables)
    edge_out[k,i]       sum_j e[k,i,j] = x[c(u),i]             (_add_edge_variables)
    edge_in[k,j]        sum_i e[k,i,j] = x[c(v),j]             (_add_edge_variables)
    invalid pairs       e[k,i,j] is not created when either reshard is "invalid"
    memory              sum_c sum_s m[c,s] x[c,s] <= budget      (_add_memory_constraint)

    m[c,s] = sum_{params p in c} numel(p) * bytes_per_param * (1/t if s shards p else 1)
             + sum_{v in c} saved_bytes(v) * mem_frac_s * beta(v) * precision ratio

bytes_per_param = params + grads + optimizer of ``state_bytes_per_param`` as one
device holds them under ZeRO z over the dp group (``cost_model.sharded_state``:
optimizer / dp for z >= 1, gradients / dp for z >= 2, parameters / dp for z = 3;
16 for mixed-precision Adam at z = 0, 2 + 2 + 12/dp at z = 1). The two edge families make e the product
x[c(u),i] x[c(v),j] exactly (a transport polytope with one-hot margins has
one point), so the model is tight without the e <= x, e >= x + x - 1 rows.

Classes (exact reductions, ``_classes``):
- Identical repeated layers (``RepeatedBlock``s): the node at position p of
  every layer of a block shares one class. This ties the layers to one layout
  (what Megatron does, and what a runtime applying one per-layer plan can
  execute); it is a restriction, not always the untied optimum (a memory
  budget might like some layers sharded and others not). An 80- or 96-layer
  graph becomes as small as one layer plus embedding and head; the
  multiplicities enter n, w and m. Tying shares the choice of layout, never
  a member's own needs: every member keeps its own strategy list
  (``_own_strategies``), index for index its class's, and its edges are
  costed and expanded with it; members may differ in which inputs carry a
  gradient (the first of a stack of layers reads the model input, which
  carries none: its column-split linear needs no backward reshard, the
  next layers' do). A member whose strategies differ in anything else
  (names, placements, costs: other shapes or dtypes) gets its own class
  (``_split_unlike``).
- Parameter nodes with the same ``param_name`` (tied weights) share a class,
  and their model state is counted once.
- Edges between layers (layer i, position p -> layer i+1, position q) become
  one edge class (p, q) with multiplicity L - 1; an edge whose two ends fall in
  one class is exact as a node cost: both ends run the same strategy.

Elementwise chains are not merged: after tying, the GPT-3 175B model has a few
hundred choice variables and solves in well under a second (benchmarks/
tp_planning_time.py), and merging a chain is exact only when every member's
strategies are in bijection with its neighbour's, which the strategy lists
do not promise (a dropout may accept ``partial``, a GELU may not).

Solver
------
CBC through pywraplp (``SOLVER = "CBC"``), 1 thread. Measured on this 2-core
machine (benchmarks/tp_planning_time.py --solvers, t=8, micro-batch 1), seconds
to prove optimality, all four solvers agreeing on the objective:

    model (classes, variables)       HiGHS   SCIP   CBC    CP-SAT (1 worker, lin. 2)
    GPT-3 175B tied (56, 741)        0.03    0.02   0.01   0.03
    70B-ish tied (56, 781)           0.05    0.04   0.02   0.05
    GPT-2 small untied (474, 6067)   0.30    0.28   0.09   0.18
    7B-ish untied (1234, 18399)      1.07    1.30   0.37   1.93

CBC proved optimality fastest on the bigger (untied) models and ties on the
tied ones that are actually solved; shared/TORCH_ON_CPU.md found HiGHS first on
a larger Alpa-style model, so HiGHS, SCIP and CP-SAT stay selectable
(``solve_tp(..., solver=...)``). CP-SAT runs with num_workers=1 and
linearization_level=2: its default of 2 workers stalls on 2 cores.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import networkx as nx
from ortools.linear_solver import pywraplp

from partita.core.errors import InfeasibleError
from partita.passes.cluster import ClusterSpec
from partita.passes.cost_model import param_step_time, sharded_state, state_bytes_per_param
from partita.passes.activations import peak_live_bytes
from partita.passes.repeats import RepeatedBlock
from partita.passes.tp_costs import TPCosts
from partita.passes.tp_strategies import (
    Strategy, input_index, is_shard, valid_at,
)

SOLVER = "CBC"
# The objective is handed to the solver in microseconds (memory in GB): solvers stop at an
# absolute gap of about 1e-6 of the objective's unit, which in seconds would be 0.03% of a
# millisecond-scale micro-batch. The relative gap asked for is all but zero: the tests compare
# the ILP's optimum with the exhaustive one.
_UNIT = {"time": 1e6, "memory": 1e-9}
RELATIVE_GAP = 1e-9
SOLVERS = ("HIGHS", "SCIP", "CBC", "CP-SAT")

StrategyFn = Callable[[nx.DiGraph, str, int], Sequence[Strategy]]


class SolverError(RuntimeError):
    """The solver failed (not an infeasible model: an abnormal status, a time-out without a solution)."""


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
    kv_ratio: float = 0.0  # inference with generation: KV cache / keys and values read (pipeline_parallel.kv_ratio)
    captured_dtype: str = ""  # the dtype floating tensors were captured in ("": the graph's parameters')

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
    """Cost every strategy of every node class and every edge class (formulas in the module docstring)."""
    if strategies is None:
        from partita.passes.tp_strategies import node_strategies as strategies  # type: ignore[attr-defined]
    t = setting.t
    price = TPCosts(G, cluster, t, setting.micro_batch, setting.captured_batch, setting.precision,
                    setting.inference, setting.kv_ratio, setting.captured_dtype)
    dp_link = cluster.link_for_group(setting.dp, stride=t)
    state = state_bytes_per_param(setting.precision, setting.optimizer, inference=setting.inference)

    own = _own_strategies(G, t, strategies, setting.micro_batch)
    groups = _split_unlike(G, _classes(G, repeated), own)
    class_of = {n: key for key, members in groups.items() for n in members}
    strat = {key: own[key] for key in groups}
    for key, ss in strat.items():
        if not ss:
            raise ValueError(f"node {key} ({G.nodes[key]['op']}) has no strategy at t={t}")

    # node costs
    folded: dict[str, list[list[float]]] = {k: [[0.0, 0.0, 1.0] for _ in strat[k]] for k in groups}
    edge_acc: dict[tuple[str, str], dict] = {}
    matrix_cache: dict[tuple, tuple] = {}
    num_edges = 0
    for v in G.nodes:
        for j, u in enumerate(G.nodes[v].get("inputs", [])):
            num_edges += 1
            cu, cv = class_of[u], class_of[v]
            i_out = input_index(G, v, j)
            nbytes = price.tensor_bytes(u, i_out)
            # each end's own strategies: members of a class agree on layouts, not on which inputs carry gradients
            key = (id(own[u]), id(own[v]), i_out, j, nbytes)
            if key not in matrix_cache:
                matrix_cache[key] = _edge_matrix(own[u], own[v], i_out, j, nbytes, price)
            fwd, bwd = matrix_cache[key]
            if cu == cv:  # both ends run the same strategy
                for s in range(len(strat[cu])):
                    if fwd[s][s] is None:
                        folded[cu][s][2] = 0.0
                    else:
                        folded[cu][s][0] += fwd[s][s]
                        folded[cu][s][1] += bwd[s][s]
                continue
            acc = edge_acc.setdefault((cu, cv), {"count": 0, "fwd": None, "bwd": None})
            acc["count"] += 1
            acc["fwd"] = _add_matrix(acc["fwd"], fwd)
            acc["bwd"] = _add_matrix(acc["bwd"], bwd)

    classes = []
    for key, members in groups.items():
        costs = []
        for s in range(len(strat[key])):
            compute = internal = act = 0.0
            for n in members:
                st = own[n][s]
                compute += sum(price.compute_s(n, st))
                internal += price.internal_s(n, st)
                act += price.saved_bytes(n, st)
            fwd_s, bwd_s, valid = folded[key][s]
            numel = _param_numel(G, members, strat[key][s], t)
            step = (param_step_time(numel, state, setting.dp, dp_link, cluster, zero_stage=setting.zero_stage,
                                    micro_batches=setting.grad_accum) if numel and not setting.inference else 0.0)
            costs.append(StrategyCost(compute, internal, fwd_s, bwd_s, numel, step, act, bool(valid)))
        classes.append(NodeClass(key, tuple(members), strat[key], tuple(costs)))
    edges = tuple(EdgeClass(cu, cv, acc["count"], acc["fwd"], acc["bwd"]) for (cu, cv), acc in edge_acc.items())
    held = sharded_state(state, setting.zero_stage, setting.dp)
    live = (peak_live_bytes(G, G.nodes, setting.micro_batch, setting.captured_batch, price.act_scale)
            if setting.inference else 0)
    return TPProblem(setting, tuple(classes), edges, class_of, {n: own[n] for n in class_of}, held.total,
                     G.number_of_nodes(), num_edges, live)


def _own_strategies(G: nx.DiGraph, t: int, strategies: StrategyFn,
                    micro_batch: int) -> dict[str, tuple[Strategy, ...]]:
    """Every node's own strategy list, those valid at ``micro_batch`` (``tp_strategies.valid_at``: a
    shard of a batch-sized dim may not divide there); equal lists are one object (the edge costs
    are cached by identity)."""
    from partita.passes.tp_strategies import node_strategies

    shaped = G.graph.get("batch_shapes") == "linear" and micro_batch != G.graph.get("batch")
    key = (t, micro_batch if shaped else None)
    cache = G.graph.get("tp_own_strategies")
    if strategies is node_strategies and cache is not None and cache[0] == G.number_of_nodes() and key in cache[1]:
        return cache[1][key]
    interned: dict[tuple[Strategy, ...], tuple[Strategy, ...]] = {}
    own = {}
    for n in G.nodes:
        ss = tuple(s for s in strategies(G, n, t) if not shaped or valid_at(G, n, s, t, micro_batch))
        own[n] = interned.setdefault(ss, ss)
    if strategies is node_strategies:  # the lists depend on t and (with batch shapes) the micro-batch only
        if cache is None or cache[0] != G.number_of_nodes():
            cache = G.graph["tp_own_strategies"] = (G.number_of_nodes(), {})
        cache[1][key] = own
    return own


def _layouts(ss: Sequence[Strategy]) -> tuple:
    """What tying may share between members: each strategy's layouts and costs, not its gradients."""
    return tuple((s.name, s.out, s.ins, s.compute_fraction, s.memory_fraction, s.internal) for s in ss)


def _split_unlike(G: nx.DiGraph, groups: dict[str, list[str]],
                  own: Mapping[str, tuple[Strategy, ...]]) -> dict[str, list[str]]:
    """Each class split into members whose strategy lists match layout for layout.

    Members may still differ in which inputs carry a gradient (the first of a
    stack of layers reads the model's input, the others the previous layer's
    output): they keep their own strategies, index for index, so tying picks
    one layout for all and never changes what a member's own inputs need.
    """
    out: dict[str, list[str]] = {}
    for members in groups.values():
        if len(members) == 1:
            out[members[0]] = members
            continue
        by_layout: dict[tuple, list[str]] = {}
        for n in members:
            by_layout.setdefault(_layouts(own[n]), []).append(n)
        for part in by_layout.values():
            out[part[0]] = part
    position = {n: i for i, n in enumerate(G.nodes)}
    return dict(sorted(out.items(), key=lambda kv: position[kv[0]]))  # graph order, as _classes gives


def _edge_matrix(src: Sequence[Strategy], dst: Sequence[Strategy], i_out: int, j: int, nbytes: float,
                 costs: TPCosts) -> tuple:
    """Forward and backward reshard seconds of one edge for every (producer, consumer) strategy
    pair (``TPCosts.reshard_s``); None where the pair has no valid reshard."""
    fwd: list[list[float | None]] = []
    bwd: list[list[float | None]] = []
    for su in src:
        if i_out >= len(su.out):
            raise ValueError(f"strategy {su.name} has {len(su.out)} outputs; an edge reads output {i_out}")
        pairs = [costs.reshard_s(su.out[i_out], sv, j, nbytes) for sv in dst]
        fwd.append([None if p is None else p[0] for p in pairs])
        bwd.append([None if p is None else p[1] for p in pairs])
    return fwd, bwd


def _add_matrix(acc, m):
    if acc is None:
        return tuple(tuple(row) for row in m)
    return tuple(tuple(None if a is None or b is None else a + b for a, b in zip(ra, rb)) for ra, rb in zip(acc, m))


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
        total += _numel(a["shapes"][0]) / (t if sharded else 1)
    return total


def _classes(G: nx.DiGraph, repeated: Sequence[RepeatedBlock]) -> dict[str, list[str]]:
    """Union of nodes at the same position of identical layers, and of parameter nodes sharing a name."""
    parent = {n: n for n in G.nodes}

    def find(n: str) -> str:
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    def union(a: str, b: str) -> None:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[rb] = ra

    by_layer: dict[str, list[str]] = {}
    for n, a in G.nodes(data=True):
        if a.get("layer"):
            by_layer.setdefault(a["layer"], []).append(n)
    for block in repeated:
        layers = [by_layer.get(name, []) for name in block.layers]
        first = layers[0]
        for other in layers[1:]:
            if len(other) != len(first):
                raise ValueError(f"repeated block {block.prefix}: layers of {len(first)} and {len(other)} nodes")
            for a, b in zip(first, other):
                union(a, b)
    by_param: dict[str, str] = {}
    for n, a in G.nodes(data=True):
        if a["kind"] == "param":
            union(by_param.setdefault(a["param_name"], n), n)
    groups: dict[str, list[str]] = {}
    for n in G.nodes:  # graph order: the representative is the first member
        groups.setdefault(find(n), []).append(n)
    return {members[0]: members for members in groups.values()}


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


# -- the ILP -----------------------------------------------------------------------


@dataclass
class _Model:
    solver: pywraplp.Solver
    x: dict[str, dict[int, pywraplp.Variable]] = field(default_factory=dict)
    e: list[dict[tuple[int, int], pywraplp.Variable]] = field(default_factory=list)
    memory: pywraplp.Constraint | None = None


def solve_tp(problem: TPProblem, *, solver: str = SOLVER, time_limit_s: float = 120.0,
             objective: str = "time") -> TPSolution:
    """Solve ``problem``; raise ``InfeasibleError`` naming the binding constraint, ``SolverError`` on failure.

    ``objective="memory"`` minimises per-device memory instead (used to report
    the smallest layout when the budget cannot be met).
    """
    t0 = time.perf_counter()
    m = _new_model(solver)
    _add_choice_variables(m, problem)
    _add_edge_variables(m, problem)
    if objective == "time":
        _add_memory_constraint(m, problem)
    _set_objective(m, problem, objective)
    build_s = time.perf_counter() - t0
    m.solver.SetTimeLimit(int(time_limit_s * 1000))
    t1 = time.perf_counter()
    params = pywraplp.MPSolverParameters()
    params.SetDoubleParam(params.RELATIVE_MIP_GAP, RELATIVE_GAP)
    status = m.solver.Solve(params)
    solve_s = time.perf_counter() - t1
    if status == pywraplp.Solver.INFEASIBLE:
        raise _infeasible(problem, solver, objective)
    if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        raise SolverError(f"{solver} returned status {_STATUS.get(status, status)} on the TP model "
                          f"(t={problem.setting.t}, micro-batch {problem.setting.micro_batch}, "
                          f"{m.solver.NumVariables()} variables) after {solve_s:.1f} s")
    pick = {key: next(s for s, var in xs.items() if var.solution_value() > 0.5) for key, xs in m.x.items()}
    unit = _UNIT[objective]
    obj = m.solver.Objective().Value() / unit
    bound = (m.solver.Objective().BestBound() if m.solver.IsMip() else m.solver.Objective().Value()) / unit
    gap = abs(obj - bound) / max(abs(obj), 1e-30)
    report = TPSolveReport(solver, _STATUS[status], obj, bound, gap, solve_s, build_s, m.solver.NumVariables(),
                           m.solver.NumConstraints(), len(problem.classes), problem.num_nodes)
    return evaluate(problem, pick, report)


_STATUS = {pywraplp.Solver.OPTIMAL: "OPTIMAL", pywraplp.Solver.FEASIBLE: "FEASIBLE",
           pywraplp.Solver.INFEASIBLE: "INFEASIBLE", pywraplp.Solver.UNBOUNDED: "UNBOUNDED",
           pywraplp.Solver.ABNORMAL: "ABNORMAL", pywraplp.Solver.NOT_SOLVED: "NOT_SOLVED",
           pywraplp.Solver.MODEL_INVALID: "MODEL_INVALID"}


def _new_model(solver: str) -> _Model:
    if solver not in SOLVERS:
        raise ValueError(f"solver {solver!r} is not one of {', '.join(SOLVERS)}")
    s = pywraplp.Solver.CreateSolver("CP_SAT" if solver == "CP-SAT" else solver)
    if s is None:
        raise SolverError(f"OR-Tools has no {solver} backend in this build")
    if solver == "CP-SAT":
        # 2 workers (the default here) stall on 2 cores: shared/TORCH_ON_CPU.md
        s.SetSolverSpecificParametersAsString("num_workers:1 linearization_level:2")
    else:
        s.SetNumThreads(1)
    return _Model(s)


def _add_choice_variables(m: _Model, p: TPProblem) -> None:
    """x[c,s] binaries and one_strategy[c]: sum_s x[c,s] = 1 (invalid strategies get no variable)."""
    for c in p.classes:
        xs = {s: m.solver.BoolVar(f"x[{c.key},{s}]") for s, cost in enumerate(c.costs) if cost.valid}
        if not xs:
            raise InfeasibleError(
                f"layout compatibility: every strategy of node {c.key} needs an invalid reshard between "
                "members of its class", hint="this is a strategy-list bug; report it with the model")
        row = m.solver.Constraint(1, 1, f"one_strategy[{c.key}]")
        for var in xs.values():
            row.SetCoefficient(var, 1)
        m.x[c.key] = xs


def _add_edge_variables(m: _Model, p: TPProblem) -> None:
    """e[k,i,j] for valid pairs; edge_out[k,i]: sum_j e = x[src,i]; edge_in[k,j]: sum_i e = x[dst,j]."""
    for k, ec in enumerate(p.edges):
        xs, xd = m.x[ec.src], m.x[ec.dst]
        es = {(i, j): m.solver.NumVar(0, 1, f"e[{k},{i},{j}]")
              for i in xs for j in xd if ec.fwd_s[i][j] is not None}
        m.e.append(es)
        for i, xi in xs.items():
            row = m.solver.Constraint(0, 0, f"edge_out[{ec.src}->{ec.dst},{i}]")
            row.SetCoefficient(xi, -1)
            for j in xd:
                if (i, j) in es:
                    row.SetCoefficient(es[i, j], 1)
        for j, xj in xd.items():
            row = m.solver.Constraint(0, 0, f"edge_in[{ec.src}->{ec.dst},{j}]")
            row.SetCoefficient(xj, -1)
            for i in xs:
                if (i, j) in es:
                    row.SetCoefficient(es[i, j], 1)


def _add_memory_constraint(m: _Model, p: TPProblem) -> None:
    """memory: sum_c sum_s m[c,s] x[c,s] <= budget - live (per device, in GB for the solver's tolerances;
    live: an inference step's largest live set of activations, a constant of the layout)."""
    if not math.isfinite(p.setting.memory_budget):
        return
    gb = _UNIT["memory"]
    row = m.solver.Constraint(-m.solver.infinity(), (p.setting.memory_budget - p.live_bytes) * gb, "memory")
    for c in p.classes:
        for s, var in m.x[c.key].items():
            row.SetCoefficient(var, c.costs[s].memory(p.bytes_per_param) * gb)
    m.memory = row


def _set_objective(m: _Model, p: TPProblem, objective: str) -> None:
    """Seconds per micro-batch (or bytes per device with objective="memory"), in ``_UNIT``s."""
    obj = m.solver.Objective()
    unit = _UNIT[objective]
    for c in p.classes:
        for s, var in m.x[c.key].items():
            cost = c.costs[s]
            value = cost.objective(p.setting.grad_accum) if objective == "time" else cost.memory(p.bytes_per_param)
            obj.SetCoefficient(var, unit * value)
    if objective == "time":
        for ec, es in zip(p.edges, m.e):
            for (i, j), var in es.items():
                obj.SetCoefficient(var, unit * ec.cost(i, j))
    obj.SetMinimization()


def _infeasible(p: TPProblem, solver: str, objective: str) -> InfeasibleError:
    s = p.setting
    if objective == "memory":
        return InfeasibleError(
            f"layout compatibility: no combination of strategies at t={s.t} has valid reshards on every edge",
            hint="this is a strategy-list bug (every node should keep its replicate strategy); report it")
    smallest = solve_tp(p, solver=solver, objective="memory")
    gb = 1e9
    err = InfeasibleError(
        f"memory: the smallest layout needs {smallest.memory_bytes / gb:.1f} GB per device "
        f"(model state {smallest.param_numel * p.bytes_per_param / gb:.1f} GB + activations "
        f"{smallest.activation_bytes / gb:.1f} GB at micro-batch {s.micro_batch}), budget "
        f"{s.memory_budget / gb:.1f} GB at tp={s.t}" + (f", ZeRO-{s.zero_stage} over dp={s.dp}" if s.zero_stage else ""),
        hint="raise tp, add devices, or lower the micro-batch"
        + ("; a higher ZeRO stage shards more of the model state" if s.zero_stage < 3 else ""))
    err.constraint = "memory"  # type: ignore[attr-defined]
    err.needed_bytes = smallest.memory_bytes  # type: ignore[attr-defined]
    return err


# -- evaluating a choice, and the exhaustive reference ------------------------------------------


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


def exhaustive_choice(problem: TPProblem, *, max_states: int = 2_000_000) -> TPSolution:
    """The optimum over the product of all classes' strategies, by enumeration (small graphs only).

    Independent of any solver. The classes are visited in an order where each
    parameter or input comes just before its first reader; the cost of the
    classes not yet visited depends on the visited ones only through the
    *frontier* (visited classes with an edge to an unvisited one). Without a
    memory budget, the enumeration of the rest is therefore shared between
    prefixes with the same frontier picks (memoised on (position, frontier
    picks)): exact, and it visits at most sum_k prod_{c in frontier(k)} |S_c|
    states. With a finite budget the memory used so far matters too, so every
    prefix is enumerated, cut only where its cost so far plus each remaining
    class's cheapest strategy reaches the best found or its memory so far
    plus each remaining class's smallest exceeds the budget (valid bounds:
    costs are non-negative). ``max_states`` guards against a product too big.
    """
    t0 = time.perf_counter()
    order = _visit_order(problem)
    index = {c.key: k for k, c in enumerate(order)}
    back: list[list[tuple[EdgeClass, int, bool]]] = [[] for _ in order]  # edges to earlier classes
    last_use = list(range(len(order)))
    for ec in problem.edges:
        a, b = index[ec.src], index[ec.dst]
        back[max(a, b)].append((ec, min(a, b), a < b))
        last_use[min(a, b)] = max(last_use[min(a, b)], max(a, b))
    frontier = [[c for c in range(k) if last_use[c] >= k] for k in range(len(order) + 1)]
    valid = [[s for s, c in enumerate(cls.costs) if c.valid] for cls in order]
    bpp = problem.bytes_per_param
    budget = problem.setting.memory_budget
    accum = problem.setting.grad_accum
    visited = [0]

    def step(k: int, s: int, pick: dict[int, int]) -> float | None:
        """Cost of class k running s, with its edges to the already-picked classes."""
        w = order[k].costs[s].objective(accum)
        for ec, other, src_first in back[k]:
            c = ec.cost(pick[other], s) if src_first else ec.cost(s, pick[other])
            if c is None:
                return None
            w += c
        return w

    if math.isfinite(budget):
        best_cost, best_pick = _enumerate_with_budget(order, valid, step, bpp, budget, max_states, visited,
                                                           accum)
    else:
        memo: dict[tuple[int, tuple[int, ...]], tuple[float, int]] = {}

        def rest(k: int, pick: dict[int, int]) -> float:
            if k == len(order):
                return 0.0
            key = (k, tuple(pick[c] for c in frontier[k]))
            if key in memo:
                return memo[key][0]
            visited[0] += 1
            if visited[0] > max_states:
                raise ValueError(f"exhaustive search passed max_states={max_states}")
            best = (math.inf, -1)
            for s in valid[k]:
                w = step(k, s, pick)
                if w is None:
                    continue
                pick[k] = s
                total = w + rest(k + 1, pick)
                del pick[k]
                if total < best[0]:
                    best = (total, s)
            memo[key] = best
            return best[0]

        import sys
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(max(limit, 4 * len(order) + 100))
        try:
            best_cost = rest(0, {})
        finally:
            sys.setrecursionlimit(limit)
        best_pick = {}
        for k in range(len(order)):
            best_pick[k] = memo[(k, tuple(best_pick[c] for c in frontier[k]))][1]
    if not math.isfinite(best_cost):
        raise InfeasibleError(f"exhaustive search: no combination of strategies fits {budget / 1e9:.2f} GB")
    chosen = {order[k].key: s for k, s in best_pick.items()}
    report = TPSolveReport("exhaustive", "OPTIMAL", best_cost, best_cost, 0.0, time.perf_counter() - t0, 0.0,
                           visited[0], 0, len(order), problem.num_nodes)
    return evaluate(problem, chosen, report)


def _visit_order(problem: TPProblem) -> list[NodeClass]:
    """Classes in graph order, each class that reads nothing (parameters, inputs) moved to just
    before its first neighbour, so that it joins the frontier only while it is used."""
    readers = {ec.dst for ec in problem.edges}
    neighbours: dict[str, list[str]] = {c.key: [] for c in problem.classes}
    for ec in problem.edges:
        neighbours[ec.src].append(ec.dst)
        neighbours[ec.dst].append(ec.src)
    by_key = {c.key: c for c in problem.classes}
    order: list[NodeClass] = []
    placed: set[str] = set()
    for c in problem.classes:
        if c.key not in readers:
            continue
        for nb in neighbours[c.key]:
            if nb not in placed and nb not in readers:
                placed.add(nb)
                order.append(by_key[nb])
        placed.add(c.key)
        order.append(c)
    order += [c for c in problem.classes if c.key not in placed]
    return order


def _enumerate_with_budget(order, valid, step, bpp, budget, max_states, visited, accum):
    """Depth-first over every prefix, cut by the cost and memory bounds (see ``exhaustive_choice``)."""
    min_time = [min((order[k].costs[s].objective(accum) for s in valid[k]), default=math.inf) for k in range(len(order))]
    min_mem = [min((order[k].costs[s].memory(bpp) for s in valid[k]), default=math.inf) for k in range(len(order))]
    rest_time = list(itertools.accumulate(reversed(min_time + [0.0])))[::-1]
    rest_mem = list(itertools.accumulate(reversed(min_mem + [0.0])))[::-1]
    by_cost = [sorted(valid[k], key=lambda s, k=k: order[k].costs[s].objective(accum)) for k in range(len(order))]
    best: list = [math.inf, {}]
    pick: dict[int, int] = {}

    def visit(k: int, cost: float, mem: float) -> None:
        if k == len(order):
            if cost < best[0]:
                best[0], best[1] = cost, dict(pick)
            return
        visited[0] += 1
        if visited[0] > max_states:
            raise ValueError(f"exhaustive search passed max_states={max_states}")
        for s in by_cost[k]:
            w = step(k, s, pick)
            if w is None:
                continue
            c2, m2 = cost + w, mem + order[k].costs[s].memory(bpp)
            if c2 + rest_time[k + 1] >= best[0] or m2 + rest_mem[k + 1] > budget * (1 + 1e-12):
                continue
            pick[k] = s
            visit(k + 1, c2, m2)
            del pick[k]

    visit(0, 0.0, 0.0)
    return best[0], best[1]
