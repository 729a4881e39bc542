"""Model -> graph -> analyses -> decisions -> Plan: the one compile pipeline.

Both the CLI (`partita compile`) and the decorator call ``compile_model``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from partita.compiler.capture import CapturedModel, capture
from partita.compiler.errors import PartitaError
from partita.compiler.inputs import InputSpec
from partita.compiler.plan import (
    Collective,
    MeshAxis,
    Mesh,
    ModelInfo,
    ParamDecision,
    Plan,
    Prediction,
    SolverReport,
    Stage,
    Training,
)
from partita.passes.cluster import ClusterSpec
from partita.passes.constraints import Pins, TrainingRequest
from partita.passes.cost_model import collective_time, compute_dtype, compute_time, element_bytes
from partita.passes.profile import ModelProfile, profile_model
from partita.passes.tensor_parallel import MeshDecision, choose_mesh, plan_alternatives
from partita.passes.tp_layout import layout_decisions, tp_collectives

MAX_ALTERNATIVES = 12


@dataclass(frozen=True)
class CompileResult:
    plan: Plan
    profile: ModelProfile
    captured: CapturedModel


def default_precision(cluster: ClusterSpec) -> str:
    """bf16 mixed precision on GPUs, fp32 on CPU processes (gloo has no fast bf16 matmul)."""
    return "fp32" if cluster.device == "cpu" else "bf16-mixed"


def compile_model(
    model: torch.nn.Module | Callable[[], torch.nn.Module],
    inputs: Sequence[InputSpec],
    cluster: ClusterSpec,
    *,
    global_batch: int | None = None,
    precision: str | None = None,
    optimizer: str = "adamw",
    inference: bool = False,
    pins: Pins = Pins(),
    name: str | None = None,
    loss: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
    targets: InputSpec | None = None,
    progress: Any = None,
) -> CompileResult:
    """Capture ``model`` on ``inputs``, analyse it, decide a plan for ``cluster``.

    For training the loss (default: cross-entropy) is captured with the model,
    so its ops are analysed and laid out too; ``targets`` defaults to what the
    model's output implies. ``global_batch`` defaults to the leading dimension
    of the first input. ``progress`` is an optional rich ``Progress``.
    """
    timings: dict[str, float] = {}
    phase = _phases(progress)
    if not inference and loss is None:
        from partita.compiler.api import default_loss

        loss = default_loss
    with phase("capturing the model"):
        captured = capture(model, inputs, name=name, loss=None if inference else loss, targets=targets)
    timings["capture"] = captured.seconds
    with phase("analysing the graph"):
        t0 = time.perf_counter()
        profile = profile_model(captured)
        timings["analysis"] = time.perf_counter() - t0
    request = TrainingRequest(
        global_batch=global_batch or profile.batch_size,
        precision=precision or default_precision(cluster),
        optimizer="none" if inference else optimizer,
        inference=inference,
    )
    if pins.pp not in (None, 1):
        raise PartitaError(f"--pp {pins.pp}: the planner does not yet place pipeline stages on this path",
                           hint="drop --pp (or pass --pp 1)")
    with phase("solving"):
        numels = [math.prod(shape) for shape, _ in captured.params.values()]
        decision = choose_mesh(profile, numels, cluster, request, pins)
        timings["solve"] = decision.seconds
    with phase("laying out the micro-batch graph"):
        t0 = time.perf_counter()
        micro = micro_batch_graph(model, captured, profile, decision.micro_batch_size, loss=loss)
        timings["layout"] = time.perf_counter() - t0
    plan = build_plan(profile, captured, cluster, request, decision, timings, micro_graph=micro)
    return CompileResult(plan, profile, captured)


def micro_batch_graph(model: Any, captured: CapturedModel, profile: ModelProfile, micro_batch: int, *,
                      loss: Callable[..., Any] | None) -> Any:
    """The graph the runtime runs: the same model captured at the micro-batch shape.

    Node decisions (their tensors' bytes, their shard sizes) are for what one
    rank executes per micro-batch, so they are laid out on this graph; its node
    names must be the captured graph's, which is checked.
    """
    if micro_batch == profile.batch_size:
        return profile.graph
    from partita.passes.flops import annotate_flops
    from partita.passes.graph import to_networkx

    def at(spec: InputSpec) -> InputSpec:
        return dataclasses.replace(spec, shape=(micro_batch, *spec.shape[1:]))

    small = capture(model, [at(s) for s in captured.inputs], name=captured.name, loss=loss if captured.loss else None,
                    targets=at(captured.targets) if captured.targets is not None else None)
    G = annotate_flops(to_networkx(small))
    if list(G.nodes) != list(profile.graph.nodes):
        raise RuntimeError(
            f"capturing {captured.name} at micro-batch {micro_batch} gave another graph than at batch "
            f"{profile.batch_size} ({len(G)} vs {len(profile.graph)} nodes): its structure depends on the batch size"
        )
    for n, a in profile.graph.nodes(data=True):  # keep the analyses' layer tags for the plan
        if "layer" in a:
            G.nodes[n]["layer"] = a["layer"]
    return G


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
    decision: MeshDecision,
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
        compute_s=d.cost.compute_s,
        comm_s={k: v for k, v in d.cost.comm_s.items() if v > 0},
        optimizer_s=d.cost.optimizer_s,
        memory=d.memory,
        traffic_bytes=dict(d.cost.traffic_bytes),
        samples_per_s=B / step,
        tokens_per_s=B * profile.seq_len / step if profile.seq_len else None,
        model_tflops_per_device=achieved / 1e12,
        mfu=achieved / peak,
    )
    Gm = micro_graph if micro_graph is not None else G
    _check_strategies(Gm, d)
    nodes = tuple(
        dataclasses.replace(n, compute_s=_node_compute_s(Gm, n.name, d, cluster, request))
        for n in layout_decisions(Gm, d.tp, d.choice, elem_bytes=element_bytes(request.precision))
    )
    params = _param_decisions(captured, G, d)
    collectives = _dp_collectives(d, cluster, request) + _tp_plan_collectives(nodes, d, cluster)
    calls = [n.name for n in captured.graph_module.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    stage = Stage(
        index=0, nodes=profile.num_nodes, first_node=calls[0] if calls else "", last_node=calls[-1] if calls else "",
        params=profile.num_params, predicted_time_s=step, memory_bytes=d.memory.total,
        forward_s=sum(_fwd_share(Gm, n.name) * n.compute_s for n in nodes),
        backward_s=sum((1 - _fwd_share(Gm, n.name)) * n.compute_s for n in nodes),
        ranks=tuple(range(mesh.world_size)),
        modules=_top_modules(captured),
    )
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
        zero_stage=0,
        schedule="none",
        inference=request.inference,
        grad_bucket_bytes=d.bucket_bytes,
    )
    fitting = sum(c.fits for c in d.alternatives)
    solver = SolverReport(
        method=f"(tp, micro-batch) enumeration; tensor-parallel ILP per candidate ({d.solver.solver}, "
               f"{d.solver.classes} node classes, repeated layers tied)",
        status=d.solver.status,
        objective=step,
        seconds=d.seconds,
        candidates=len(d.alternatives),
        gap=d.solver.gap,
        notes=(f"{fitting} of {len(d.alternatives)} candidates fit memory; {d.solves} ILPs solved",
               f"TP group on {d.tp_link}, DP group on {d.dp_link}",
               *_unsupported_note(G)),
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
        stages=(stage,),
        alternatives=plan_alternatives(d),
        analysis_seconds=timings,
    )


def _unsupported_note(G: Any) -> tuple[str, ...]:
    from partita.passes.tp_strategies import unsupported_ops

    ops = unsupported_ops(G)
    if not ops:
        return ()
    return ("kept replicated (no TP rule): " + ", ".join(f"{op} x{n}" for op, n in sorted(ops.items())),)


def _fwd_share(G: Any, node: str) -> float:
    a = G.nodes[node]
    total = a.get("flops_fwd", 0) + a.get("flops_bwd", 0)
    return a.get("flops_fwd", 0) / total if total else 1.0


def _check_strategies(G: Any, d: MeshDecision) -> None:
    """Every chosen strategy must be one the micro-batch graph offers (its shards must divide there too)."""
    if d.tp <= 1:
        return
    from partita.passes.tp_strategies import node_strategies

    for n, s in d.choice.items():
        offered = node_strategies(G, n, d.tp)
        if not any(o.name == s.name and o.ins == s.ins and o.out == s.out for o in offered):
            raise RuntimeError(f"node {n}: strategy {s.name!r} chosen at the full batch is not valid at micro-batch "
                               f"{d.micro_batch_size} (its shards do not divide there)")


def _node_compute_s(G: Any, node: str, d: MeshDecision, cluster: ClusterSpec, request: TrainingRequest) -> float:
    """Forward + backward compute of one micro-batch of this node on one device, at its strategy's share
    (``G`` is the micro-batch graph)."""
    a = G.nodes[node]
    flops = a.get("flops_fwd", 0) + (0 if request.inference else a.get("flops_bwd", 0))
    strategy = d.choice.get(node)
    fraction = strategy.compute_fraction if strategy is not None else 1.0
    return compute_time(flops * fraction, cluster, request.precision)


def _param_decisions(captured: CapturedModel, G: Any, d: MeshDecision) -> tuple[ParamDecision, ...]:
    """Each parameter's layout: replicated over dp, its placeholder's chosen placement over tp."""
    tp_layout: dict[str, str] = {}
    for node, qual in captured.param_nodes.items():
        if G.out_degree(node) == 0 and qual in tp_layout:
            continue  # a tied parameter's unused duplicate placeholder
        strategy = d.choice.get(node)
        if G.out_degree(node) > 0 or qual not in tp_layout:
            tp_layout[qual] = strategy.out[0] if strategy is not None else "replicate"
    out = []
    for name, (shape, dtype) in captured.params.items():
        layout = {MeshAxis.DP.value: "replicate"}
        if d.tp > 1:
            layout[MeshAxis.TP.value] = tp_layout.get(name, "replicate")
        out.append(ParamDecision(name, tuple(shape), str(dtype).replace("torch.", ""), layout, stage=0))
    return tuple(out)


def _top_modules(captured: CapturedModel) -> tuple[str, ...]:
    """The model's top-level submodules owning parameters, in order (e.g. "transformer", "lm_head")."""
    seen: dict[str, None] = {}
    for name in captured.params:
        seen.setdefault(name.split(".")[0], None)
    return tuple(seen)


def _dp_collectives(d: MeshDecision, cluster: ClusterSpec, request: TrainingRequest) -> tuple[Collective, ...]:
    dp = d.dp
    if dp <= 1 or request.inference:
        return ()
    link = cluster.link_for_group(dp, stride=d.tp)
    by_size: dict[int, int] = {}
    for b in d.buckets:
        by_size[b] = by_size.get(b, 0) + 1
    grads = tuple(
        Collective(kind="all_reduce", axis=MeshAxis.DP.value, bytes=size, count=count, group_size=dp,
                   purpose="gradient averaging (one bucket per call, after the last micro-batch)",
                   seconds=count * collective_time("all_reduce", size, dp, link))
        for size, count in by_size.items()
    )
    loss = Collective(kind="all_reduce", axis=MeshAxis.DP.value, bytes=4, count=1, group_size=dp,
                      purpose="loss averaging (the step's loss, same on every rank)",
                      seconds=collective_time("all_reduce", 4, dp, link))
    return grads + (loss,)


def _tp_plan_collectives(nodes: Sequence[Any], d: MeshDecision, cluster: ClusterSpec) -> tuple[Collective, ...]:
    """The TP collectives of one micro-batch (tp_collectives), times the accumulation steps."""
    if d.tp <= 1:
        return ()
    link = cluster.link_for_group(d.tp)
    return tuple(
        Collective(kind=kind, axis=MeshAxis.TP.value, bytes=nbytes, count=calls * d.grad_accum_steps,
                   group_size=d.tp, purpose=purpose,
                   seconds=calls * d.grad_accum_steps * collective_time(kind, nbytes, d.tp, link))
        for kind, nbytes, calls, purpose in tp_collectives(nodes)
    )
