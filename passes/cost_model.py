"""The one cost model: memory arithmetic, compute time and collective time.

Every solver and every prediction in a plan calls these functions; no solver
carries its own copy of a formula. Sources are in shared/REFERENCE.md.

Memory (ZeRO, Rajbhandari et al. SC'20). For Psi parameters, data-parallel
degree Nd, and per-parameter bytes p (weights), g (gradients), k (optimizer
state, fp32 master weights included under mixed precision):

    ZeRO-0: (p + g + k) Psi          ZeRO-2: p Psi + (g + k) Psi / Nd
    ZeRO-1: (p + g) Psi + k Psi / Nd  ZeRO-3: (p + g + k) Psi / Nd

Mixed-precision Adam is p = g = 2, k = 12 (16 bytes/param); fp32 Adam is
p = g = 4, k = 8 (also 16).

Time. Compute is FLOPs / (peak FLOP/s of the dtype x efficiency).
Collectives follow the alpha-beta ring model, S bytes over n ranks on the
slowest link of the group (bandwidth beta per device, latency alpha):

    all-reduce:                   2 (n - 1) alpha + 2 S (n - 1) / n / beta
    all-gather, reduce-scatter,
    all-to-all (S = full array):  (n - 1) alpha + S (n - 1) / n / beta
    broadcast, send/recv:         alpha + S / beta

The optimizer step is memory-bound: it is costed as reading and writing the
device's model state once at HBM bandwidth (an assumption, stated here).
Gradient all-reduce is costed as fully exposed (no overlap with backward), so
predicted step times are upper bounds on that term.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from partita.passes.cluster import ClusterSpec, Link

PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16")
OPTIMIZERS = ("adamw", "adam", "sgd", "sgd-momentum", "none")


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of model state."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def compute_dtype(precision: str) -> str:
    """The dtype matmuls run in under ``precision``."""
    return {"fp32": "fp32", "bf16-mixed": "bf16", "fp16-mixed": "fp16", "bf16": "bf16"}[precision]


def element_bytes(precision: str) -> int:
    """Bytes of one activation / weight / gradient element under ``precision``."""
    return 4 if precision == "fp32" else 2


def state_bytes_per_param(precision: str, optimizer: str, *, inference: bool = False) -> StateBytes:
    """Model-state bytes per parameter for a precision and optimizer.

    Mixed precision keeps fp32 master weights, counted with the optimizer
    state as the ZeRO paper's K does (K = 12 for Adam: master, m, v).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer {optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
    w = element_bytes(precision)
    if inference:
        return StateBytes(w, 0, 0)
    master = 4 if precision in ("bf16-mixed", "fp16-mixed") else 0
    moments = {"adamw": 8, "adam": 8, "sgd": 0, "sgd-momentum": 4, "none": 0}[optimizer]
    return StateBytes(w, w, master + moments)


@dataclass(frozen=True)
class ModelStateMemory:
    """Bytes of model state held by one device."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def model_state_memory(num_params: int, state: StateBytes, *, zero_stage: int = 0, dp: int = 1) -> ModelStateMemory:
    """Per-device model state under ZeRO stage 0-3 over ``dp`` ranks (formulas in the module docstring)."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage} must be 0, 1, 2 or 3")
    if dp < 1:
        raise ValueError(f"dp={dp} must be at least 1")
    p = num_params * state.params / (dp if zero_stage >= 3 else 1)
    g = num_params * state.grads / (dp if zero_stage >= 2 else 1)
    o = num_params * state.optimizer / (dp if zero_stage >= 1 else 1)
    return ModelStateMemory(round(p), round(g), round(o))


def max_params_fitting(memory_bytes: float, state: StateBytes) -> float:
    """The largest parameter count whose model state fits ``memory_bytes`` (no activations)."""
    return memory_bytes / state.total


# -- time --------------------------------------------------------------------


def compute_time(flops: float, cluster: ClusterSpec, precision: str) -> float:
    """Seconds to run ``flops`` on one device at the cluster's achieved rate."""
    return flops / (cluster.peak_flops(compute_dtype(precision)) * cluster.efficiency)


COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")


def collective_time(kind: str, nbytes: float, n: int, link: Link) -> float:
    """Alpha-beta time of one collective of ``nbytes`` (the full array) over ``n`` ranks."""
    if kind not in COLLECTIVES:
        raise ValueError(f"unknown collective {kind!r}")
    if kind in ("broadcast", "send_recv"):
        return link.latency + nbytes / link.bandwidth
    if n <= 1:
        return 0.0
    frac = (n - 1) / n
    if kind == "all_reduce":
        return 2 * (n - 1) * link.latency + 2 * nbytes * frac / link.bandwidth
    return (n - 1) * link.latency + nbytes * frac / link.bandwidth


def reshard_time(kind: str, nbytes: float, n: int, link: Link) -> float:
    """Time of one tensor-parallel reshard (passes/tp_strategies.reshard_kind) of a tensor of
    ``nbytes`` (its whole size) over ``n`` ranks. "none" and "slice" are local and free."""
    if kind in ("none", "slice"):
        return 0.0
    if kind == "invalid":
        raise ValueError("an invalid reshard has no cost; the strategy must not ask for it")
    return collective_time(kind, nbytes, n, link)


def collective_traffic(kind: str, nbytes: float, n: int) -> float:
    """Bytes one rank sends in one ring collective of ``nbytes`` over ``n`` ranks."""
    if kind in ("broadcast", "send_recv"):
        return nbytes
    if n <= 1:
        return 0.0
    frac = (n - 1) / n
    return 2 * nbytes * frac if kind == "all_reduce" else nbytes * frac


def zero_traffic_elements(num_params: int, zero_stage: int, dp: int) -> float:
    """Elements one rank sends per step for its model state under ZeRO over ``dp`` ranks.

    Stages 0-2: gradient all-reduce (or reduce-scatter + parameter all-gather)
    = 2 Psi (n-1)/n. Stage 3: parameters all-gathered for forward and again for
    backward, gradients reduce-scattered = 3 Psi (n-1)/n, 1.5x data parallel.
    """
    if dp <= 1:
        return 0.0
    factor = 3 if zero_stage == 3 else 2
    return factor * num_params * (dp - 1) / dp


def optimizer_time(state: ModelStateMemory, cluster: ClusterSpec) -> float:
    """The optimizer step reads and writes the device's model state once (memory-bound)."""
    return 2 * state.total / cluster.hbm_bandwidth


@dataclass(frozen=True)
class StepCost:
    """Predicted time of one training step on one device, and what it sends."""

    compute_s: float
    comm_s: Mapping[str, float]
    optimizer_s: float
    traffic_bytes: Mapping[str, int] = field(default_factory=dict)

    @property
    def step_s(self) -> float:
        return self.compute_s + sum(self.comm_s.values()) + self.optimizer_s


def data_parallel_step(
    *,
    flops_per_sample: float,
    micro_batch: int,
    grad_accum: int,
    dp: int,
    grad_buckets: list[int],
    state: ModelStateMemory,
    cluster: ClusterSpec,
    precision: str,
) -> StepCost:
    """One data-parallel step: ``grad_accum`` micro-batches of forward+backward, then one
    all-reduce per gradient bucket over the dp group, then the optimizer.

    ``flops_per_sample`` is forward + backward FLOPs of one sample;
    ``grad_buckets`` the bytes of each gradient bucket the runtime all-reduces.
    """
    per_micro = compute_time(flops_per_sample * micro_batch, cluster, precision) + cluster.step_overhead_s
    compute = grad_accum * per_micro
    link = cluster.link_for_group(dp)
    comm = sum(collective_time("all_reduce", b, dp, link) for b in grad_buckets) if dp > 1 else 0.0
    traffic = sum(collective_traffic("all_reduce", b, dp) for b in grad_buckets) if dp > 1 else 0.0
    return StepCost(
        compute_s=compute,
        comm_s={"dp_all_reduce": comm} if dp > 1 else {},
        optimizer_s=optimizer_time(state, cluster),
        traffic_bytes={"dp_all_reduce": round(traffic)} if dp > 1 else {},
    )


def mesh_step(
    *,
    micro_batch_s: Mapping[str, float],
    grad_accum: int,
    dp: int,
    tp: int,
    grad_buckets: list[int],
    state: ModelStateMemory,
    cluster: ClusterSpec,
) -> StepCost:
    """One step on a (dp, tp) mesh: ``grad_accum`` micro-batches, then one all-reduce per
    gradient bucket of the device's LOCAL parameter shards over the dp group, then the optimizer.

    ``micro_batch_s`` is one micro-batch's forward+backward on one device, by part:
    ``"compute"`` (local FLOPs) and tensor-parallel communication (``"tp_forward"``,
    ``"tp_backward"``, ``"tp_internal"``), as the TP solver predicts them. The dp group's
    ranks lie ``tp`` apart (TP innermost, compiler/plan.MESH_ORDER), so its link is
    ``link_for_group(dp, stride=tp)``.
    """
    per_micro = dict(micro_batch_s)
    compute = grad_accum * (per_micro.pop("compute", 0.0) + cluster.step_overhead_s)
    comm = {k: grad_accum * v for k, v in per_micro.items() if v}
    traffic: dict[str, int] = {}
    if dp > 1 and grad_buckets:
        link = cluster.link_for_group(dp, stride=tp)
        comm["dp_all_reduce"] = sum(collective_time("all_reduce", b, dp, link) for b in grad_buckets)
        traffic["dp_all_reduce"] = round(sum(collective_traffic("all_reduce", b, dp) for b in grad_buckets))
    return StepCost(compute_s=compute, comm_s=comm, optimizer_s=optimizer_time(state, cluster), traffic_bytes=traffic)
