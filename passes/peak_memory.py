"""Memory at the step's peak: what a training step allocates beyond the model state.

The cost model's memory arithmetic for the peak (docs/cost-model.md, "Memory at the step's
peak"; the model state itself is passes/cost_model.py's): the saved activations
(passes/activations.py measures them; autocast's fp32 copies are ``cost_model.precision_factor``'s);
the costliest op's transient beyond them (``node_transient``: a loss's fp32 logits' gradients);
the runtime's buffers in backward and at the optimizer step (``step_buffers``: ZeRO-3's units
gathered whole, gradient buckets in flight, fp32 master gradients a chunk at a time, fp32 reduced
means); and on a GPU the allocator's rounding and a stated fragmentation headroom
(``peak_memory``). Every solver and the plan's record call these; none carries its own copy.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from partita.core.buckets import DEFAULT_BUCKET_BYTES, unit_of
from partita.core.cluster import ClusterSpec
from partita.core.plans.plan import MemoryBreakdown
from partita.core.precision import dtype_bytes, element_bytes
from partita.passes.cost_model import ModelStateMemory, precision_factor


def node_transient(a: Mapping[str, Any], *, beta: float, act_scale: float, precision: str, device: str,
                   fraction: float = 1.0) -> float:
    """Bytes node ``a`` holds beyond the saved activations while it runs (its ``transient_bytes``,
    measured at the captured batch and dtype) at a micro-batch ``beta`` times the captured one (if
    it depends on the input), at the precision (``act_scale``: its element size over the captured
    one; fp32 where autocast keeps the op in fp32) and a strategy's share ``fraction``."""
    batch = beta if a.get("depends_on_input") else 1.0
    return a.get("transient_bytes", 0) * batch * act_scale * precision_factor(a.get("op", ""), precision, device) \
        * fraction


def autocast_extra(a: Mapping[str, Any], *, beta: float, act_scale: float, precision: str, device: str,
                   fraction: float = 1.0) -> float:
    """Of node ``a``'s saved bytes at the precision, what autocast keeps in fp32 beyond it."""
    batch = beta if a.get("depends_on_input") else 1.0
    return a.get("saved_bytes", 0) * batch * act_scale * (precision_factor(a.get("op", ""), precision, device) - 1) \
        * fraction


def graph_transient(G: Any, *, micro_batch: int, batch: int, precision: str, device: str, captured: str,
                    nodes: Any = None, fraction: Any = None,
                    grads_share: float | None = None) -> tuple[float, str, float]:
    """The largest ``node_transient`` over ``nodes`` (default: every node of ``G``) at ``micro_batch``
    samples of a graph captured at ``batch`` in dtype ``captured``, its node, and 0; ``fraction(n)``:
    the share of node ``n`` one device holds (its TP strategy's), 1 by default. With
    ``grads_share`` (a step that frees its gradients between steps: the device's share of the
    parameters' gradients at the precision over the captured graph's), the node where the transient
    and the gradients backward has made by then (``grad_bytes``) weigh most together, and those
    gradients as the third element."""
    act = element_bytes(precision) / dtype_bytes(captured or "float32")
    best, where, grads = -1.0, "", 0.0
    for n in G.nodes if nodes is None else nodes:
        b = node_transient(G.nodes[n], beta=micro_batch / batch, act_scale=act, precision=precision, device=device,
                           fraction=1.0 if fraction is None else fraction(n))
        g = G.nodes[n].get("grad_bytes", 0) * grads_share if grads_share is not None else 0.0
        if b + g > best:
            best, where, grads = b + g, n, g
    return max(0.0, best - grads), where, grads


def graph_autocast(G: Any, *, micro_batch: int, batch: int, precision: str, device: str, captured: str,
                   nodes: Any = None, fraction: Any = None) -> float:
    """The saved bytes autocast keeps in fp32 beyond the precision's size, summed over ``nodes``."""
    act = element_bytes(precision) / dtype_bytes(captured or "float32")
    return sum(autocast_extra(G.nodes[n], beta=micro_batch / batch, act_scale=act, precision=precision, device=device,
                              fraction=1.0 if fraction is None else fraction(n))
               for n in (G.nodes if nodes is None else nodes))


@dataclass(frozen=True)
class StepBuffers:
    """What the runtime's data-parallel and optimizer machinery allocates in a step, bytes on one device."""

    collectives: int  # in backward: ZeRO-3's units gathered whole, ZeRO-2/3's gradient buckets in flight
    step: int  # at the step (the backward's activations freed): fp32 gradients, the optimizer's buffers
    terms: Mapping[str, int] = field(default_factory=dict)  # each of them by name, for the plan's reader
    tensors: int = 0  # tensors alive at the backward's peak (each a block the allocator rounds)


NO_BUFFERS = StepBuffers(0, 0)


def step_buffers(*, precision: str, reduce_dtype: str = "fp32", zero_stage: int = 0, dp: int = 1, numel: int = 0,
                 largest: int = 0, unit_numel: int = 0, bucket_bytes: int = 25 * 1024 * 1024,
                 tensors: int = 0, accumulates: bool = False) -> StepBuffers:
    """The runtime's own buffers in one step (runtime/dp/buckets.py, runtime/dp/zero.py,
    runtime/mixed_precision.py) on a device holding ``numel`` parameter elements (before ZeRO
    shards them), the largest ``largest``, ZeRO-3's largest unit ``unit_numel``:

    - mixed precision steps fp32 masters a chunk at a time (``MasterWeights``): one chunk's fp32
      gradients, at most ``bucket_bytes`` plus its last master (a bucket's shard under ZeRO >= 1);
    - gradients reduced in a wider dtype than they are held (bf16 summed in fp32) keep each bucket's
      fp32 copy until the step (ZeRO-0: the masters read the mean from it) or the end of backward
      (ZeRO-1): the reduce dtype's bytes of every parameter, on the step's side of the peak;
    - ZeRO-2/3 build each bucket's gradients into one flat transient and reduce it while the next
      fills: the bucket filling, the one gradient being copied into it (each member's is freed once
      copied), the previous one's wire (one bucket: its reduce-dtype copy, where that is wider);
    - ZeRO-3 holds a unit whole while it computes and prefetches the next: two units' parameters;
    - where gradients are held when backward adds to them (``accumulates``: data parallelism's
      persistent buckets, ZeRO-1's, micro-batches accumulated), each one backward makes exists
      beside the one it is added into: the largest parameter's gradient.

    The optimizer is taken as fused (partita's default for AdamW and Adam: no buffer beyond its
    state); a user's foreach optimizer adds one fp32 buffer of what it steps at once."""
    if not numel:
        return StepBuffers(0, 0, {}, tensors)
    p, r = element_bytes(precision), dtype_bytes(reduce_dtype)
    # a bucket closes once it reaches the cap: at most the cap and its last parameter (core/buckets.py)
    bucket = unit_numel if zero_stage == 3 and unit_numel else min(numel, math.ceil(bucket_bytes / p) + largest)
    terms: dict[str, int] = {}
    if precision.endswith("-mixed") and not (zero_stage == 0 and dp > 1 and r > p):
        master = math.ceil(bucket / dp) if zero_stage else largest
        terms["fp32 master gradients, one chunk"] = min(4 * math.ceil(numel / (dp if zero_stage else 1)),
                                                         bucket_bytes + 4 * master)
    if dp > 1 and r > p and zero_stage <= 1:
        terms["fp32 reduced gradients"] = r * numel
    step = sum(terms.values())
    if accumulates and zero_stage <= 1:
        terms["a gradient added into the one held"] = p * largest
    if dp > 1 and zero_stage >= 2:
        # the bucket filling (allocated at its first gradient, beside the backward's activations) and the
        # member's own gradient copied into it; the previous bucket's wire still in flight where there are
        # several, or the one bucket's wider reduce-dtype copy made beside it at its launch
        wire = max(p, r) if zero_stage == 3 or numel > bucket else (r if r > p else 0)
        terms["gradient buckets in flight"] = (p + wire) * bucket + p * largest
        if zero_stage == 3:
            terms["ZeRO-3 units gathered whole, two"] = 2 * p * bucket
    return StepBuffers(sum(terms.values()) - step, step, terms, tensors)


def peak_total(state: float, backward: float, buffers: StepBuffers, cluster: ClusterSpec, *, grads: float = 0.0,
               backward_grads: float | None = None) -> int:
    """``peak_memory(...).total`` from its parts without building the record (the cut DP's inner loop):
    ``state`` the model state, ``backward`` what the backward holds beyond it and ZeRO's buffers, and
    where the step frees its gradients between steps, ``grads`` of the state and the ``backward_grads``
    alive at the backward's peak instead."""
    if backward_grads is not None:
        backward += backward_grads - grads
    return peak_of(state, backward + buffers.collectives, buffers.step, buffers.tensors, cluster)


def peak_of(state: float, backward: float, step: float, tensors: int, cluster: ClusterSpec) -> int:
    """The peak from its sums: the state, the larger of the backward's side (ZeRO's buffers in it)
    and the step's, each tensor alive rounded up to the allocator's granularity, the fragmentation."""
    rounding = tensors * cluster.alloc_granularity if cluster.alloc_granularity > 1 else 0
    return round((state + max(backward, step) + rounding) * (1 + cluster.fragmentation))


def peak_memory(state: ModelStateMemory, *, activations: float, capacity: int, cluster: ClusterSpec,
                transient: float = 0.0, buffers: StepBuffers = NO_BUFFERS, autocast: float = 0.0,
                backward_grads: float | None = None) -> MemoryBreakdown:
    """One device's memory at the step's peak, by term (core/plans/plan.py ``MemoryBreakdown``): the
    state, the larger of the backward's peak and the step's, and on a cluster whose allocator rounds
    (``alloc_granularity``: CUDA's caching allocator, 512 bytes) each tensor alive at the peak
    rounded up, and ``fragmentation`` of all that kept free for the allocator. ``backward_grads``:
    the gradients alive at the backward's peak where the step frees them between steps."""
    m = MemoryBreakdown(state.params, state.grads, state.optimizer, round(activations), capacity,
                        transient=round(transient), collectives=buffers.collectives, step=buffers.step,
                        autocast=round(autocast),
                        backward_grads=None if backward_grads is None else round(backward_grads))
    total = peak_total(m.state, m.activations + m.transient, buffers, cluster, grads=m.grads,
                       backward_grads=m.backward_grads)
    return dataclasses.replace(m, allocator=total - m.total)


def stage_buffers(profile: Any, request: Any,
                  tp: int) -> Callable[[int, int, int], Callable[[int], StepBuffers] | None]:
    """(ZeRO stage, dp, micro-batches) -> the runtime's buffers of a pipeline stage by its parameter
    elements (``step_buffers``): its largest parameter and ZeRO-3 unit taken as the model's (a
    ``ModelProfile``'s), split over tp; None for inference (``request``: a ``TrainingRequest``)."""
    G = profile.graph
    whole: dict[str, int] = {}
    for _, a in G.nodes(data=True):
        if a["kind"] == "param":
            whole[a["param_name"]] = math.prod(a["shapes"][0]) if a["shapes"] else 0
    layers = [layer for r in profile.repeated for layer in r.layers]
    units: dict[str, int] = {}
    for name, n in whole.items():
        units[unit_of(name, layers)] = units.get(unit_of(name, layers), 0) + n
    largest = math.ceil(max(whole.values(), default=0) / tp)
    unit = math.ceil(max(units.values(), default=0) / tp)
    tensors = G.graph.get("step_peak_tensors", 0)

    def of(z: int, dp: int, m: int) -> Callable[[int], StepBuffers] | None:
        if request.inference:
            return None
        return lambda numel: step_buffers(precision=request.precision, reduce_dtype=request.reduce_dtype,
                                          zero_stage=z, dp=dp, numel=numel, largest=min(largest, numel),
                                          unit_numel=unit, bucket_bytes=DEFAULT_BUCKET_BYTES, tensors=tensors,
                                          accumulates=dp > 1 or m > 1)
    return of
