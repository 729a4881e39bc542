"""The tensor-parallel ILP: one strategy per node, for one TP degree t and one micro-batch.

Reads a ``TPProblem`` (passes/tp/problem.py ``build_problem``: node and edge classes of a
``ModelProfile``'s graph, every strategy and reshard priced by passes/tp/costs.py). Writes
nothing on the graph: returns a ``TPSolution`` (node -> Strategy, the cost and memory of that
choice, and a ``TPSolveReport``). The formulation in full, why it is tight, and the solver
measurements: docs/cost-model.md, "The tensor-parallel ILP".

Formulation (c in C node classes, s in S_c their strategies, k in K edge classes, A = grad_accum):

    x[c,s] in {0,1}     class c runs strategy s                   (_add_choice_variables)
    e[k,i,j] in [0,1]   edge class k joins producer strategy i
                        and consumer strategy j                   (_add_edge_variables)

    min  sum_c sum_s n[c,s] x[c,s] + sum_k sum_(i,j) w[k,i,j] e[k,i,j]      (_set_objective)

    n[c,s]    seconds of class c under s per micro-batch on one device: compute, s's internal
              collectives, the edges folded into the class, + its parameters' step work / A
    w[k,i,j]  seconds of the forward and backward reshards of the edges of class k

    one_strategy[c]  sum_s x[c,s] = 1                     (_add_choice_variables)
    edge_out[k,i]    sum_j e[k,i,j] = x[c(u),i]           (_add_edge_variables)
    edge_in[k,j]     sum_i e[k,i,j] = x[c(v),j]           (_add_edge_variables)
    invalid pairs    no e[k,i,j] where either reshard is "invalid"
    memory           sum_c sum_s m[c,s] x[c,s] <= budget  (_add_memory_constraint)

    m[c,s]    bytes of c's model state under s and the ZeRO stage, + its saved activations

Solver: CBC through pywraplp (``SOLVER = "CBC"``), 1 thread; HiGHS, SCIP and CP-SAT stay
selectable (``solve_tp(..., solver=...)``), CP-SAT with num_workers=1 and linearization_level=2.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

from ortools.linear_solver import pywraplp

from partita.core.errors import InfeasibleError
from partita.passes.tp.problem import TPProblem, TPSolution, TPSolveReport, evaluate

SOLVER = "CBC"
# The objective is handed to the solver in microseconds (memory in GB): solvers stop at an
# absolute gap of about 1e-6 of the objective's unit, which in seconds would be 0.03% of a
# millisecond-scale micro-batch. The relative gap asked for is all but zero: the tests compare
# the ILP's optimum with the exhaustive one.
_UNIT = {"time": 1e6, "memory": 1e-9}
RELATIVE_GAP = 1e-9
SOLVERS = ("HIGHS", "SCIP", "CBC", "CP-SAT")


class SolverError(RuntimeError):
    """The solver failed (not an infeasible model: an abnormal status, a time-out without a solution)."""


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
    if objective == "time":
        floor, pick = _smallest_memory(problem)
        if floor > problem.setting.memory_budget:
            raise _infeasible(problem, solver, objective, pick)  # no layout fits: nothing to solve
        if all(sum(cost.valid for cost in c.costs) == 1 for c in problem.classes):
            try:  # one choice per class (t = 1): that choice is the solution when its edges are valid
                sol = evaluate(problem, pick)
                obj = sol.report.objective_s
                report = TPSolveReport(solver, "OPTIMAL", obj, obj, 0.0, 0.0, time.perf_counter() - t0, 0, 0,
                                       len(problem.classes), problem.num_nodes)
                return replace(sol, report=report)
            except ValueError:
                pass
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
        # 2 workers (the default here) stall on 2 cores: docs/cost-model.md, "The solver"
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


def _smallest_memory(p: TPProblem) -> tuple[float, dict[str, int]]:
    """Each class's smallest valid strategy and the bytes per device they sum to (with the live
    set): a lower bound on every layout's memory, met exactly when no edge between the picks
    needs an invalid reshard. Above the budget, no layout fits."""
    pick = {c.key: min((s for s, cost in enumerate(c.costs) if cost.valid),
                       key=lambda s, c=c: c.costs[s].memory(p.bytes_per_param), default=0) for c in p.classes}
    total = sum(c.costs[pick[c.key]].memory(p.bytes_per_param) for c in p.classes) + p.live_bytes
    return total, pick


def _infeasible(p: TPProblem, solver: str, objective: str,
                pick: dict[str, int] | None = None) -> InfeasibleError:
    s = p.setting
    if objective == "memory":
        return InfeasibleError(
            f"layout compatibility: no combination of strategies at t={s.t} has valid reshards on every edge",
            hint="this is a strategy-list bug (every node should keep its replicate strategy); report it")
    if pick is None:
        pick = _smallest_memory(p)[1]
    try:  # each class at its smallest strategy: the smallest layout when every edge between them is valid
        smallest = evaluate(p, pick)
    except ValueError:
        smallest = solve_tp(p, solver=solver, objective="memory")
    gb = 1e9
    err = InfeasibleError(
        f"memory: the smallest layout needs {smallest.memory_bytes / gb:.1f} GB per device "
        f"(model state {smallest.param_numel * p.bytes_per_param / gb:.1f} GB + activations "
        f"{smallest.activation_bytes / gb:.1f} GB at micro-batch {s.micro_batch}), budget "
        f"{s.memory_budget / gb:.1f} GB at tp={s.t}"
        + (f", ZeRO-{s.zero_stage} over dp={s.dp}" if s.zero_stage else ""),
        hint="raise tp, add devices, or lower the micro-batch"
        + ("; a higher ZeRO stage shards more of the model state" if s.zero_stage < 3 else ""))
    err.constraint = "memory"  # type: ignore[attr-defined]
    err.needed_bytes = smallest.memory_bytes  # type: ignore[attr-defined]
    return err
