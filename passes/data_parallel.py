"""The data-parallel axis: how many replicas, and how each splits its share of the batch.

Reads a ``ModelProfile`` (FLOPs, saved activations, parameter count), a
``ClusterSpec``, a ``TrainingRequest`` and ``Pins``. Returns a
``DataParallelDecision``: the chosen (dp, micro-batch size, accumulation
steps) and every candidate weighed, each with its predicted memory, step
time, and the reason it lost.

Method: exhaustive enumeration. With tensor and pipeline degrees fixed at 1
the space is dp in {1..devices} dividing the global batch B, times the
micro-batch sizes dividing B / dp: at most a few thousand candidates, each
costed in microseconds, so enumeration is exact and faster than building a
solver model. (The tensor-parallel ILP, where the space is exponential,
uses OR-Tools.)

Objective: minimise predicted step time (cost_model.data_parallel_step);
ties go to the larger micro-batch (fewer, larger kernels), then the larger
dp. Constraint: per-device memory (model state + activations of one
micro-batch) within the device's usable memory.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol, Sequence

from partita.core.buckets import DEFAULT_BUCKET_BYTES, pack_buckets  # noqa: F401 (re-exported)
from partita.core.errors import InfeasibleError, PartitaError
from partita.core.plan import MemoryBreakdown
from partita.passes.cluster import ClusterSpec
from partita.passes.constraints import Pins, TrainingRequest
from partita.passes.cost_model import (
    StepCost,
    data_parallel_step,
    element_bytes,
    model_state_memory,
    state_bytes_per_param,
)

_DTYPE_BYTES = {"torch.float32": 4, "torch.float64": 8, "torch.float16": 2, "torch.bfloat16": 2}


class Profile(Protocol):
    num_params: int
    param_dtype: str
    batch_size: int
    flops_fwd: float
    flops_bwd: float

    def activation_bytes(self, micro_batch: int) -> int: ...

    def live_bytes(self, micro_batch: int) -> int: ...


@dataclass(frozen=True)
class Candidate:
    dp: int
    micro_batch_size: int
    grad_accum_steps: int
    memory: MemoryBreakdown
    cost: StepCost

    @property
    def fits(self) -> bool:
        return self.memory.fits

    @property
    def step_s(self) -> float:
        return self.cost.step_s


@dataclass(frozen=True)
class DataParallelDecision:
    best: Candidate
    candidates: tuple[Candidate, ...]  # every candidate, best first among those that fit
    buckets: tuple[int, ...]  # gradient bucket payloads, bytes
    bucket_bytes: int  # the cap the buckets were packed to
    reasons: dict[tuple[int, int], str]  # (dp, micro_batch) -> why it lost ("" for best)
    seconds: float


def gradient_buckets(numels: Sequence[int], elem_bytes: int, cap_bytes: int = DEFAULT_BUCKET_BYTES) -> list[int]:
    """Bytes of each gradient bucket of parameters of ``numels`` elements (registration order),
    packed by core/buckets.py's ``pack_buckets``, the runtime's rule."""
    sizes = [n * elem_bytes for n in numels]
    return [sum(sizes[i] for i in b) for b in pack_buckets(sizes, cap_bytes)]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def memory_per_device(profile: Profile, request: TrainingRequest, *, dp: int, micro_batch: int, zero_stage: int,
                      capacity: int) -> MemoryBreakdown:
    """Model state under ZeRO ``zero_stage`` over ``dp`` plus the activations of one micro-batch."""
    state = model_state_memory(
        profile.num_params,
        state_bytes_per_param(request.precision, request.optimizer, inference=request.inference),
        zero_stage=zero_stage,
        dp=dp,
    )
    captured = _DTYPE_BYTES.get(profile.param_dtype, 4)
    act = profile.live_bytes(micro_batch) if request.inference else profile.activation_bytes(micro_batch)
    act = round(act * element_bytes(request.precision) / captured)
    return MemoryBreakdown(state.params, state.grads, state.optimizer, act, capacity)


def choose_data_parallel(
    profile: Profile,
    param_numels: Sequence[int],
    cluster: ClusterSpec,
    request: TrainingRequest,
    pins: Pins = Pins(),
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> DataParallelDecision:
    """Enumerate (dp, micro-batch) and pick the fastest that fits; see the module docstring."""
    t0 = time.perf_counter()
    devices = pins.world_size or cluster.world_size
    if pins.world_size and pins.world_size > cluster.world_size:
        raise PartitaError(
            f"{pins.world_size} processes were launched but cluster {cluster.name!r} has "
            f"{cluster.world_size} devices ({cluster.nodes} node(s) x {cluster.gpus_per_node})",
            hint="pass a cluster with enough devices (e.g. --nodes)",
        )
    if pins.tp not in (None, 1):
        raise PartitaError(
            f"--tp {pins.tp}: this planner decides data parallelism only; tensor parallelism arrives "
            "with the (dp, tp) mesh search (passes/tensor_parallel.choose_mesh)",
            hint="drop --tp (or pass --tp 1)",
        )
    if pins.pp not in (None, 1):
        raise PartitaError(
            f"--pp {pins.pp}: this planner decides data parallelism only; pipelines are chosen by "
            "passes/pipeline_parallel.choose_pipeline",
            hint="drop --pp (or pass --pp 1)",
        )
    B = request.global_batch
    if pins.dp is not None:
        if pins.dp > devices:
            raise PartitaError(f"--dp {pins.dp} needs {pins.dp} devices but the cluster has {devices}")
        dps = [pins.dp]
    elif pins.world_size is not None:
        dps = [pins.world_size]  # every launched process is a replica
    else:
        dps = list(range(1, devices + 1))
    bad = [d for d in dps if B % d]
    if len(bad) == len(dps):
        d = dps[0]
        raise PartitaError(
            f"global batch {B} does not divide over dp={d} data-parallel ranks",
            hint=f"use a batch that is a multiple of {d} (e.g. {B + (d - B % d)})",
        )
    dps = [d for d in dps if B % d == 0]

    numels = list(param_numels)
    grad_elem = max(1, int(state_bytes_per_param(request.precision, request.optimizer).grads)) if not request.inference else 0
    buckets = gradient_buckets(numels, grad_elem, bucket_bytes) if grad_elem else []
    flops_per_sample = (profile.flops_fwd + (0 if request.inference else profile.flops_bwd)) / profile.batch_size

    full_state = model_state_memory(
        profile.num_params, state_bytes_per_param(request.precision, request.optimizer, inference=request.inference)
    )
    candidates: list[Candidate] = []
    for dp in dps:
        share = B // dp
        mbs = [pins.micro_batch_size] if pins.micro_batch_size else _divisors(share)
        if pins.grad_accum_steps:
            mbs = [m for m in mbs if m * pins.grad_accum_steps == share]
        for mb in mbs:
            if share % mb:
                continue
            accum = share // mb
            mem = memory_per_device(profile, request, dp=dp, micro_batch=mb, zero_stage=0, capacity=cluster.usable_memory)
            cost = data_parallel_step(
                flops_per_sample=flops_per_sample, micro_batch=mb, grad_accum=accum, dp=dp,
                grad_buckets=buckets, state=full_state, cluster=cluster, precision=request.precision,
            )
            if request.inference:
                cost = StepCost(cost.compute_s, {}, 0.0, {})
            candidates.append(Candidate(dp, mb, accum, mem, cost))
    if not candidates:
        share = B // dps[0]
        raise PartitaError(
            f"no micro-batch split matches the pins: dp={dps[0]} gives {share} samples per rank, "
            f"micro_batch_size={pins.micro_batch_size}, grad_accum_steps={pins.grad_accum_steps}",
            hint="micro_batch_size x grad_accum_steps must equal global batch / dp",
        )
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        raise _infeasible(profile, cluster, request, candidates)
    fitting.sort(key=lambda c: (c.step_s, -c.micro_batch_size, -c.dp))
    best = fitting[0]
    reasons = {(c.dp, c.micro_batch_size): _reason(c, best) for c in candidates}
    ordered = fitting + sorted((c for c in candidates if not c.fits), key=lambda c: c.memory.total)
    return DataParallelDecision(best, tuple(ordered), tuple(buckets), bucket_bytes, reasons, time.perf_counter() - t0)


def _reason(c: Candidate, best: Candidate) -> str:
    if c is best:
        return "chosen: fastest predicted step that fits"
    if not c.fits:
        m = c.memory
        return (f"does not fit: {m.total / 1e9:.2f} GB > {m.capacity / 1e9:.2f} GB usable "
                f"(activations {m.activations / 1e9:.2f} GB at micro-batch {c.micro_batch_size})")
    slower = c.step_s / best.step_s
    parts = []
    if c.cost.compute_s > best.cost.compute_s * 1.001:
        parts.append(f"compute {c.cost.compute_s * 1e3:.3g} ms vs {best.cost.compute_s * 1e3:.3g} ms")
    comm, best_comm = sum(c.cost.comm_s.values()), sum(best.cost.comm_s.values())
    if comm > best_comm * 1.001 + 1e-12:
        parts.append(f"gradient all-reduce {comm * 1e3:.3g} ms vs {best_comm * 1e3:.3g} ms")
    if not parts:
        parts.append("equal time; smaller micro-batch or fewer replicas break the tie")
    return f"{slower:.2f}x slower: " + "; ".join(parts)


def _infeasible(profile: Profile, cluster: ClusterSpec, request: TrainingRequest, candidates: list[Candidate]) -> InfeasibleError:
    least = min(candidates, key=lambda c: (c.memory.total, -c.dp))
    m = least.memory
    gb = 1e9
    zero = []
    for stage in (1, 2, 3):
        z = memory_per_device(profile, request, dp=least.dp, micro_batch=least.micro_batch_size, zero_stage=stage,
                              capacity=cluster.usable_memory)
        zero.append(f"ZeRO-{stage} {z.total / gb:.1f} GB" + (" (fits)" if z.fits else ""))
    return InfeasibleError(
        f"no data-parallel plan fits: the smallest, dp={least.dp} with micro-batch {least.micro_batch_size}, needs "
        f"{m.total / gb:.1f} GB per device (params {m.params / gb:.1f} + grads {m.grads / gb:.1f} + optimizer "
        f"{m.optimizer / gb:.1f} + activations {m.activations / gb:.1f}); budget {m.capacity / gb:.1f} GB "
        f"({cluster.memory_bytes / gb:.0f} GB less {cluster.memory_reserve:.0%} reserve)",
        hint=f"sharding model state would need {', '.join(zero)} over dp={least.dp} (see `partita estimate`), "
        "or tensor / pipeline parallelism (`partita compile` weighs them all); or use devices with more memory, "
        "or a smaller batch per micro-step",
    )
