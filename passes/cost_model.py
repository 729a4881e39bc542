"""The one cost model: memory arithmetic, compute time and collective time.

Every solver and every prediction in a plan calls these functions; no solver
carries its own copy of a formula. The formulas, their assumptions and how the solvers
use them: docs/cost-model.md ("Model-state memory", "Compute time", "Collectives",
"ZeRO's collectives", "The pipeline step"); their published sources and the fits: docs/references.md.

- memory: ``state_bytes_per_param`` (bytes per parameter of weights, gradients and
  optimizer state, fp32 masters counted with the optimizer as ZeRO's K), and
  ``sharded_state`` / ``model_state_memory`` under ZeRO 0-3 over dp ranks; what a step
  allocates beyond the state is passes/peak_memory.py's ("Memory at the step's peak");
- time: ``op_time`` / ``node_compute_time`` (an op's FLOPs at the achieved rate or its bytes at
  the achieved bandwidth, plus a per-kernel cost, never less than the host's launch;
  ``precision_factor``: what autocast keeps in fp32), ``collective_time`` (the alpha-beta ring
  model on the group's slowest link, plus a cost per call) and ``reshard_time``;
- ZeRO: ``zero_collectives`` (the one list of runtime/dp/zero.py's calls per step, which
  traffic and time both read), ``zero_step_comm``, ``zero_optimizer_time``,
  ``param_step_time``;
- steps: ``mesh_step`` (a (dp, tp) mesh) and ``pipeline_step`` (a pipeline).

Assumptions: the optimizer step is memory-bound (the device's model state read and
written once at HBM bandwidth); collectives are exposed (no overlap with backward), so
predicted step times are upper bounds on those terms.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from partita.core.cluster import COLLECTIVES, ClusterSpec, Link
from partita.core.model.ops import ATTENTION, base_op
from partita.core.optimizers import NO_OFFLOAD
from partita.core.plans.plan import OPTIMIZERS
from partita.core.precision import PRECISIONS, compute_dtype, element_bytes, keeps_masters, wire_bytes


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of model state."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


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
    master = 4 if keeps_masters(precision) else 0
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


ZERO_STAGES = (0, 1, 2, 3)


def sharded_state(state: StateBytes, zero_stage: int = 0, dp: int = 1) -> StateBytes:
    """Bytes per parameter held by one device under ZeRO ``zero_stage`` over ``dp`` ranks:
    optimizer state / dp from stage 1, gradients / dp from 2, parameters / dp at 3."""
    if zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage={zero_stage} must be 0, 1, 2 or 3")
    if dp < 1:
        raise ValueError(f"dp={dp} must be at least 1")
    return StateBytes(state.params / (dp if zero_stage >= 3 else 1), state.grads / (dp if zero_stage >= 2 else 1),
                      state.optimizer / (dp if zero_stage >= 1 else 1))


def model_state_memory(num_params: int, state: StateBytes, *, zero_stage: int = 0, dp: int = 1) -> ModelStateMemory:
    """Per-device model state under ZeRO stage 0-3 over ``dp`` ranks (docs/cost-model.md, "Model-state memory")."""
    s = sharded_state(state, zero_stage, dp)
    return ModelStateMemory(round(num_params * s.params), round(num_params * s.grads), round(num_params * s.optimizer))


# -- time --------------------------------------------------------------------


def compute_time(flops: float, cluster: ClusterSpec, precision: str, nbytes: float = 0.0) -> float:
    """Seconds to run ``flops`` on one device at the cluster's achieved rate; on a roofline cluster
    (``ClusterSpec.roofline``) an op that moves ``nbytes`` takes at least their time at the achieved
    memory bandwidth (an elementwise op, a softmax, a norm: bound by bytes, not FLOPs)."""
    t = flops / (cluster.peak_flops(compute_dtype(precision)) * cluster.efficiency)
    return max(t, nbytes / memory_rate(cluster)) if cluster.roofline else t


def memory_rate(cluster: ClusterSpec) -> float:
    """Bytes/s a memory-bound op or the optimizer achieves: the HBM's peak times ``memory_efficiency``."""
    return cluster.hbm_bandwidth * cluster.memory_efficiency


def op_time(flops: float, nbytes: float, kernels: int, cluster: ClusterSpec, precision: str, *,
            attention: bool = False) -> float:
    """Seconds one pass of one op takes on one device (docs/cost-model.md, "Compute time"): its
    FLOPs at the achieved rate (``attention_efficiency`` for attention kernels) or, on a roofline
    cluster, its bytes at the achieved bandwidth, whichever is longer, plus ``kernel_s`` per kernel
    (the latency and last-wave tail that make a small GEMM reach less of the peak than a large one:
    a GEMM of F FLOPs runs at efficiency x F / (F + F_half), F_half = the rate x ``kernel_s``);
    and never less than the host's ``launch_s`` per kernel (a step of many small ops waits on the
    host that issues them)."""
    if not (flops or nbytes or kernels):
        return 0.0
    efficiency = cluster.attention_efficiency if attention and cluster.attention_efficiency else cluster.efficiency
    t = flops / (cluster.peak_flops(compute_dtype(precision)) * efficiency)
    if cluster.roofline:
        t = max(t, nbytes / memory_rate(cluster))
    return max(t + kernels * cluster.kernel_s, kernels * cluster.launch_s)


# The per-node attributes node_compute_time reads (passes/flops.py writes them)
NODE_TIME_ATTRS = ("flops_fwd", "flops_bwd", "bytes_fwd", "bytes_bwd", "kernels_fwd", "kernels_bwd", "op")


def node_compute_time(a: Mapping[str, Any], cluster: ClusterSpec, precision: str, *, scale: float,
                      byte_scale: float, inference: bool = False) -> tuple[float, float]:
    """(forward, backward) seconds of one graph node (its ``NODE_TIME_ATTRS``: ``flops_fwd`` /
    ``flops_bwd``, ``bytes_fwd`` / ``bytes_bwd`` and ``kernels_fwd`` / ``kernels_bwd``,
    passes/flops.py) on one device (``op_time``): FLOPs times ``scale`` (the micro-batch over the
    captured batch, a strategy's share), bytes times ``byte_scale`` (the same, at the precision's
    element size; fp32's where autocast keeps the op in fp32, ``precision_factor``); no backward
    for inference. The one per-node compute rule of the TP costs, the pipeline costs and the
    plan's record."""
    op = a.get("op", "")
    attention = base_op(op) in ATTENTION
    byte_scale *= precision_factor(op, precision, cluster.device)
    fwd = op_time(a.get("flops_fwd", 0) * scale, a.get("bytes_fwd", 0) * byte_scale, a.get("kernels_fwd", 0),
                  cluster, precision, attention=attention)
    bwd = 0.0 if inference else op_time(a.get("flops_bwd", 0) * scale, a.get("bytes_bwd", 0) * byte_scale,
                                        a.get("kernels_bwd", 0), cluster, precision, attention=attention)
    return fwd, bwd


# Ops autocast runs in fp32 under a 16-bit policy, as a captured graph names them: their saved tensors,
# temporaries and traffic stay fp32 (4 bytes an element) where the rest take the precision's size.
# From torch's autocast op reference, "CUDA Ops that can autocast to float32" and "CPU Ops that can
# autocast to float32" (docs/references.md); the runtime's forward runs under the policy's autocast.
AUTOCAST_FP32 = {
    "cuda": frozenset({
        "layer_norm", "native_layer_norm", "group_norm", "native_group_norm", "softmax", "_softmax",
        "log_softmax", "_log_softmax", "cross_entropy_loss", "nll_loss", "nll_loss_forward", "nll_loss2d",
        "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div", "binary_cross_entropy_with_logits",
        "exp", "expm1", "log", "log10", "log1p", "log2", "pow", "rsqrt", "reciprocal", "softplus", "cumsum",
        "cumprod", "prod", "sum", "norm", "cosine_similarity", "logsumexp", "erfinv", "acos", "asin", "cosh",
        "sinh", "tan", "renorm", "dist", "cdist", "pdist",
    }),
    "cpu": frozenset({
        "cross_entropy_loss", "nll_loss", "nll_loss_forward", "nll_loss2d", "mse_loss", "smooth_l1_loss",
        "huber_loss", "kl_div", "binary_cross_entropy", "binary_cross_entropy_with_logits", "prod", "cdist",
        "margin_ranking_loss", "soft_margin_loss", "multi_margin_loss", "poisson_nll_loss",
    }),
}


@functools.lru_cache(maxsize=4096)  # a pure function of three names, asked per node in the cut search's loop
def precision_factor(op: str, precision: str, device: str) -> float:
    """How much more a node's floating tensors weigh than the precision's element size says: 4 /
    that size for an op autocast on ``device`` runs in fp32 under a 16-bit ``precision`` (a layer
    norm saves its fp32 input copy, a cross-entropy its fp32 log-softmax), 1 otherwise."""
    size = element_bytes(precision)
    return 4 / size if size < 4 and base_op(op) in AUTOCAST_FP32.get(device, frozenset()) else 1.0


def collective_time(kind: str, nbytes: float, n: int, link: Link) -> float:
    """Time of one collective of ``nbytes`` (the full array) over ``n`` ranks: its alpha-beta time
    (docs/references.md) plus the link's fixed cost of one call of that kind (``Link.call_s``)."""
    if kind not in COLLECTIVES:
        raise ValueError(f"unknown collective {kind!r}")
    if kind in ("broadcast", "send_recv"):
        return link.call_s(kind) + link.latency + nbytes / link.bandwidth
    if n <= 1:
        return 0.0
    frac = (n - 1) / n
    if kind == "all_reduce":
        return link.call_s(kind) + 2 * (n - 1) * link.latency + 2 * nbytes * frac / link.bandwidth
    return link.call_s(kind) + (n - 1) * link.latency + nbytes * frac / link.bandwidth


def reshard_time(kind: str, nbytes: float, n: int, link: Link) -> float:
    """Time of one tensor-parallel reshard (core/tp/vocabulary.reshard_kind) of a tensor of
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


def zero_collectives(zero_stage: int, micro_batches: int = 1) -> tuple[tuple[str, int, str], ...]:
    """The collectives ZeRO ``zero_stage`` runs per step over each bucket, as (kind, calls, what):
    runtime/dp/zero.py's counts (docs/runtime.md, "ZeRO at run time"). Stage 0 is plain data parallelism."""
    if zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage={zero_stage} must be 0, 1, 2 or 3")
    if micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches} must be at least 1")
    m = micro_batches
    return {
        0: (("all_reduce", 1, "grads"),),
        1: (("reduce_scatter", 1, "grads"), ("all_gather", 1, "params")),
        2: (("reduce_scatter", m, "grads"), ("all_gather", 1, "params")),
        3: (("all_gather", 2 * m, "params"), ("reduce_scatter", m, "grads")),
    }[zero_stage]


def zero_traffic_elements(num_params: int, zero_stage: int, dp: int, micro_batches: int = 1) -> float:
    """Elements one rank sends per step for its model state under ZeRO over ``dp`` ranks.

    Stage 0: gradient all-reduce = 2 Psi (n-1)/n. Stage 1: reduce-scatter +
    parameter all-gather = 2 Psi (n-1)/n whatever the accumulation. Stage 2:
    a reduce-scatter per micro-batch, (m + 1) Psi (n-1)/n. Stage 3: per
    micro-batch two all-gathers (forward, backward) and a reduce-scatter,
    3 m Psi (n-1)/n. At m = 1: 2, 2, 2, 3 Psi, ZeRO-3 1.5x data parallel.
    """
    if dp <= 1:
        return 0.0
    calls = sum(n * (2 if kind == "all_reduce" else 1) for kind, n, _ in zero_collectives(zero_stage, micro_batches))
    return calls * num_params * (dp - 1) / dp


def padded_bucket(nbytes: float, dp: int, elem_bytes: int) -> float:
    """A ZeRO bucket's bytes padded to a multiple of ``dp`` elements (runtime/dp/zero.py)."""
    numel = math.ceil(nbytes / elem_bytes)
    return math.ceil(numel / dp) * dp * elem_bytes


@dataclass(frozen=True)
class ZeroComm:
    """One step's data-parallel collectives of one rank under a ZeRO stage, by kind."""

    seconds: Mapping[str, float]  # "dp_all_reduce" (stage 0) or "zero_reduce_scatter" / "zero_all_gather"
    traffic_bytes: Mapping[str, int]

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())

    @property
    def total_bytes(self) -> int:
        return sum(self.traffic_bytes.values())


def zero_step_comm(zero_stage: int, buckets: Sequence[float], dp: int, micro_batches: int, link: Link, *,
                   elem_bytes: int, reduce_dtype: str) -> ZeroComm:
    """Time and bytes sent per step by one rank for its buckets (bytes of its LOCAL parameters'
    gradients as held, ``elem_bytes`` an element, one flat bucket each, as passes/dp/buckets.gradient_buckets
    packs them) over ``dp`` ranks on ``link``: ``zero_collectives`` calls per bucket, each exposed
    (docs/cost-model.md, "ZeRO's collectives": the runtime prefetches ZeRO-3's units, the model does
    not count it hidden), gradients sent in ``reduce_dtype`` (core/precision.py ``wire_bytes``).
    ZeRO buckets are padded to a multiple of dp elements; stage 0's all-reduce is not."""
    if dp <= 1 or not buckets:
        return ZeroComm({}, {})
    seconds: dict[str, float] = {}
    traffic: dict[str, float] = {}
    for kind, calls, what in zero_collectives(zero_stage, micro_batches):
        key = "dp_all_reduce" if kind == "all_reduce" else f"zero_{kind}"
        for b in buckets:
            held = b if zero_stage == 0 else padded_bucket(b, dp, elem_bytes)
            size = held * wire_bytes(what, elem_bytes, reduce_dtype) / elem_bytes
            seconds[key] = seconds.get(key, 0.0) + calls * collective_time(kind, size, dp, link)
            traffic[key] = traffic.get(key, 0.0) + calls * collective_traffic(kind, size, dp)
    return ZeroComm(seconds, {k: round(v) for k, v in traffic.items()})


def zero_optimizer_time(num_params: float, state: StateBytes, zero_stage: int, dp: int, cluster: ClusterSpec) -> float:
    """The optimizer's memory-bound pass over the state it updates: all of it at stage 0, the
    rank's 1/dp slice (of every part of the state) under ZeRO >= 1."""
    share = num_params / dp if zero_stage >= 1 else num_params
    return 2 * share * state.total / cluster.hbm_bandwidth


def offloaded_state(state: StateBytes, offload: str, precision: str) -> tuple[StateBytes, float]:
    """(bytes per parameter on the device, in host memory) under ``offload`` (core/optimizers.py): the
    optimizer's state and masters move to the host, which keeps a copy of parameters that are their
    own masters (fp32, pure bf16) as the masters."""
    if offload == NO_OFFLOAD:
        return state, 0.0
    host = state.optimizer + (0.0 if keeps_masters(precision) else state.params)
    return StateBytes(state.params, state.grads, 0.0), host


def offload_step_time(numel: float, state: StateBytes, host_bytes: float, cluster: ClusterSpec) -> float:
    """One optimizer step over ``numel`` parameters with the state on the host (``offloaded_state``):
    gradients down and parameters back up at ``host_bandwidth``, the host's pass (masters and state
    read and written, gradients read) at ``host_memory_bandwidth``; none of it overlaps backward."""
    if cluster.host_bandwidth <= 0 or cluster.host_memory_bandwidth <= 0:
        return math.inf
    link = numel * (state.grads + state.params) / cluster.host_bandwidth
    return link + numel * (2 * host_bytes + state.grads) / cluster.host_memory_bandwidth


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


def param_step_time(numel: float, state: StateBytes, dp: int, dp_link: Link, cluster: ClusterSpec, *,
                    reduce_dtype: str, zero_stage: int = 0, micro_batches: int = 1) -> float:
    """The per-step work one device does for ``numel`` parameter elements it holds: the
    bandwidth term of their data-parallel collectives under ZeRO ``zero_stage`` (S (n-1)/n / beta
    per reduce-scatter or all-gather, twice that per all-reduce; ``zero_collectives``; gradients in
    ``reduce_dtype``) and the optimizer's pass over their state (``zero_optimizer_time``). Linear in
    ``numel``, so a solver can price a layout parameter by parameter; the per-bucket latencies are
    ``mesh_step``'s."""
    comm = 0.0
    if dp > 1:
        held = {"grads": state.grads, "params": state.params}
        for kind, calls, what in zero_collectives(zero_stage, micro_batches):
            per = wire_bytes(what, held[what], reduce_dtype)
            comm += calls * (2 if kind == "all_reduce" else 1) * numel * per * (dp - 1) / dp / dp_link.bandwidth
    return comm + zero_optimizer_time(numel, state, zero_stage, dp, cluster)


def mesh_step(
    *,
    micro_batch_s: Mapping[str, float],
    grad_accum: int,
    dp: int,
    tp: int,
    grad_buckets: list[int],
    state: ModelStateMemory,
    cluster: ClusterSpec,
    reduce_dtype: str,
    zero_stage: int = 0,
    local_params: float | None = None,
    state_bytes: StateBytes | None = None,
) -> StepCost:
    """One step on a (dp, tp) mesh: ``grad_accum`` micro-batches, then the data-parallel
    collectives of the device's LOCAL parameter shards over the dp group, bucketed (one
    all-reduce per gradient bucket at ZeRO-0, ZeRO's reduce-scatters and all-gathers otherwise:
    ``zero_step_comm``, gradients in ``reduce_dtype``), then the optimizer.

    ``micro_batch_s`` is one micro-batch's forward+backward on one device, by part:
    ``"compute"`` (local FLOPs) and tensor-parallel communication (``"tp_forward"``,
    ``"tp_backward"``, ``"tp_internal"``), as the TP solver predicts them. The dp group's
    ranks lie ``tp`` apart (TP innermost, core/mesh.MESH_ORDER), so its link is
    ``link_for_group(dp, stride=tp)``. ``state`` is the device's model state; under ZeRO >= 1
    the optimizer pass is over ``local_params / dp`` parameters of ``state_bytes`` each.
    """
    per_micro = dict(micro_batch_s)
    compute = grad_accum * (per_micro.pop("compute", 0.0) + cluster.step_overhead_s)
    comm = {k: grad_accum * v for k, v in per_micro.items() if v}
    traffic: dict[str, int] = {}
    if dp > 1 and grad_buckets:
        elem = int(state_bytes.grads) if state_bytes is not None and state_bytes.grads else 2
        z = zero_step_comm(zero_stage, grad_buckets, dp, grad_accum, cluster.link_for_group(dp, stride=tp),
                           elem_bytes=elem, reduce_dtype=reduce_dtype)
        comm.update(z.seconds)
        traffic.update(z.traffic_bytes)
    if zero_stage >= 1:
        if local_params is None or state_bytes is None:
            raise ValueError("mesh_step under ZeRO >= 1 needs local_params and state_bytes for the optimizer's slice")
        opt = zero_optimizer_time(local_params, state_bytes, zero_stage, dp, cluster)
    else:
        opt = optimizer_time(state, cluster)
    return StepCost(compute_s=compute, comm_s=comm, optimizer_s=opt, traffic_bytes=traffic)


# -- pipeline schedules ------------------------------------------------------
#
# p stages, m micro-batches. GPipe and 1F1B take the same time: every stage runs
# m forward + backward slots, and the slowest stage's slot sets the pace, so
#
#     step = (m + p - 1) x max_s slot_s + tail,    slot_s = F_s + B_s + overhead + P_s
#
# i.e. m slowest slots plus a bubble of (p - 1) of them: the bubble fraction
# (p - 1)/m of docs/references.md. P_s is what stage s sends per micro-batch (its
# activations forward, its input gradients back), each a point-to-point
# transfer, exposed (no overlap with compute: an upper bound); what it
# receives arrives on the other direction of the full-duplex link in the same
# time as its neighbour's send. The tail after the last backward is per stage:
# the gradient all-reduce over the stage's dp group (under ZeRO its reduce-scatters
# and all-gathers, zero_step_comm), then the optimizer on the stage's state; the
# slowest tail counts, plus the all-reduce of gradients of parameters that two
# stages share (tied embeddings), once per step. ZeRO-2/3's per-micro-batch
# collectives are charged to the tail, m times over, exposed: their bytes and
# time are exact, but a slot they lengthen would also lengthen the (p - 1)-slot
# bubble, which this omits (an optimistic bias for ZeRO-3 inside a pipeline).
# Memory is where the schedules differ: GPipe holds every micro-batch's
# activations until the backward starts (m); 1F1B starts backward as soon as
# the pipe is full, so stage i of p holds min(p - i, m) (Narayanan et al.).

def p2p_time(nbytes: float, link: Link) -> float:
    """One point-to-point transfer between neighbouring stages; nothing to send costs nothing."""
    return collective_time("send_recv", nbytes, 2, link) if nbytes > 0 else 0.0


def stage_slot_time(compute_s: float, p2p_s: float, cluster: ClusterSpec) -> float:
    """One micro-batch's slot on one stage: its forward + backward, the per-micro-batch overhead, its sends."""
    return compute_s + cluster.step_overhead_s + p2p_s


@dataclass(frozen=True)
class PipelineStepCost:
    """Predicted time of one step of a pipeline (p = 1 is plain gradient accumulation)."""

    compute_s: float  # m x (forward + backward + overhead) of the slowest stage
    p2p_s: float  # m x the slowest stage's sends
    bubble_s: float  # (p - 1) x the slowest stage's slot
    dp_all_reduce_s: float  # the slowest tail's data-parallel collectives (all-reduce, or ZeRO's) over its dp group
    tied_all_reduce_s: float  # gradients of parameters shared by two stages
    optimizer_s: float  # the slowest tail's optimizer step
    slowest_stage: int
    tail_stage: int = 0  # the rank of the slowest tail (its data-parallel collectives + optimizer)

    @property
    def step_s(self) -> float:
        return (self.compute_s + self.p2p_s + self.bubble_s + self.dp_all_reduce_s + self.tied_all_reduce_s
                + self.optimizer_s)


def pipeline_step(
    *,
    compute_s: Sequence[float],
    p2p_s: Sequence[float],
    micro_batches: int,
    dp_all_reduce_s: Sequence[float],
    optimizer_s: Sequence[float],
    tied_all_reduce_s: float,
    cluster: ClusterSpec,
    chunks: int = 1,
) -> PipelineStepCost:
    """One step of a p-stage pipeline with ``micro_batches`` micro-batches (formula above).

    Each sequence holds one value per stage: ``compute_s`` one micro-batch's forward +
    backward, ``p2p_s`` its sends, ``dp_all_reduce_s`` and ``optimizer_s`` once per step.
    With ``chunks`` virtual stages per rank (interleaved 1F1B; the sequences hold p x chunks
    values, stage s on rank s mod p) each rank's are summed, a micro-batch's overhead counted
    once per chunk, and the bubble is (p - 1) / chunks of the slowest rank's slot
    (core/schedule.py ``bubble_fraction``).
    """
    n = len(compute_s)
    if not (n == len(p2p_s) == len(dp_all_reduce_s) == len(optimizer_s)) or n == 0 or n % chunks:
        raise ValueError("pipeline_step needs one compute, p2p, all-reduce and optimizer time per stage")
    p = n // chunks
    if chunks > 1:
        compute_s, p2p_s, dp_all_reduce_s, optimizer_s = (
            [sum(xs[r::p]) for r in range(p)] for xs in (compute_s, p2p_s, dp_all_reduce_s, optimizer_s))
    overhead = chunks * cluster.step_overhead_s
    slots = [c + overhead + x for c, x in zip(compute_s, p2p_s)]
    slow = max(range(p), key=lambda s: slots[s])
    tail = max(range(p), key=lambda s: dp_all_reduce_s[s] + optimizer_s[s])
    return PipelineStepCost(
        compute_s=micro_batches * (compute_s[slow] + overhead),
        p2p_s=micro_batches * p2p_s[slow],
        bubble_s=(p - 1) / chunks * slots[slow],  # bubble_fraction(p, m, chunks) x m slots
        dp_all_reduce_s=dp_all_reduce_s[tail],
        tied_all_reduce_s=tied_all_reduce_s,
        optimizer_s=optimizer_s[tail], slowest_stage=slow, tail_stage=tail)
