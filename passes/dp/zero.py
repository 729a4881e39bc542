"""The ZeRO axis: how far to shard model state over the data-parallel group.

ZeRO's arithmetic (memory per device and traffic per step for stages 0-3,
from the cost model) for `partita estimate`, and the axis's part in the joint
search: which stages are weighed (``zero_stages``) and how a stage that lost
is explained (passes/explain.py ``traffic_reason``). The solvers (passes/tp/mesh.py at
pp = 1, passes/pipeline/stages.py at pp > 1) weigh the stages these return,
with memory and time from cost_model.sharded_state / zero_step_comm.

Pruning (one rule, both solvers): at one (mesh, micro-batch[, schedule, cuts
policy]) the stages are tried in order 0, 1, 2, 3 and only the first that
fits is kept. Exact among z >= 1 (a larger stage only adds traffic); z = 0 over
z >= 1 is a policy, since the cost model sees no overlap of the DP all-reduce with
backward; a larger stage still wins where it lets a larger micro-batch or a mesh fit.
Why, with the numbers: docs/cost-model.md, "Choosing the ZeRO stage".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from partita.core.cluster import ClusterSpec
from partita.core.plans.plan import MemoryBreakdown
from partita.core.precision import element_bytes
from partita.passes.cost_model import ZERO_STAGES, model_state_memory, state_bytes_per_param, zero_step_comm
from partita.passes.explain import ZERO_NAMES
from partita.passes.peak_memory import NO_BUFFERS, peak_memory, step_buffers

STRATEGY_NAMES = ZERO_NAMES


def zero_stages(pinned: int | None, dp: int, inference: bool, *, tp: int = 1, pp: int = 1) -> tuple[int, ...]:
    """The stages to weigh, smallest first: the pinned one, else 0-3; only 0 where there is
    nothing to shard over (dp = 1: every stage costs what stage 0 does) or no optimizer
    state (inference), where a pinned ZeRO stage gives nothing to weigh.

    Every stage composes with every (tp, pp) (runtime/dp/zero.py: ZeRO acts on each stage's
    TP-local parameters over its dp group; ZeRO-3 gathers them per graph node inside the
    TP interpreter), so ``tp`` and ``pp`` no longer narrow the set; they stay in the
    signature for the callers that pass them.
    """
    del tp, pp
    if pinned is not None:  # a pinned ZeRO stage needs a dp group to shard over (RUNTIME_ZERO)
        return (pinned,) if pinned == 0 or (dp > 1 and not inference) else ()
    return (0,) if dp <= 1 or inference else ZERO_STAGES


RUNTIME_ZERO = "ZeRO shards model state over the data-parallel axis, so a pinned stage needs dp > 1 there"


@dataclass(frozen=True)
class StrategyEstimate:
    name: str
    zero_stage: int
    dp: int
    memory: MemoryBreakdown  # at the step's peak (peak_memory.peak_memory)
    traffic_bytes: float  # sent per device per step for model state
    comm_s: float  # alpha-beta time of that traffic on the dp group's link
    terms: Mapping[str, int] = field(default_factory=dict)  # the runtime's buffers counted (peak_memory.step_buffers)
    deepspeed: int | None = None  # DeepSpeed's estimate of the GPU bytes, where it has one (ZeRO-2, ZeRO-3)
    # what DeepSpeed counts and this does not, by size (None: nothing given to size it by)
    left_out: Mapping[str, int | None] = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return self.memory.fits


def deepspeed_estimate(zero_stage: int, num_params: int, devices: int, largest_layer: int) -> dict[str, int]:
    """DeepSpeed's estimate of a device's model-state bytes, term by term, as its estimators count
    them without offload (deepspeed/runtime/zero/stage_1_and_2.py ``estimate_zero2_model_states_mem_needs``
    since mid-2024: 2 Psi + 18 Psi / N, the 16-bit parameters whole and the rest sharded: 16-bit and
    fp32 gradients, fp32 masters and Adam's moments; before, 4 Psi + 16 Psi / N;
    deepspeed/runtime/zero/stage3.py ``estimate_zero3_model_states_mem_needs``: 4 L + 18 Psi / N, L the
    largest module's own parameters; docs/references.md); {} for the stages it has no estimator for."""
    psi, n = num_params, devices
    if zero_stage == 2:
        return {"fp16 parameters": 2 * psi, "fp16 gradients": 2 * psi // n,
                "fp32 master parameters, Adam's moments": 12 * psi // n, "fp32 gradient copy": 4 * psi // n}
    if zero_stage == 3:
        return {"largest layer's fp16 parameters and gradients": 4 * largest_layer,
                "fp16 parameters": 2 * psi // n, "fp32 master parameters, Adam's moments": 12 * psi // n,
                "fp32 gradient copy": 4 * psi // n}
    return {}


def estimate_strategies(
    num_params: int,
    activation_bytes: int,
    cluster: ClusterSpec,
    *,
    dp: int,
    precision: str,
    optimizer: str,
    inference: bool = False,
    reduce_dtype: str = "fp32",
    transient_bytes: int = 0,
    largest_param: int = 0,
    largest_layer: int = 0,
    unit_numel: int = 0,
    tensors: int = 0,
) -> list[StrategyEstimate]:
    """Per-device memory at the step's peak and per-step traffic of DP and ZeRO-1/2/3 over ``dp`` ranks.

    ``activation_bytes`` is one device's activations at its micro-batch, in the training precision,
    ``transient_bytes`` its costliest op's transient beyond them (peak_memory.graph_transient);
    ``largest_param``, ``largest_layer`` (the largest module's own parameters, DeepSpeed's L) and
    ``unit_numel`` (ZeRO-3's largest unit) size the runtime's buffers (peak_memory.step_buffers); 0
    where no model was given, and then the terms they size are listed as left out. Traffic counts
    gradients in ``reduce_dtype`` and parameters as held (cost_model.zero_step_comm). ``inference``: one row,
    the weights replicated and no traffic (``activation_bytes`` is then the forward's live set).
    Beside each its DeepSpeed estimate (``deepspeed_estimate``) and each of DeepSpeed's terms this
    one does not count, with its size."""
    state = state_bytes_per_param(precision, optimizer, inference=inference)
    link = cluster.link_for_group(dp)
    out = []
    for stage in (0,) if inference else (0, 1, 2, 3):
        m = model_state_memory(num_params, state, zero_stage=stage, dp=dp)
        if dp <= 1 or inference:
            comm, traffic = 0.0, 0
        else:  # the runtime's collectives of one step of one micro-batch, the model one bucket
            elem = element_bytes(precision)
            z = zero_step_comm(stage, [num_params * elem], dp, 1, link, elem_bytes=elem, reduce_dtype=reduce_dtype)
            comm, traffic = z.total_s, z.total_bytes
        buffers = NO_BUFFERS if inference else step_buffers(
            precision=precision, reduce_dtype=reduce_dtype, zero_stage=stage if dp > 1 else 0, dp=dp,
            numel=num_params, largest=largest_param, unit_numel=unit_numel, tensors=tensors)
        mem = peak_memory(m, activations=activation_bytes, capacity=cluster.usable_memory, cluster=cluster,
                          transient=transient_bytes, buffers=buffers)
        ds = deepspeed_estimate(stage, num_params, dp, largest_layer) if state.optimizer and dp > 1 else {}
        left_out: dict[str, int | None] = {}
        beyond = ds.get("fp32 gradient copy", 0) - buffers.terms.get("fp32 master gradients, one chunk", 0)
        if beyond > 0:  # the fp32 gradients: DeepSpeed holds the shard's, partita's runtime one chunk of them
            left_out["fp32 gradient copy beyond the one chunk partita's runtime holds"] = beyond
        if stage == 3 and dp > 1 and not (largest_layer and unit_numel):  # no model: nothing sizes them
            left_out["the largest layer gathered (give a model: its layers size it)"] = None
        out.append(StrategyEstimate(STRATEGY_NAMES[stage], stage, dp, mem, traffic, comm, dict(buffers.terms),
                                    sum(ds.values()) if ds else None, left_out))
    return out


def zero_units(repeated: Sequence[Any]) -> tuple[str, ...]:
    """ZeRO-3's units (core/buckets.py): one per repeated layer of the model (``RepeatedBlock``'s
    ``layers``, e.g. "transformer.h.3"), as FSDP2 wraps each block; the plan records them."""
    return tuple(layer for r in repeated for layer in r.layers)
