"""The ZeRO axis: how far to shard model state over the data-parallel group.

This version has ZeRO's arithmetic (memory per device and traffic per step
for stages 0-3, from the cost model) for `partita estimate`; the runtime and
the planner's choice of stage arrive later.
"""

from __future__ import annotations

from dataclasses import dataclass

from partita.compiler.plan import MemoryBreakdown
from partita.passes.cluster import ClusterSpec
from partita.passes.cost_model import (
    collective_time,
    element_bytes,
    model_state_memory,
    state_bytes_per_param,
    zero_traffic_elements,
)

STRATEGY_NAMES = {0: "DP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}


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
) -> list[StrategyEstimate]:
    """Per-device memory and per-step traffic of DP and ZeRO-1/2/3 over ``dp`` ranks.

    ``activation_bytes`` is one device's activations at its micro-batch, in
    the training precision. Traffic counts ``element_bytes(precision)`` per
    element (16-bit under mixed precision).
    """
    state = state_bytes_per_param(precision, optimizer)
    link = cluster.link_for_group(dp)
    out = []
    for stage in (0, 1, 2, 3):
        m = model_state_memory(num_params, state, zero_stage=stage, dp=dp)
        traffic = zero_traffic_elements(num_params, stage, dp) * element_bytes(precision)
        full = num_params * element_bytes(precision)
        if dp <= 1:
            comm = 0.0
        elif stage == 3:  # all-gather (fwd) + all-gather (bwd) + reduce-scatter
            comm = 2 * collective_time("all_gather", full, dp, link) + collective_time("reduce_scatter", full, dp, link)
        elif stage in (1, 2):  # reduce-scatter grads + all-gather updated params
            comm = collective_time("reduce_scatter", full, dp, link) + collective_time("all_gather", full, dp, link)
        else:
            comm = collective_time("all_reduce", full, dp, link)
        mem = MemoryBreakdown(m.params, m.grads, m.optimizer, activation_bytes, cluster.usable_memory)
        out.append(StrategyEstimate(STRATEGY_NAMES[stage], stage, dp, mem, traffic, comm))
    return out
