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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from partita.core.cluster import ClusterSpec
from partita.core.plan import MemoryBreakdown
from partita.core.precision import element_bytes
from partita.passes.cost_model import (
    ZERO_STAGES,
    collective_time,
    model_state_memory,
    state_bytes_per_param,
    zero_collectives,
    zero_traffic_elements,
)
from partita.passes.explain import ZERO_NAMES

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
    memory: MemoryBreakdown
    traffic_bytes: float  # sent per device per step for model state
    comm_s: float  # alpha-beta time of that traffic on the dp group's link

    @property
    def fits(self) -> bool:
        return self.memory.fits


def estimate_strategies(
    num_params: int,
    activation_bytes: int,
    cluster: ClusterSpec,
    *,
    dp: int,
    precision: str,
    optimizer: str,
    inference: bool = False,
) -> list[StrategyEstimate]:
    """Per-device memory and per-step traffic of DP and ZeRO-1/2/3 over ``dp`` ranks.

    ``activation_bytes`` is one device's activations at its micro-batch, in
    the training precision. Traffic counts ``element_bytes(precision)`` per
    element (16-bit under mixed precision). ``inference``: one row, the weights
    replicated and no traffic (``activation_bytes`` is then the forward's live set).
    """
    state = state_bytes_per_param(precision, optimizer, inference=inference)
    link = cluster.link_for_group(dp)
    out = []
    for stage in (0,) if inference else (0, 1, 2, 3):
        m = model_state_memory(num_params, state, zero_stage=stage, dp=dp)
        traffic = zero_traffic_elements(num_params, stage, dp) * element_bytes(precision)
        full = num_params * element_bytes(precision)
        if dp <= 1 or inference:
            comm, traffic = 0.0, 0
        else:  # the runtime's collectives of one step of one micro-batch (cost_model.zero_collectives)
            comm = sum(calls * collective_time(kind, full, dp, link) for kind, calls, _ in zero_collectives(stage))
        mem = MemoryBreakdown(m.params, m.grads, m.optimizer, activation_bytes, cluster.usable_memory)
        out.append(StrategyEstimate(STRATEGY_NAMES[stage], stage, dp, mem, traffic, comm))
    return out


def zero_units(repeated: Sequence[Any]) -> tuple[str, ...]:
    """ZeRO-3's units (core/buckets.py): one per repeated layer of the model (``RepeatedBlock``'s
    ``layers``, e.g. "transformer.h.3"), as FSDP2 wraps each block; the plan records them."""
    return tuple(layer for r in repeated for layer in r.layers)
