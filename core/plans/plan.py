"""The plan: the only contract between planning and running.

A ``Plan`` is a frozen, typed structure written as versioned, sealed JSON (never pickle: a plan
from elsewhere must never run code). This module holds its types and how one is written;
core/plans/plan_file.py reads a plan file back (schema, consistency and seal checks), and
core/plans/dataclass_json.py is the dataclass <-> JSON codec both sides use.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from partita.core.buckets import DEFAULT_BUCKET_BYTES
from partita.core.errors import PlanError
from partita.core.files import write_text
from partita.core.mesh import Mesh
from partita.core.optimizers import NO_OFFLOAD
from partita.core.plans.dataclass_json import from_jsonable, to_jsonable
from partita.core.recompute import NONE

SCHEMA_VERSION = 2  # 2: Stage.recompute names a mode (core/recompute.py), not a flag
SEAL = "sha256"  # the plan file's field holding ``seal_digest``
# the optimizers a plan may name (passes/cost_model.py prices their state)
OPTIMIZERS = ("adamw", "adam", "sgd", "sgd-momentum", "none")


def seal_digest(data: Mapping[str, Any]) -> str:
    """sha256 over a plan's JSON data (every field but the seal itself), in canonical form: what
    `partita compile` and `partita verify` write and loading checks, so a hand edit is noticed."""
    body = {k: v for k, v in data.items() if k != SEAL}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class ModelInfo:
    name: str
    fingerprint: str
    num_params: int
    param_bytes: int
    inputs: tuple[str, ...]  # "NAME=DTYPE[SHAPE]" as captured
    capture_method: str
    num_nodes: int
    repeated_layers: tuple[str, ...] = ()  # e.g. "transformer.h x12 (Block)"
    targets: str | None = None  # "NAME=DTYPE[SHAPE]" of the loss's targets when the loss is in the graph
    loss: str | None = None  # the loss function captured with the model (training graphs)


def tied_stages(param_of: Mapping[str, str], readers: Mapping[str, Iterable[str]],
                stage_of: Mapping[str, int], pp: int | None = None) -> dict[str, tuple[int, ...]]:
    """Each parameter read on several pipeline stages -> those stages, sorted (the one rule the
    planner lists the tied-gradient all-reduce by and the runtime runs it by); with ``pp``, by rank.

    ``param_of`` maps a graph placeholder to its parameter's name (a tied parameter may have
    several placeholders), ``readers`` a placeholder to the nodes reading it, ``stage_of`` a node
    to its stage. A stage holds a parameter when one of its nodes reads it: a placeholder no node
    reads (a tied parameter's unused duplicate) puts it on no stage."""
    stages: dict[str, set[int]] = {}
    for node, name in param_of.items():
        stages.setdefault(name, set()).update(stage_of[r] % pp if pp else stage_of[r] for r in readers.get(node, ()))
    return {name: tuple(sorted(s)) for name, s in sorted(stages.items()) if len(s) > 1}


@dataclass(frozen=True)
class Training:
    """How one optimizer step consumes the global batch."""

    global_batch: int
    micro_batch_size: int  # samples per micro-batch on one data-parallel rank
    grad_accum_steps: int  # micro-batches per data-parallel rank per step
    precision: str = "fp32"  # "fp32" | "bf16-mixed" | "fp16-mixed" | "bf16" (core/precision.py)
    reduce_dtype: str = "fp32"  # gradients are reduced over dp in this dtype: "fp32" | "bf16" | "fp16"
    optimizer: str = "adamw"  # one of OPTIMIZERS
    zero_stage: int = 0
    schedule: str = "none"  # pipeline schedule: "none" | "gpipe" | "1f1b" | "interleaved-1f1b" (core/schedule.py)
    chunks: int = 1  # chunks per pipeline rank (interleaved 1F1B): pp x chunks stages, c on rank c mod pp
    inference: bool = False
    grad_bucket_bytes: int = DEFAULT_BUCKET_BYTES  # gradients are all-reduced in buckets of this size
    max_grad_norm: float | None = None  # clip the global gradient norm to this (None: no clipping)
    # ZeRO-3 gathers and frees parameters by these units: one module path per repeated layer
    # (core/buckets.py ``unit_of``); empty: by buckets of ``grad_bucket_bytes``
    zero_units: tuple[str, ...] = ()
    offload: str = NO_OFFLOAD  # the optimizer's state and masters on the host (core/optimizers.py OFFLOAD)
    sequence_parallel: bool = False  # the nodes' layouts split the residual stream along the sequence over tp
    # how attention meets the rest of its sequence at mesh.cp > 1 (core/axes/context.py CP_ATTENTION):
    # "ring" passes keys and values around the cp group, "all-to-all" swaps sequence slices for heads
    cp_attention: str = "ring"
    # routing as priced: the slowest rank of an expert group's rows over the mean, the highest over the MoE
    # layers (core/experts.py ``ExpertLoad``); 1 balanced, and at ep = 1 (each rank runs every expert)
    expert_load: float = 1.0

    def __post_init__(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage={self.zero_stage} must be 0, 1, 2 or 3")
        for name in ("global_batch", "micro_batch_size", "grad_accum_steps", "chunks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")


@dataclass(frozen=True)
class ParamDecision:
    """Where one parameter lives: its layout on each mesh axis and its stage."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    layout: Mapping[str, str]  # mesh axis -> "replicate" | "shard(DIM)"
    stage: int = 0


@dataclass(frozen=True)
class Collective:
    """One kind of collective the plan expects each rank to run per step."""

    kind: str  # "all_reduce" | "all_gather" | "reduce_scatter" | "all_to_all" | "send_recv"
    axis: str  # mesh axis it runs over
    bytes: int  # payload per call
    count: int  # calls per step
    group_size: int
    purpose: str  # e.g. "gradient averaging"
    seconds: float  # predicted time per step, all calls
    stage: int | None = None  # the pipeline stage whose ranks run it; None: every rank


@dataclass(frozen=True)
class InputLayout:
    """How one tensor input of a node arrives over the tensor-parallel group.

    Placements are ``"replicate"`` (every rank holds the whole tensor),
    ``"shard(D)"`` (rank r holds the r-th slice of dim D) or ``"partial"``
    (the ranks' tensors sum to the value). A gradient placement uses the same
    words for the gradient tensor; ``"none"`` where no gradient flows.
    """

    src: str  # producer node
    index: int  # which of the producer's tensor outputs
    have: str  # the producer's output placement
    need: str  # the placement this node's strategy consumes
    grad: str  # placement of the gradient this node produces for the input
    grad_need: str  # the gradient placement the producer expects
    fwd: str  # collective run in forward to turn have into need ("none", "slice", "all_gather", ...)
    bwd: str  # collective run in backward to turn grad into grad_need
    bytes: int  # bytes of the whole tensor


@dataclass(frozen=True)
class NodeDecision:
    """The tensor-parallel layout chosen for one graph node."""

    name: str  # FX node name
    op: str
    module: str
    strategy: str  # "replicate", "col", "row", "vocab", "heads", "shard(D)", ...
    out: tuple[str, ...]  # placement of each tensor output
    ins: tuple[InputLayout, ...] = ()  # one per tensor input, in node.all_input_nodes order
    internal: tuple[str, ...] = ()  # collectives the op runs itself, "KIND:BYTES" (e.g. vocab-parallel softmax)
    layer: str = ""  # repeated layer it belongs to, e.g. "transformer.h.3"
    stage: int = 0
    flops_fwd: int = 0
    compute_s: float = 0.0  # predicted forward + backward time on one device


@dataclass(frozen=True)
class Stage:
    """One pipeline stage (a plan without a pipeline has one)."""

    index: int
    nodes: int  # number of graph nodes in the stage
    first_node: str
    last_node: str
    params: int
    predicted_time_s: float  # the stage's busy time per step
    memory_bytes: int  # per device of the stage
    forward_s: float = 0.0  # one micro-batch's forward on one device of the stage
    backward_s: float = 0.0  # one micro-batch's backward
    ranks: tuple[int, ...] = ()  # global ranks holding this stage
    modules: tuple[str, ...] = ()  # top-level module paths it holds, e.g. "transformer.h.0-11"
    send_bytes: int = 0  # activation bytes sent to the next stage per micro-batch
    recompute: str = NONE  # what reruns in backward (core/recompute.py): none, attention cores or whole layers


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per device at the step's peak, by term (passes/peak_memory.py; docs/cost-model.md, "Memory
    at the step's peak"): the state, then the larger of the backward's side and the optimizer step's
    (activations are freed by then), then the allocator's rounding and fragmentation."""

    params: int
    grads: int
    optimizer: int
    activations: int  # saved for backward by the micro-batches in flight (``autocast`` of it kept in fp32)
    capacity: int
    transient: int = 0  # beyond the saved activations while the costliest op runs (a loss's fp32 gradients)
    collectives: int = 0  # communication buffers in backward: ZeRO's units and buckets, a pipeline's sends
    step: int = 0  # at the optimizer step: fp32 gradients (master chunk or reduced means), optimizer buffers
    allocator: int = 0  # the caching allocator's rounding and a stated fragmentation headroom (GPU presets)
    autocast: int = 0  # of ``activations``: what autocast keeps in fp32 beyond the precision's element size
    # the gradients alive at the backward's peak where a step frees them between steps; None: all of them
    backward_grads: int | None = None
    host: int = 0  # held in host memory, not the device's: the optimizer's state and masters under offload

    @property
    def state(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def backward_peak(self) -> int:  # beyond the parameters and the optimizer's state
        grads = self.grads if self.backward_grads is None else self.backward_grads
        return grads + self.activations + self.transient + self.collectives

    @property
    def at_step(self) -> bool:  # the optimizer step, not the backward, sets the peak
        return self.grads + self.step > self.backward_peak

    @property
    def grads_at_peak(self) -> int:
        return self.grads if self.at_step or self.backward_grads is None else self.backward_grads

    @property
    def total(self) -> int:
        return self.params + self.optimizer + max(self.backward_peak, self.grads + self.step) + self.allocator

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity


@dataclass(frozen=True)
class Prediction:
    step_time_s: float
    compute_s: float
    comm_s: Mapping[str, float]  # kind of communication -> exposed seconds per step
    optimizer_s: float
    memory: MemoryBreakdown  # the most loaded device
    traffic_bytes: Mapping[str, int]  # kind -> bytes sent per device per step
    samples_per_s: float
    tokens_per_s: float | None
    model_tflops_per_device: float
    mfu: float
    sources: Mapping[str, str] = field(default_factory=dict)  # figure -> its source (passes/calibrated.py)


@dataclass(frozen=True)
class Alternative:
    """A candidate the planner weighed, and why it lost."""

    mesh: Mesh
    micro_batch_size: int
    grad_accum_steps: int
    zero_stage: int
    step_time_s: float | None  # None when it does not fit
    memory_bytes: int
    fits: bool
    chosen: bool
    reason: str


@dataclass(frozen=True)
class SolverReport:
    method: str  # e.g. "exhaustive enumeration" or "CP-SAT"
    status: str  # "OPTIMAL" | "FEASIBLE" | ...
    objective: float
    seconds: float
    candidates: int
    gap: float = 0.0
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Plan:
    model: ModelInfo
    cluster: Mapping[str, Any]  # the cluster spec the plan was made for
    mesh: Mesh
    training: Training
    predicted: Prediction
    solver: SolverReport
    params: tuple[ParamDecision, ...] = ()
    nodes: tuple[NodeDecision, ...] = ()
    collectives: tuple[Collective, ...] = ()
    stages: tuple[Stage, ...] = ()
    alternatives: tuple[Alternative, ...] = ()
    analysis_seconds: Mapping[str, float] = field(default_factory=dict)
    version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        t = self.training
        per_step = self.mesh.samples * t.micro_batch_size * t.grad_accum_steps  # cp ranks share samples
        if per_step != t.global_batch:
            over = f"dp={self.mesh.dp}" if self.mesh.cp == 1 else f"dp / cp = {self.mesh.samples}"
            raise ValueError(
                f"{over} x micro_batch_size={t.micro_batch_size} x "
                f"grad_accum_steps={t.grad_accum_steps} = {per_step} does not equal "
                f"global_batch={t.global_batch}"
            )

    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    @property
    def virtual_stages(self) -> int:
        """Pipeline stages the model is cut into: pp x chunks per rank (stage c on rank c mod pp)."""
        return self.mesh.pp * self.training.chunks

    # -- serialisation -------------------------------------------------------

    def to_dict(self, *, seal: bool = True) -> dict[str, Any]:
        """The plan as JSON data; with ``seal``, its ``sha256`` (``seal_digest``) last."""
        out = to_jsonable(self)
        out["world_size"] = self.world_size
        if seal:
            out[SEAL] = seal_digest(out)
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n"

    def save(self, path: str | Path) -> Path:
        return write_text(path, self.to_json())

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        data = dict(data)
        data.pop("world_size", None)
        data.pop(SEAL, None)
        return from_jsonable(cls, data)

    def check_matches(
        self, *, fingerprint: str | None = None, world_size: int | None = None
    ) -> None:
        """Refuse a plan made for another model or world size, saying what differs."""
        if fingerprint is not None and fingerprint != self.model.fingerprint:
            raise PlanError(
                f"this plan was made for another model: plan fingerprint "
                f"{self.model.fingerprint} ({self.model.name}, {self.model.num_params:,} params, "
                f"inputs {', '.join(self.model.inputs)}), this model's is {fingerprint}",
                hint="recompile the plan for this model with `partita compile`",
            )
        if world_size is not None and world_size != self.world_size:
            raise PlanError(
                f"this plan needs {self.world_size} processes ({self.mesh}), "
                f"but {world_size} were launched",
                hint=f"launch with `torchrun --nproc-per-node {self.world_size}` "
                f"or recompile for {world_size} devices",
            )
