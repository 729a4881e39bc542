"""Model -> graph -> analyses -> decisions -> Plan: the one compile pipeline.

Both the CLI (`partita compile`) and the decorator call ``compile_model``.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from partita.compiler.capture import CapturedModel, capture
from partita.compiler.inputs import InputSpec
from partita.compiler.plan import (
    Alternative,
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
from partita.passes.cost_model import collective_time, compute_dtype, compute_time
from partita.passes.data_parallel import Candidate, DataParallelDecision, choose_data_parallel
from partita.passes.profile import ModelProfile, profile_model

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
    with phase("solving"):
        numels = [math.prod(shape) for shape, _ in captured.params.values()]
        decision = choose_data_parallel(profile, numels, cluster, request, pins)
        timings["solve"] = decision.seconds
    plan = build_plan(profile, captured, cluster, request, decision, timings)
    return CompileResult(plan, profile, captured)


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
    decision: DataParallelDecision,
    timings: dict[str, float],
) -> Plan:
    """Pack the analyses and decisions into the frozen plan file structure."""
    best = decision.best
    mesh = Mesh(dp=best.dp)
    step = best.step_s
    B = request.global_batch
    flops_per_step = (profile.flops_fwd + (0 if request.inference else profile.flops_bwd)) / profile.batch_size * B
    achieved = flops_per_step / step / mesh.world_size
    peak = cluster.peak_flops(compute_dtype(request.precision))
    predicted = Prediction(
        step_time_s=step,
        compute_s=best.cost.compute_s,
        comm_s=dict(best.cost.comm_s),
        optimizer_s=best.cost.optimizer_s,
        memory=best.memory,
        traffic_bytes=dict(best.cost.traffic_bytes),
        samples_per_s=B / step,
        tokens_per_s=B * profile.seq_len / step if profile.seq_len else None,
        model_tflops_per_device=achieved / 1e12,
        mfu=achieved / peak,
    )
    params = tuple(
        ParamDecision(name, tuple(shape), str(dtype).replace("torch.", ""),
                      {MeshAxis.DP.value: "replicate"}, stage=0)
        for name, (shape, dtype) in captured.params.items()
    )
    collectives = _dp_collectives(decision, cluster, request)
    calls = [n.name for n in captured.graph_module.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    per_sample = 1 / profile.batch_size * best.micro_batch_size
    stage = Stage(
        index=0, nodes=profile.num_nodes, first_node=calls[0] if calls else "", last_node=calls[-1] if calls else "",
        params=profile.num_params, predicted_time_s=step, memory_bytes=best.memory.total,
        forward_s=compute_time(profile.flops_fwd * per_sample, cluster, request.precision),
        backward_s=0.0 if request.inference else compute_time(profile.flops_bwd * per_sample, cluster, request.precision),
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
        micro_batch_size=best.micro_batch_size,
        grad_accum_steps=best.grad_accum_steps,
        precision=request.precision,
        optimizer=request.optimizer,
        zero_stage=0,
        schedule="none",
        inference=request.inference,
        grad_bucket_bytes=decision.bucket_bytes,
    )
    solver = SolverReport(
        method="exhaustive enumeration over (dp, micro-batch size)",
        status="OPTIMAL",
        objective=step,
        seconds=decision.seconds,
        candidates=len(decision.candidates),
        notes=(f"{sum(c.fits for c in decision.candidates)} of {len(decision.candidates)} candidates fit memory",),
    )
    return Plan(
        model=model,
        cluster=cluster.to_dict(),
        mesh=mesh,
        training=training,
        predicted=predicted,
        solver=solver,
        params=params,
        collectives=collectives,
        stages=(stage,),
        alternatives=_alternatives(decision),
        analysis_seconds=timings,
    )


def _top_modules(captured: CapturedModel) -> tuple[str, ...]:
    """The model's top-level submodules owning parameters, in order (e.g. "transformer", "lm_head")."""
    seen: dict[str, None] = {}
    for name in captured.params:
        seen.setdefault(name.split(".")[0], None)
    return tuple(seen)


def _dp_collectives(decision: DataParallelDecision, cluster: ClusterSpec, request: TrainingRequest) -> tuple[Collective, ...]:
    dp = decision.best.dp
    if dp <= 1 or request.inference:
        return ()
    link = cluster.link_for_group(dp)
    by_size: dict[int, int] = {}
    for b in decision.buckets:
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


def _alternatives(decision: DataParallelDecision) -> tuple[Alternative, ...]:
    """The chosen plan, the fastest fitting candidate per dp degree, and the nearest misses on memory."""
    picked: list[Candidate] = [decision.best]
    seen_dp = {decision.best.dp}
    for c in decision.candidates:
        if c.fits and c.dp not in seen_dp:
            picked.append(c)
            seen_dp.add(c.dp)
    same_dp = [c for c in decision.candidates if c.fits and c.dp == decision.best.dp and c is not decision.best]
    picked += same_dp[:2]
    picked += [c for c in decision.candidates if not c.fits][:3]
    picked = picked[:MAX_ALTERNATIVES]
    return tuple(
        Alternative(
            mesh=Mesh(dp=c.dp), micro_batch_size=c.micro_batch_size, grad_accum_steps=c.grad_accum_steps,
            zero_stage=0, step_time_s=c.step_s if c.fits else None, memory_bytes=c.memory.total,
            fits=c.fits, chosen=c is decision.best, reason=decision.reasons[(c.dp, c.micro_batch_size)],
        )
        for c in picked
    )
