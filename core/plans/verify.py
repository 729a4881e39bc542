"""A plan is verified before it runs: what its decisions imply is derived again and compared.

The plan file is the only contract between planning and running, and JSON can be edited by
hand. Loading (``load_plan`` here, over core/plans/plan_file.py's ``read_plan``) therefore refuses a plan whose parts
disagree, naming each disagreement, with the rules that made them (no second copy of a rule):

- every edge's forward and backward collective is the one its placements require
  (``core/tp/vocabulary.reshard_kind`` and ``grad_convention``), and its ``have`` is what
  its producer puts out;
- every node's strategy is one its op's rule can name (``core/tp/rules.op_rule``; the
  exact strategies, with their placements, are re-derived from the graph where the runtime
  has it: ``check_layouts``);
- parameter layouts divide the parameter's shape over tp, and expert weights by whole experts over ep;
- every axis's rules hold, the same rules compile checks on the pins (core/axes: sequence
  parallelism at tp > 1 on a model with a residual stream, ep > 1 on a model with experts and beside
  what this version runs it with, a recomputation mode only where the model has what it reruns, a
  schedule only with stages, ...), and each axis's own checks of the plan (an ep layout only on an
  expert weight);
- every stage is listed, its index within pp (x chunks) and its ranks the mesh's; nodes read only
  earlier stages;
- the mesh fits the cluster, the cluster's figures are valid (``ClusterSpec``'s checks), the
  training set-up is one partita runs, every number is finite and not negative (and every count
  an integer of at most 64 bits: the schema's "integer" takes no 8.0), the model has example
  inputs, the plan decides its graph's nodes and lists the parameters it trains, and its MFU is
  at most 1.

A seal (sha256 over the whole plan, ``plan.seal_digest``) is written at compile time and checked
at load after these checks: a hand edit that passes them is still refused until the user runs
``partita verify PLAN``, which repeats every check and writes a new seal only when all pass.

Reads a ``Plan`` (and, for ``check_layouts``, the graph the runtime captured); writes nothing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from partita.core.axes import axis_problems
from partita.core.mesh import MeshAxis
from partita.core.plans.plan import NodeDecision, Plan
from partita.core.plans.plan_file import describe_problems, plan_from_data, read_plan

MAX_INT = 2**63 - 1  # no count, size or byte figure compile writes is larger (int64: what torch and C++ hold)


def load_plan(path: Any, *, fingerprint: str | None = None, world_size: int | None = None,
              sealed: bool = True) -> Plan:
    """Read a plan file and verify it: the schema, every rule its decisions must follow
    (``plan_problems``) and, unless ``sealed`` is False (`partita verify`), its seal."""
    return read_plan(path, fingerprint=fingerprint, world_size=world_size, sealed=sealed, verify=plan_problems)


def verified_plan(data: Any, *, source: str = "plan", sealed: bool = True) -> Plan:
    """``load_plan`` for JSON data already parsed."""
    return plan_from_data(data, source=source, sealed=sealed, verify=plan_problems)


def plan_problems(plan: Plan) -> list[str]:
    """Every inconsistency of ``plan`` found without the model, in the user's words; [] if none."""
    problems: list[str] = []
    for check in (_numbers, _contents, _model, _cluster, _training, _stages, _nodes, _params, axis_problems,
                  _collectives):
        problems += check(plan)
    return problems


# -- the checks ------------------------------------------------------------------------------------


def _numbers(plan: Plan) -> list[str]:
    bad = []

    def walk(value: Any, where: str) -> None:
        if isinstance(value, bool):
            return
        if isinstance(value, (int, float)):
            if not math.isfinite(value) or value < 0:
                bad.append(f"{where} = {value!r} is not a finite number >= 0")
            elif isinstance(value, int) and value > MAX_INT:
                bad.append(f"{where} = {value} is more than a 64-bit integer holds (2^63 - 1)")
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{where}.{k}" if where else str(k))
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(v, f"{where}[{i}]")

    walk(plan.to_dict(seal=False), "")
    return bad[:5]  # a NaN pasted everywhere is named a few times, not thousands


def _contents(plan: Plan) -> list[str]:
    """What every plan `partita compile` writes holds: a decision per graph node, the parameters a
    training plan trains, and predictions a device can reach."""
    out = []
    if not plan.nodes:
        out.append("it lists no node decisions (a compiled plan has one per node of the model's graph)")
    if not plan.params and not plan.training.inference:
        out.append("a training plan that lists no parameters to train")
    if plan.predicted.mfu > 1:
        out.append(f"predicted.mfu = {plan.predicted.mfu!r}: above 1, more than the devices' peak FLOP/s")
    return out


def _model(plan: Plan) -> list[str]:
    """The captured inputs and targets read back as input specs (each rank captures the model at them)."""
    from partita.core.errors import PartitaError
    from partita.core.model.inputs import check_input_spec

    out = [] if plan.model.inputs else ["model.inputs is empty: a plan is made for the model's example inputs"]
    for what, text in [*(("input", s) for s in plan.model.inputs), ("targets", plan.model.targets)]:
        if text is None:
            continue
        try:
            check_input_spec(text)
        except PartitaError as e:
            out.append(f"model {what} {text!r}: {e.message}")
    return out


def _cluster(plan: Plan) -> list[str]:
    from partita.core.cluster import ClusterSpec
    from partita.core.errors import PartitaError

    try:
        cluster = ClusterSpec.from_dict(plan.cluster)
    except (PartitaError, TypeError, ValueError) as e:
        return [f"the cluster is not valid: {getattr(e, 'message', e)}"]
    if plan.world_size > cluster.world_size:
        return [f"mesh {plan.mesh} needs {plan.world_size} devices, but the cluster "
                f"({cluster.nodes} x {cluster.gpus_per_node}) has {cluster.world_size}"]
    return []


def _training(plan: Plan) -> list[str]:
    from partita.core.plans.plan import OPTIMIZERS
    from partita.core.precision import PRECISIONS

    t, out = plan.training, []
    if t.precision not in PRECISIONS:
        out.append(f"precision {t.precision!r} is not one of {', '.join(PRECISIONS)}")
    if t.optimizer not in OPTIMIZERS:
        out.append(f"optimizer {t.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
    if t.inference != (t.optimizer == "none"):
        out.append(f"inference={t.inference} with optimizer {t.optimizer!r}: a training plan has an optimizer, "
                   "an inference plan none")
    if t.grad_bucket_bytes < 1:
        out.append(f"grad_bucket_bytes={t.grad_bucket_bytes} must be at least 1")
    return out


def _stages(plan: Plan) -> list[str]:
    pp, v, out = plan.mesh.pp, plan.virtual_stages, []
    needs = f"pp={pp}" if v == pp else f"pp={pp} x {plan.training.chunks} chunks"
    indices = [s.index for s in plan.stages]
    if indices != list(range(v)):  # compile lists every stage (one without a pipeline)
        out.append(f"the stages are numbered {indices}, but {needs} needs {list(range(v))}")
    for s in plan.stages:
        if s.index < v and s.ranks and tuple(s.ranks) != plan.mesh.stage_ranks(s.index % pp):
            out.append(f"stage {s.index} lists ranks {list(s.ranks)}, but mesh {plan.mesh} puts "
                       f"{list(plan.mesh.stage_ranks(s.index % pp))} on it")
    for what, items in (("node", plan.nodes), ("parameter", plan.params)):
        for item in items:
            if item.stage >= v:
                out.append(f"{what} {item.name} is on stage {item.stage}, but {needs} has stages 0-{v - 1}")
    return out


def _nodes(plan: Plan) -> list[str]:
    from partita.core.placement import NONE, REPLICATE
    from partita.core.tp.strategies import op_key, op_rule
    from partita.core.tp.vocabulary import grad_convention, is_strategy_name, reshard_kind

    t, out = plan.mesh.tp, []
    seen: dict[str, NodeDecision] = {}
    for d in plan.nodes:
        where = f"node {d.name} ({d.op})"
        if d.name in seen:
            out.append(f"{where} is listed twice")
        if not is_strategy_name(d.strategy):
            out.append(f"{where}: {d.strategy!r} is not a tensor-parallel strategy")
        elif d.strategy != REPLICATE and op_rule(op_key(d.op)[0]) is None and d.op not in ("placeholder",):
            out.append(f"{where}: strategy {d.strategy!r}, but this op has no tensor-parallel rule (only 'replicate')")
        placements = [*d.out, *(p for lay in d.ins for p in (lay.have, lay.need, lay.grad, lay.grad_need))]
        if t == 1 and any(p not in (REPLICATE, NONE) for p in placements):
            out.append(f"{where}: placement {next(p for p in placements if p not in (REPLICATE, NONE))} with tp=1")
        for j, lay in enumerate(d.ins):
            edge = f"{where}, input {j} from {lay.src}"
            src = seen.get(lay.src)
            if src is None:
                out.append(f"{edge}: {lay.src} is not an earlier node of the plan")
                continue
            if lay.index >= len(src.out):
                out.append(f"{edge}: {lay.src} has {len(src.out)} output(s), not an output {lay.index}")
                continue
            if lay.have != src.out[lay.index]:
                out.append(f"{edge}: have {lay.have}, but {lay.src} puts out {src.out[lay.index]}")
            if src.stage > d.stage:
                out.append(f"{edge}: reads stage {src.stage} from stage {d.stage} (a pipeline runs forward)")
            grad_need = NONE if lay.grad == NONE else grad_convention(lay.have)
            if lay.grad_need != grad_need:
                out.append(f"{edge}: grad_need {lay.grad_need}, but a {lay.have} input's gradient must arrive "
                           f"as {grad_need}")
            for kind, have, need, field in ((lay.fwd, lay.have, lay.need, "forward"),
                                            (lay.bwd, lay.grad, lay.grad_need, "backward")):
                want = reshard_kind(have, need)
                if want == "invalid":
                    out.append(f"{edge}: no collective turns {have} into {need} ({field})")
                elif kind != want:
                    out.append(f"{edge}: {field} collective {kind!r}, but {have} -> {need} needs {want!r}")
        seen[d.name] = d
    return out


def _params(plan: Plan) -> list[str]:
    from partita.core.placement import REPLICATE, shard_dim

    out = []
    for p in plan.params:
        for axis, placement in p.layout.items():
            size = getattr(plan.mesh, axis)
            if axis == MeshAxis.TP.value and placement != REPLICATE and size == 1:
                out.append(f"parameter {p.name}: tp layout {placement} with tp=1 (no tensor-parallel group to split "
                           "it over)")
            elif axis == MeshAxis.TP.value and placement != REPLICATE:
                dim = shard_dim(placement)
                if dim is None or dim >= len(p.shape) or p.shape[dim] % size:
                    out.append(f"parameter {p.name} {list(p.shape)}: tp layout {placement} does not divide its "
                               f"shape over tp={size}")
            elif axis == MeshAxis.DP.value and placement not in (REPLICATE, "shard(0)"):
                out.append(f"parameter {p.name}: dp layout {placement} (replicate, or shard(0) under ZeRO)")
            elif axis == MeshAxis.EP.value and placement != REPLICATE and (
                    placement != "shard(0)" or not p.shape or p.shape[0] % size):
                out.append(f"parameter {p.name} {list(p.shape)}: ep layout {placement} (an expert weight is split "
                           f"by whole experts, shard(0), over ep={size})")
            elif axis == MeshAxis.PP.value and placement != REPLICATE:
                out.append(f"parameter {p.name}: pp layout {placement} (a stage holds its parameters whole)")
    return out


def _collectives(plan: Plan) -> list[str]:
    out = []
    for c in plan.collectives:
        size = getattr(plan.mesh, c.axis)
        # pp's collectives join some of the stages (a send to the next, a tied weight's readers)
        if c.group_size > size or (c.axis != MeshAxis.PP.value and c.group_size != size):
            out.append(f"a {c.kind} ({c.purpose}) over {c.axis} lists a group of {c.group_size}, but {c.axis}={size}")
        if c.stage is not None and c.stage >= plan.virtual_stages:
            out.append(f"a {c.kind} ({c.purpose}) on stage {c.stage}, but the plan has {plan.virtual_stages} stages")
    return out


# -- against the graph (the runtime) ---------------------------------------------------------------


def layout_problems(plan: Plan, G: Any, names: Iterable[str] | None = None) -> list[str]:
    """The plan's node decisions against ``G`` (the DiGraph of the graph the runtime runs, at the
    micro-batch shape): every strategy must be one ``node_strategies`` offers the node at this tp,
    and every placement and collective what ``layout_decisions`` derives from those strategies."""
    from partita.core.tp.layout import layout_decisions
    from partita.core.tp.strategies import node_strategies

    t = plan.mesh.tp
    decided = {d.name: d for d in plan.nodes}
    choice, out = {}, []
    for n in G.nodes:
        d = decided.get(n)
        if d is None:
            continue  # the runtime names nodes without a decision itself
        offered = {s.name: s for s in node_strategies(G, n, t)}
        if d.strategy not in offered:
            out.append(f"node {n} ({d.op}): strategy {d.strategy!r} is not one this op offers at tp={t} "
                       f"({', '.join(offered)})")
            continue
        choice[n] = offered[d.strategy]
    if out:
        return out
    for want in layout_decisions(G, t, choice):
        d = decided.get(want.name)
        if d is None:
            continue
        if tuple(d.out) != want.out:
            out.append(f"node {d.name} ({d.op}), strategy {d.strategy!r}: puts out {list(want.out)}, "
                       f"the plan says {list(d.out)}")
        if len(d.ins) != len(want.ins):
            out.append(f"node {d.name} ({d.op}): {len(want.ins)} tensor inputs, the plan lists {len(d.ins)}")
            continue
        for j, (have, lay) in enumerate(zip(want.ins, d.ins)):
            for field in ("src", "index", "have", "need", "grad", "grad_need", "fwd", "bwd"):
                if getattr(lay, field) != getattr(have, field):
                    out.append(f"node {d.name} ({d.op}), input {j}: {field} {getattr(lay, field)!r}, but strategy "
                               f"{d.strategy!r} on this graph gives {getattr(have, field)!r}")
        if tuple(e.partition(":")[0] for e in d.internal) != tuple(e.partition(":")[0] for e in want.internal):
            out.append(f"node {d.name} ({d.op}): internal collectives {list(d.internal)}, strategy "
                       f"{d.strategy!r} runs {list(want.internal)}")
    return out


def param_problems(plan: Plan, param_nodes: dict[str, str]) -> list[str]:
    """Each parameter's tp layout in the plan against its placeholder's placement (which the
    runtime shards it by): a hand edit of one without the other is refused."""
    out: dict[str, str] = {}
    decided = {d.name: d for d in plan.nodes}
    layouts = {p.name: p.layout.get(MeshAxis.TP.value) for p in plan.params}
    for node, qualified in param_nodes.items():
        d = decided.get(node)
        if d is None or not d.out or qualified not in layouts or layouts[qualified] is None:
            continue
        if layouts[qualified] != d.out[0]:
            out[qualified] = (f"parameter {qualified}: the plan's layout says tp={layouts[qualified]} but its "
                              f"placeholder {node} is {d.out[0]}")
    return list(out.values())


def expert_problems(plan: Plan, experts: Iterable[str]) -> list[str]:
    """Each parameter's ep layout against whether the graph stacks it over experts (``experts``:
    core/experts.py's ``expert_params``, what compile splits): at ep > 1 those are split over ep,
    and no other parameter ever is (core/axes/experts.py checks the same without the model, by module)."""
    from partita.core.placement import REPLICATE

    experts, out = set(experts), []
    for p in plan.params:
        placement = p.layout.get(MeshAxis.EP.value, REPLICATE)
        if placement != REPLICATE and p.name not in experts:
            out.append(f"parameter {p.name}: ep layout {placement}, but this model does not stack it over experts "
                       "(core/experts.py): only expert weights are split over ep")
        elif placement == REPLICATE and p.name in experts and plan.mesh.ep > 1:
            out.append(f"parameter {p.name}: ep layout {placement} at mesh.ep = {plan.mesh.ep}, but it is an "
                       "expert weight, split over ep by expert (shard(0))")
    return out


def check_layouts(plan: Plan, captured: Any) -> None:
    """Raise ``PlanError`` when the plan's node decisions are not what its strategies give on the
    graph the runtime captured (``layout_problems``), or its parameters' layouts not what the graph
    says of them (``param_problems``, ``expert_problems``)."""
    from partita.core.errors import PlanError
    from partita.core.experts import expert_params, expert_regions
    from partita.core.model.graph import to_networkx

    graph = captured.graph_module.graph
    # a tied parameter can have several placeholders; the ones the graph reads say where it lives
    used = {n.name for n in graph.nodes if n.users}
    problems = layout_problems(plan, to_networkx(captured)) + param_problems(
        plan, {node: q for node, q in captured.param_nodes.items() if node in used})
    if plan.mesh.ep > 1 or any(MeshAxis.EP.value in p.layout for p in plan.params):
        problems += expert_problems(plan, expert_params(expert_regions(graph, captured.param_nodes),
                                                        captured.param_nodes))
    if problems:
        raise PlanError(f"the plan's layout does not hold on this model: {describe_problems(problems)}",
                        hint="recompile the plan with `partita compile` (or undo the hand edit)")
