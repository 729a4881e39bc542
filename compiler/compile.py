"""Model -> graph -> analyses -> decisions -> Plan: the one compile pipeline.

Both the CLI (`partita compile`) and the decorator call ``compile_model``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from partita.compiler.plan_collectives import plan_collectives
from partita.core.cluster import ClusterSpec
from partita.core.errors import CaptureError, PartitaError
from partita.core.mesh import MeshAxis
from partita.core.model.capture import CapturedModel, capture
from partita.core.model.graph import annotate_batch_shapes, to_networkx
from partita.core.model.inputs import InputSpec
from partita.core.options import Options
from partita.core.pins import Pins, TrainingRequest
from partita.core.plans.plan import (
    ModelInfo,
    ParamDecision,
    Plan,
    Prediction,
    SolverReport,
    Stage,
    Training,
    tied_stages,
)
from partita.core.precision import activation_scale, compute_dtype, element_bytes
from partita.core.tp.layout import layout_decisions
from partita.passes.calibrated import prediction_sources
from partita.passes.context import context_profile
from partita.passes.cost_model import node_compute_time
from partita.passes.dp.zero import zero_units
from partita.passes.experts import expert_param_names
from partita.passes.flops import annotate_flops
from partita.passes.profile import ModelProfile, profile_model
from partita.passes.search import Decision, plan_search
from partita.passes.tp.costs import captured_float_dtype
from partita.passes.tp.layout_costs import tp_choice

MAX_ALTERNATIVES = 12


@dataclass(frozen=True)
class CompileResult:
    plan: Plan
    profile: ModelProfile
    captured: CapturedModel
    request: TrainingRequest | None = None  # what was planned for
    decision: Decision | None = None  # the search's, laid out on the micro-batch graph


def default_precision(cluster: ClusterSpec) -> str:
    """bf16 mixed precision on GPUs, fp32 on CPU processes (gloo has no fast bf16 matmul)."""
    return "fp32" if cluster.device == "cpu" else "bf16-mixed"


def compile_model(
    model: torch.nn.Module | Callable[[], torch.nn.Module],
    options: Options,
    *,
    name: str | None = None,
    progress: Any = None,
) -> CompileResult:
    """Capture ``model`` on ``options.inputs``, analyse it, decide a plan for ``options``' cluster.

    For training the loss (``options.loss``, default cross-entropy) is captured with the model,
    so its ops are analysed and laid out too; ``options.targets`` defaults to what the model's
    output implies. The global batch defaults to the leading dimension of the first input.
    ``progress`` is an optional rich ``Progress``. ``options.generate`` (inference): new tokens
    per sequence, whose KV cache the plan's memory holds.
    """
    if not options.inputs:
        raise PartitaError(f"{name or 'the model'} needs example inputs to plan",
                           hint="pass --input NAME=DTYPE[SHAPE] (inputs={'idx': 'int64[16,64]'} to the decorator)")
    cluster, pins, inference = options.cluster_spec(), options.pins(), options.inference
    inputs, loss, global_batch = options.inputs, options.loss, options.batch
    timings: dict[str, float] = {}
    phase = _phases(progress)
    pins.check_cluster(pins.world_size or cluster.world_size)  # before any capture
    with phase("capturing the model"):
        captured = capture(model, inputs, name=name, loss=None if inference else loss, targets=options.targets)
    timings["capture"] = captured.seconds
    with phase("analysing the graph"):
        t0 = time.perf_counter()
        profile = profile_model(captured)
        timings["analysis"] = time.perf_counter() - t0
    request = TrainingRequest(
        global_batch=global_batch if global_batch is not None else profile.batch_size,
        precision=options.precision or default_precision(cluster),
        optimizer="none" if inference else options.optimizer_kind,
        inference=inference,
        reduce_dtype=options.reduce_dtype,
        max_grad_norm=None if inference else options.max_grad_norm,
        kv_tokens=(profile.seq_len or 0) + options.generate if options.generate else 0,
    )
    pins.check_batch(request.global_batch)  # the pinned factors of the batch, before the search
    with phase("capturing at a second batch"):
        t0 = time.perf_counter()
        second = batch_shape_capture(model, captured, profile, cluster, pins, loss=loss if not inference else None)
        timings["batch_shapes"] = time.perf_counter() - t0
    with phase("solving"):
        numels = [math.prod(shape) for shape, _ in captured.params.values()]
        decision = plan_search(profile, numels, cluster, request, pins)
        timings["solve"] = decision.seconds
    with phase("laying out the micro-batch graph"):
        t0 = time.perf_counter()
        micro, decision = micro_batch_graph(model, captured, profile, decision, cluster, request, loss=loss,
                                            second=second)
        timings["layout"] = time.perf_counter() - t0
    plan = build_plan(profile, captured, cluster, request, decision, timings, micro_graph=micro)
    return CompileResult(plan, profile, captured, request, decision)


def micro_batch_graph(model: Any, captured: CapturedModel, profile: ModelProfile, decision: Decision,
                      cluster: ClusterSpec, request: TrainingRequest, *,
                      loss: Callable[..., Any] | None,
                      second: CapturedModel | None = None) -> tuple[Any, Decision]:
    """The graph the runtime runs, the model captured at the micro-batch shape, and the decision
    laid out on it.

    Node decisions (their tensors' bytes, their shard sizes) are for what one rank
    executes per micro-batch, so they are recorded on this graph. When it has the
    captured graph's nodes, the search's layout carries over by name: the search only
    offered strategies valid at the micro-batch (``strategies.valid_at``). When the
    model's structure depends on the batch (HF Llama at batch 1 has a node more), the
    TP layout is solved again on this graph, at its own batch, and the stages are
    carried over layer by layer. ``second``: the batch-shape capture (``batch_shape_capture``),
    taken as the micro-batch's when it was made at that batch.
    """
    mb = decision.micro_batch_size
    if mb == profile.batch_size:
        return profile.graph, decision
    if second is not None and second.inputs[0].shape[0] == mb:
        small = second
    else:
        small = capture(model, [_at_batch(s, mb) for s in captured.inputs], name=captured.name,
                        loss=loss if captured.loss else None,
                        targets=_at_batch(captured.targets, mb) if captured.targets is not None else None)
    G = annotate_flops(to_networkx(small))
    if list(G.nodes) == list(profile.graph.nodes) and _strategies_hold(G, decision):
        for n, a in profile.graph.nodes(data=True):  # keep the analyses' layer tags for the plan
            if "layer" in a:
                G.nodes[n]["layer"] = a["layer"]
        return G, decision
    own = profile_model(small)
    choice = tp_choice(context_profile(own, decision.mesh.cp), cluster, request, mb, decision.mesh.tp,
                       sp=decision.sequence_parallel)
    node_stage = _stages_by_layer(own.graph, profile.graph, decision.node_stage)
    note = (f"laid out on the model captured at micro-batch {mb}: its graph differs from the one at batch "
            f"{profile.batch_size} ({len(own.graph)} vs {len(profile.graph)} nodes), so its TP layout was solved "
            "again there; the predictions are the search's")
    calls = [n for n in own.graph.nodes if own.graph.nodes[n]["kind"] == "call"]
    stages = tuple(dataclasses.replace(st, first_node=mine[0], last_node=mine[-1]) if mine else st
                   for st in decision.stages for mine in [[n for n in calls if node_stage[n] == st.index]])
    return own.graph, dataclasses.replace(decision, choice=choice, node_stage=node_stage, stages=stages,
                                          notes=(*decision.notes, note))


def _at_batch(spec: InputSpec, batch: int) -> InputSpec:
    return dataclasses.replace(spec, shape=(batch, *spec.shape[1:]))


def batch_shape_capture(model: Any, captured: CapturedModel, profile: ModelProfile, cluster: ClusterSpec,
                        pins: Pins, *, loss: Callable[..., Any] | None) -> CapturedModel | None:
    """Capture the model again at a second batch, so each tensor's shape at any micro-batch is
    known (``graph.annotate_batch_shapes``) and the TP search offers only strategies valid there.
    Returns that capture (None when skipped or refused).

    The second batch is the likely micro-batch (the pinned one, else B over the data-parallel
    degree the pins leave: every device when nothing is pinned) when that is a whole number of
    at least 2 (a batch-1 graph may differ in structure) other than B: plans often run it, and
    then this capture is also the micro-batch's own graph (``micro_batch_graph``), one capture
    fewer. Otherwise twice the batch.

    Skipped where no TP group can form, and at batch 1: there a dim that grows with the batch
    has size 1 (never split) or is a multiple of the batch (split at 1, split at any micro-batch).
    """
    B = profile.batch_size
    world = pins.world_size or cluster.world_size
    if B == 1 or cluster.gpus_per_node == 1 or pins.tp == 1 or world == 1:
        return None
    if pins.micro_batch_size:
        likely = pins.micro_batch_size
    else:
        dp = pins.dp or world // ((pins.tp or 1) * (pins.pp or 1)) or 1
        likely = B // dp if B % dp == 0 else 0
    other = likely if 2 <= likely != B else 2 * B
    try:
        second = capture(model, [_at_batch(s, other) for s in captured.inputs], name=captured.name,
                         loss=loss if captured.loss else None,
                         targets=_at_batch(captured.targets, other) if captured.targets is not None else None)
    except CaptureError:  # a model that only runs at its batch: its micro-batch's own capture decides
        profile.graph.graph["batch_shapes"] = "unknown"
        return None
    annotate_batch_shapes(profile.graph, to_networkx(second))
    return second


def _strategies_hold(G: Any, d: Decision) -> bool:
    """Every chosen strategy is one ``G`` (the micro-batch graph) offers."""
    return not _strategies_not_offered(G, d)


def _strategies_not_offered(G: Any, d: Decision) -> list[str]:
    """The nodes whose chosen strategy ``G`` (the micro-batch graph) does not offer."""
    if d.mesh.tp <= 1:
        return []
    from partita.core.tp.strategies import node_strategies

    def offered(n: str, s: Any) -> bool:
        return any(o.name == s.name and o.ins == s.ins and o.out == s.out for o in node_strategies(G, n, d.mesh.tp))

    return [n for n, s in d.choice.items() if not offered(n, s)]


def _stages_by_layer(G: Any, captured_graph: Any, node_stage: Mapping[str, int]) -> dict[str, int]:
    """node -> stage on ``G`` from the captured graph's: each repeated layer keeps its stage, the nodes
    between layers keep the captured graph's stage where it has them, else go with the layer before
    them (the embedding with the first), and each
    placeholder with its first user."""
    from partita.passes.pipeline.costs import pipeline_order

    layer_stage: dict[str, int] = {}
    for n, a in captured_graph.nodes(data=True):
        if a.get("layer") and a["kind"] == "call":
            layer_stage.setdefault(a["layer"], node_stage.get(n, 0))
    out: dict[str, int] = {}
    stage = 0
    order = pipeline_order(G)
    for n in order:
        layer = G.nodes[n].get("layer")
        if layer in layer_stage:
            stage = layer_stage[layer]
        elif n in node_stage:  # a node outside the layers the captured graph has too (a head a stage holds alone)
            stage = max(stage, node_stage[n])
        out[n] = stage
    for n in order:
        users = [out[u] for u in G.successors(n)]
        if G.nodes[n]["kind"] in ("param", "buffer", "input") and users:
            out[n] = min(users)
    return out


def _phases(progress: Any) -> Callable[[str], Any]:
    if progress is None:
        return lambda _desc: nullcontext()

    class _Phase:
        def __init__(self, desc: str) -> None:
            self.task = progress.add_task(desc, total=1)

        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc: object) -> None:
            progress.update(self.task, completed=1)

    return _Phase


def build_plan(
    profile: ModelProfile,
    captured: CapturedModel,
    cluster: ClusterSpec,
    request: TrainingRequest,
    decision: Decision,
    timings: dict[str, float],
    *,
    micro_graph: Any = None,
) -> Plan:
    """Pack the analyses and decisions into the frozen plan file structure.

    ``micro_graph`` is the graph at the micro-batch shape (``micro_batch_graph``),
    on which the per-node layouts are recorded; the whole-batch graph otherwise.
    """
    d = decision
    mesh = d.mesh
    step = d.step_s
    B = request.global_batch
    G = profile.graph
    flops_per_step = (profile.flops_fwd + (0 if request.inference else profile.flops_bwd)) / profile.batch_size * B
    achieved = flops_per_step / step / mesh.world_size
    peak = cluster.peak_flops(compute_dtype(request.precision))
    predicted = Prediction(
        step_time_s=step,
        compute_s=d.compute_s,
        comm_s=dict(d.comm_s),
        optimizer_s=d.optimizer_s,
        memory=d.memory,
        traffic_bytes=dict(d.traffic_bytes),
        samples_per_s=B / step,
        tokens_per_s=B * profile.seq_len / step if profile.seq_len else None,
        model_tflops_per_device=achieved / 1e12,
        mfu=achieved / peak,
        sources={**prediction_sources(cluster), **({"expert routing": d.routing} if d.routing else {})},
    )
    Gm = micro_graph if micro_graph is not None else G
    missing = _strategies_not_offered(Gm, d)
    if missing:  # the search offers only strategies valid at the micro-batch: this is partita's bug, not the user's
        raise RuntimeError(f"a bug in partita: the plan's layout holds strategies the micro-batch graph does not offer "
                           f"at nodes {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}; please report it")
    act_scale = activation_scale(request.precision, captured_float_dtype(Gm))
    times = {n: _node_times(Gm, n, d, cluster, request, act_scale) for n in Gm.nodes}
    nodes = tuple(
        dataclasses.replace(n, compute_s=sum(times[n.name]), stage=d.node_stage.get(n.name, 0))
        for n in layout_decisions(Gm, mesh.tp, d.choice, elem_bytes=element_bytes(request.precision))
    )
    params = _param_decisions(captured, G, d)
    stages = d.stages or (_single_stage(profile, captured, times, d),)
    tied = _tied(captured, G, d) if d.mesh.pp > 1 else {}
    units = zero_units(profile.repeated) if d.zero_stage == 3 else ()
    collectives = plan_collectives(captured, params, nodes, tied, d, cluster, request, units, profile=profile)
    model = ModelInfo(
        name=profile.name,
        fingerprint=profile.fingerprint,
        num_params=profile.num_params,
        param_bytes=profile.param_bytes,
        inputs=tuple(str(s) for s in captured.inputs),
        capture_method=profile.capture_method,
        num_nodes=profile.num_nodes,
        repeated_layers=tuple(f"{r.prefix} x{len(r.indices)} ({r.module_type})" for r in profile.repeated),
        targets=str(captured.targets) if captured.targets is not None else None,
        loss=captured.loss,
    )
    training = Training(
        global_batch=B,
        micro_batch_size=d.micro_batch_size,
        grad_accum_steps=d.grad_accum_steps,
        precision=request.precision,
        optimizer=request.optimizer,
        zero_stage=d.zero_stage,
        schedule=d.schedule,
        chunks=d.chunks,
        offload=d.offload,
        sequence_parallel=d.sequence_parallel,
        cp_attention=d.cp_attention,
        expert_load=d.expert_load,
        inference=request.inference,
        grad_bucket_bytes=d.bucket_bytes,
        reduce_dtype=request.reduce_dtype,
        max_grad_norm=request.max_grad_norm,
        zero_units=units,
    )
    solver = SolverReport(
        method=d.method, status=d.status, objective=step, seconds=d.seconds, candidates=d.candidates, gap=d.gap,
        notes=(*d.notes, *_unsupported_note(G)),
    )
    return Plan(
        model=model,
        cluster=cluster.to_dict(),
        mesh=mesh,
        training=training,
        predicted=predicted,
        solver=solver,
        params=params,
        nodes=nodes,
        collectives=collectives,
        stages=stages,
        alternatives=d.alternatives,
        analysis_seconds=timings,
    )


def _single_stage(profile: ModelProfile, captured: CapturedModel, times: Mapping[str, tuple[float, float]],
                  d: Decision) -> Stage:
    calls = [n.name for n in captured.graph_module.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    return Stage(
        index=0, nodes=profile.num_nodes, first_node=calls[0] if calls else "", last_node=calls[-1] if calls else "",
        params=profile.num_params, predicted_time_s=d.step_s, memory_bytes=d.memory.total,
        forward_s=sum(f for f, _ in times.values()), backward_s=sum(b for _, b in times.values()),
        ranks=tuple(range(d.mesh.world_size)), modules=_top_modules(captured),
    )


def _unsupported_note(G: Any) -> tuple[str, ...]:
    from partita.core.tp.strategies import unsupported_ops

    ops = unsupported_ops(G)
    if not ops:
        return ()
    return ("kept replicated (no TP rule): " + ", ".join(f"{op} x{n}" for op, n in sorted(ops.items())),)


def _node_times(G: Any, node: str, d: Decision, cluster: ClusterSpec,
                request: TrainingRequest, act_scale: float) -> tuple[float, float]:
    """Forward and backward compute of one micro-batch of this node on one device, at its strategy's
    share (``G`` is the micro-batch graph; ``act_scale``: its bytes at the precision's element size)."""
    a = G.nodes[node]
    strategy = d.choice.get(node)
    fraction = strategy.compute_fraction if strategy is not None else 1.0
    return node_compute_time(a, cluster, request.precision, scale=fraction, byte_scale=fraction * act_scale,
                             inference=request.inference)


def _param_decisions(captured: CapturedModel, G: Any, d: Decision) -> tuple[ParamDecision, ...]:
    """Each parameter's layout (replicated over dp, its used placeholder's placement over tp, a
    parameter stacked over experts sharded over "ep" by expert where ep > 1: passes/experts.py) and stage."""
    experts = expert_param_names(G) if d.mesh.ep > 1 else frozenset()
    tp_layout: dict[str, str] = {}
    stage: dict[str, int] = {}
    for node, qual in captured.param_nodes.items():
        used = G.out_degree(node) > 0
        if not used and qual in tp_layout:
            continue  # a tied parameter's unused duplicate placeholder
        strategy = d.choice.get(node)
        tp_layout[qual] = strategy.out[0] if strategy is not None else "replicate"
        stage[qual] = d.node_stage.get(node, 0)
    out = []
    for name, (shape, dtype) in captured.params.items():
        layout = {MeshAxis.DP.value: "replicate"}
        if d.mesh.tp > 1:
            layout[MeshAxis.TP.value] = tp_layout.get(name, "replicate")
        if name in experts:
            layout[MeshAxis.EP.value] = "shard(0)"  # rank i of an expert group holds experts [i E/ep, (i+1) E/ep)
        out.append(ParamDecision(name, tuple(shape), str(dtype).replace("torch.", ""), layout,
                                 stage=stage.get(name, 0)))
    return tuple(out)


def _top_modules(captured: CapturedModel) -> tuple[str, ...]:
    """The model's top-level submodules owning parameters, in order (e.g. "transformer", "lm_head")."""
    seen: dict[str, None] = {}
    for name in captured.params:
        seen.setdefault(name.split(".")[0], None)
    return tuple(seen)


def _tied(captured: CapturedModel, G: Any, d: Decision) -> dict[str, tuple[int, ...]]:
    """Parameters read on several pipeline stages -> those stages (``tied_stages``, the runtime's rule)."""
    readers = {n: list(G.successors(n)) for n in captured.param_nodes if n in G}
    return tied_stages(captured.param_nodes, readers, d.node_stage, pp=d.mesh.pp)
