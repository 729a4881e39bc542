"""The solvers' named inputs, made from an ``Options`` (core/options.py): ``Pins``, the decisions
a user fixed, and ``TrainingRequest``, the training set-up a plan is made for; each validated at
construction, in the CLI's words.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from partita.core.axes import check_pins
from partita.core.axes.context import CP_ATTENTION
from partita.core.errors import MAX_COUNT, POSITIVE_HINT, PartitaError, too_large
from partita.core.experts import expert_load
from partita.core.optimizers import OFFLOAD
from partita.core.plans.plan import OPTIMIZERS
from partita.core.precision import PRECISIONS, REDUCE_DTYPES
from partita.core.recompute import FULL, SELECTIVE, recompute_mode
from partita.core.schedule import SCHEDULES

ZERO_STAGES = (0, 1, 2, 3)


def is_whole(v: Any, low: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


def check_positive(name: str, v: Any) -> None:
    if v is not None and not is_whole(v, 1):
        raise PartitaError(f"--{name.replace('_', '-')} {v!r} must be a positive integer", hint=POSITIVE_HINT)
    if v is not None and v > MAX_COUNT:
        raise too_large(f"--{name.replace('_', '-')}", v)


@dataclass(frozen=True)
class Pins:
    """Decisions fixed by the user, as the solvers take them; ``None`` leaves one to the planner.

    Pins are constraints handed to the same solvers that decide the free parts, not a second
    code path. A pin that can never be honoured (a ZeRO stage of 5) is refused here.
    """

    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    zero_stage: int | None = None
    micro_batch_size: int | None = None
    grad_accum_steps: int | None = None
    world_size: int | None = None  # e.g. the processes torchrun launched
    schedule: str | None = None  # the pipeline schedule (core/schedule.py SCHEDULES; implies pp > 1)
    recompute: str | None = None  # core/recompute.py's mode on every stage, or (None) per stage where memory binds
    offload: str | None = None  # core/optimizers.py's OFFLOAD, or (None) the planner's choice
    sequence_parallel: bool | None = None  # the residual stream split along the sequence (tp > 1), or the planner's
    ep: int | None = None  # experts split over groups of ep dp ranks (core/mesh.py Mesh.ep), or the planner's
    cp: int | None = None  # each sequence split over cp dp ranks (core/mesh.py Mesh.cp), or the planner's
    cp_attention: str | None = None  # core/axes/context.py CP_ATTENTION, or the planner's
    # routing: the slowest expert rank's rows over the mean (a number), or a router profile's path
    # (core/experts.py ``expert_load``); None: balanced
    expert_load: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "recompute", recompute_mode(self.recompute))
        for name in ("dp", "tp", "pp", "micro_batch_size", "grad_accum_steps", "world_size", "ep", "cp"):
            check_positive(name, getattr(self, name))
        if self.zero_stage is not None and (not is_whole(self.zero_stage, 0) or self.zero_stage not in ZERO_STAGES):
            raise PartitaError(f"--zero {self.zero_stage!r} must be 0, 1, 2 or 3",
                               hint="ZeRO shards optimizer state (1), gradients (2) and parameters (3) over dp; "
                               "leave --zero out to let partita choose")
        if self.sequence_parallel is not None and not isinstance(self.sequence_parallel, bool):
            raise PartitaError(f"sequence_parallel={self.sequence_parallel!r} must be True, False or None",
                               hint="True splits the residual stream along the sequence over tp, False never")
        if self.offload is not None and self.offload not in OFFLOAD:
            raise PartitaError(f"--offload {self.offload!r} is not one of {', '.join(OFFLOAD)}",
                               hint="optimizer keeps the optimizer's state and masters in host memory")
        if self.schedule is not None:
            if self.schedule not in SCHEDULES:
                raise PartitaError(f"--schedule {self.schedule!r} is not one of {', '.join(SCHEDULES)}",
                                   hint="leave --schedule out to let partita choose")
        if self.cp_attention is not None and self.cp_attention not in CP_ATTENTION:
            raise PartitaError(f"--cp-attention {self.cp_attention!r} is not one of {', '.join(CP_ATTENTION)}",
                               hint="ring passes keys and values around the cp group; all-to-all swaps sequence "
                               "slices for heads; leave it out to let partita choose")
        if self.expert_load is not None:
            object.__setattr__(self, "expert_load", str(self.expert_load))
            expert_load(self.expert_load)  # a number >= 1 or a readable router profile
        check_pins(self)  # every axis's rules over what the pins fix (core/axes)

    # The planners decide every axis; a tp pin is checked against the cluster in
    # passes/tp/mesh.py, a pp pin against the devices in passes/pipeline/stages.py,
    # and a ZeRO pin narrows the stages passes/dp/zero.zero_stages offers both.
    def describe(self) -> str:
        """The pins in the CLI's words (``--dp 2 --zero 1``), or "no pins"."""
        flags = {"zero_stage": "zero", "world_size": "devices"}
        parts = []
        for name in ("dp", "tp", "pp", "ep", "cp", "cp_attention", "expert_load", "zero_stage", "micro_batch_size",
                     "grad_accum_steps", "schedule", "world_size"):
            v = getattr(self, name)
            if v is not None:
                parts.append(f"--{flags.get(name, name).replace('_', '-')} {v}")
        if self.recompute is not None:
            parts.append(f"--recompute {self.recompute}")
        if self.offload is not None:
            parts.append(f"--offload {self.offload}")
        if self.sequence_parallel is not None:
            parts.append("--sequence-parallel" if self.sequence_parallel else "--no-sequence-parallel")
        return " ".join(parts) or "no pins"

    @property
    def recomputes(self) -> bool:
        """Whether recomputation is pinned on every stage (selective or full)."""
        return self.recompute in (SELECTIVE, FULL)

    def check_batch(self, global_batch: int) -> None:
        """The pinned factors of the global batch (dp x micro-batch size x micro-batches per step) must
        divide it: refused in the CLI's words before the search, which would find no mesh and say less."""
        # cp ranks share their samples (core/mesh.py Mesh.samples): dp / cp groups split the batch
        samples = (("--dp / --cp", self.dp // self.cp) if self.dp is not None and (self.cp or 1) > 1
                   else ("--dp", self.dp))
        pinned = [(flag, v) for flag, v in (samples, ("--micro-batch-size", self.micro_batch_size),
                                            ("--grad-accum-steps", self.grad_accum_steps)) if v is not None]
        product = math.prod(v for _, v in pinned)
        if global_batch % product:
            what = " x ".join(f"{flag} {v}" for flag, v in pinned)
            raise PartitaError(f"{what}{f' = {product}' if len(pinned) > 1 else ''} does not divide the global "
                               f"batch of {global_batch}: dp x micro-batch size x micro-batches per step is the "
                               "global batch", hint="pin factors of the global batch (--batch, or the first input's "
                               "leading dim), or leave them out to let partita choose")

    def check_cluster(self, devices: int) -> None:
        """A degree pinned beyond the cluster's devices is refused in the same words everywhere
        (`partita compile`, `partita estimate`, the decorator)."""
        for name in ("dp", "tp", "pp"):
            v = getattr(self, name)
            if v is not None and v > devices:
                raise PartitaError(f"--{name} {v} is more than the cluster's {devices} devices",
                                   hint=f"pin --{name} {devices} or less, or give more devices (--nodes, --devices)")


@dataclass(frozen=True)
class TrainingRequest:
    """The training set-up a plan is made for (the global batch resolved), as the solvers take it."""

    global_batch: int
    precision: str = "fp32"
    optimizer: str = "adamw"
    inference: bool = False
    reduce_dtype: str = "fp32"  # gradients are reduced over dp in this dtype (core/precision.py)
    max_grad_norm: float | None = None  # the global gradient norm is clipped to this
    kv_tokens: int = 0  # inference with generation: prompt + new tokens per sequence, whose KV cache is held

    def __post_init__(self) -> None:
        if self.kv_tokens and not self.inference:
            raise PartitaError("--generate needs --inference", hint="add --inference")
        if isinstance(self.global_batch, bool) or not isinstance(self.global_batch, int) or self.global_batch < 1:
            raise PartitaError(f"--batch {self.global_batch!r} must be a positive integer",
                               hint="the global batch: samples per optimizer step over all devices")
        if self.global_batch > MAX_COUNT:
            raise too_large("--batch", self.global_batch)
        if self.reduce_dtype not in REDUCE_DTYPES:
            raise PartitaError(f"--reduce-dtype {self.reduce_dtype!r} is not one of {', '.join(REDUCE_DTYPES)}",
                               hint="fp32 (the default) reduces gradients at full precision")
        if self.max_grad_norm is not None and not (isinstance(self.max_grad_norm, (int, float))
                                                   and not isinstance(self.max_grad_norm, bool)
                                                   and math.isfinite(self.max_grad_norm) and self.max_grad_norm > 0):
            raise PartitaError(f"--max-grad-norm {self.max_grad_norm!r} must be a positive number",
                               hint="e.g. --max-grad-norm 1.0, or leave it out for no clipping")
        if self.precision not in PRECISIONS:
            raise PartitaError(f"--precision {self.precision!r} is not one of {', '.join(PRECISIONS)}",
                               hint="leave --precision out for the cluster's default")
        if self.optimizer not in OPTIMIZERS:
            raise PartitaError(f"--optimizer {self.optimizer!r} is not one of {', '.join(OPTIMIZERS)}",
                               hint="partita models the memory of these optimizers only")
