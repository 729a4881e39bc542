"""The batch a step is given: checked against the plan, then cut into this rank's share.

``ParallelModel.train_step``, ``evaluate`` and a pipeline model's forward all take
the global batch (the same on every rank) or, with ``local=True``, this rank's
share of it. ``check_batch`` refuses anything the plan was not made for before
any of it runs (the number of inputs, then per tensor its batch size, the other
dims and the dtype, against the captured inputs and targets); ``share`` takes
this rank's rows over "dp" (of its sample group at cp > 1, and its slice of each sequence);
``check_same_batch`` all-gathers a fingerprint per
rank to catch a rank whose data loader drifted. With ``local=True`` a pipeline
rank may pass None for an input (or the targets) its stage does not read
(``stage_reads``): the first stage reads the inputs, the last the targets.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from partita.core.errors import PartitaError
from partita.core.model.inputs import parse_input_spec
from partita.runtime.collectives import CollectiveCounter, all_gather_flat
from partita.runtime.program import Program
from partita.runtime.rng import fingerprint


def stage_reads(program: Program) -> frozenset[int] | None:
    """Which of the step's fields (the planned inputs in order, then the targets) this rank's
    pipeline stage reads; None off a pipeline (every rank reads them all)."""
    return program.pipeline.reads if program.pipeline is not None else None


def field_names(program: Program) -> list[str]:
    """The step's fields by name: the planned inputs in order, then "targets" (a training plan's)."""
    model = program.plan.model
    return [*(parse_input_spec(s).name for s in model.inputs), *(["targets"] if model.targets else [])]


def fields_read(program: Program) -> tuple[str, ...]:
    """The names of the step's fields this rank reads (``stage_reads``'s, all of them off a pipeline)."""
    reads = stage_reads(program)
    return tuple(n for i, n in enumerate(field_names(program)) if reads is None or i in reads)


def check_batch(program: Program, inputs: tuple[Any, ...], targets: Any, *, local: bool, caller: str,
                with_targets: bool = True) -> None:
    """Refuse a batch the plan was not made for (module docstring); ``caller`` names the call in
    the message (``train_step``, ``evaluate``, ``the model``); ``with_targets``: the call takes
    targets (a step's loss), which must then be given."""
    reads = stage_reads(program) if local else None
    if with_targets and targets is None and (reads is None or len(inputs) in reads):
        raise PartitaError(f"{caller} got targets=None: the step's loss needs the targets",
                           hint=f"pass them as {caller}(*inputs, targets=y)")
    plan = program.plan
    tr = plan.training
    specs = [parse_input_spec(s) for s in plan.model.inputs]
    if specs and len(inputs) != len(specs):
        raise PartitaError(f"{caller} got {len(inputs)} input{'s' if len(inputs) != 1 else ''}, but the model "
                           f"was planned for {len(specs)} ({', '.join(plan.model.inputs)})",
                           hint="pass the model's inputs positionally, in the order they were planned, "
                           "and the targets as targets=")
    per_rank = tr.global_batch // program.samples
    expected = per_rank if local else tr.global_batch
    over = f"dp={program.dp_size}" if program.cp == 1 else f"dp / cp = {program.samples}"
    scope = (f"this rank's share (global_batch={tr.global_batch} / {over})" if local
             else "the plan's global_batch")
    target_spec = parse_input_spec(plan.model.targets) if plan.model.targets else None
    pairs = [(i, x, spec, f"input {i} ({spec.name})") for i, (x, spec) in enumerate(zip(inputs, specs))]
    if targets is not None:
        pairs.append((len(inputs), targets, target_spec, "targets"))
    for j, t, spec, what in pairs:
        if t is None and reads is not None:
            if j not in reads:
                continue  # a field this pipeline stage does not read
            raise PartitaError(f"{caller} got {what} as None, but this rank's pipeline stage reads it",
                               hint=f"pass this rank's share of {what}; model.reads names what each rank "
                               "needs")
        if not isinstance(t, torch.Tensor):
            raise PartitaError(f"{caller} got {what} as {type(t).__name__}, not a tensor", hint="pass torch tensors")
        if t.is_meta:
            raise PartitaError(f"{caller} got {what} on the meta device: it has a shape but no values to compute on",
                               hint="pass tensors with data, on the CPU or this rank's device")
        size = t.shape[0] if t.dim() > 0 else None
        if size != expected:
            raise PartitaError(
                f"{caller} got {what} with batch size {size}, but {scope} is {expected}",
                hint=(f"pass {per_rank} rows per rank" if local else
                      f"pass the same global batch of {expected} on every rank, or local=True with "
                      f"{per_rank} rows per rank"))
        if spec is None:
            continue
        if tuple(t.shape[1:]) != tuple(spec.shape[1:]):
            raise PartitaError(f"{caller} got {what} with shape {list(t.shape)}, but the plan was made for "
                               f"{spec}: every dim but the batch must match",
                               hint="pass tensors of the planned shape, or recompile for this shape")
        if t.dtype != spec.dtype:
            name = str(spec.dtype).removeprefix("torch.")
            raise PartitaError(f"{caller} got {what} with dtype {str(t.dtype).removeprefix('torch.')}, but the "
                               f"plan was made for {spec}",
                               hint=f"convert it (.to(torch.{name})) or recompile for this dtype")


def tokens_per_sample(program: Program, inputs: tuple[Any, ...], targets: Any) -> int | None:
    """Tokens in one sample: the first input's non-batch elements when it holds integers (token
    ids), else None. From the plan's spec, which ``check_batch`` held the tensors to, so a
    pipeline rank that was passed None for it counts alike."""
    specs = program.plan.model.inputs
    if specs:
        spec = parse_input_spec(specs[0])
        shape, floating = spec.shape, spec.dtype.is_floating_point
    else:
        first = next((t for t in (*inputs, targets) if t is not None), None)
        if first is None:
            return None
        shape, floating = first.shape, first.is_floating_point()
    return math.prod(shape[1:]) if not floating and len(shape) > 1 else None


def share(program: Program, t: torch.Tensor | None, *, local: bool) -> torch.Tensor | None:
    """This rank's rows of ``t`` (checked by ``check_batch``), on its device; None (a field
    this pipeline stage does not read) stays None."""
    if t is None:
        return None
    if not local and program.samples > 1:
        rows = t.shape[0] // program.samples
        t = t.narrow(0, program.sample_rank * rows, rows)
    return program.sequence_slice(t).to(program.ctx.device, non_blocking=True)


def check_same_batch(program: Program, tensors: list[torch.Tensor], counter: CollectiveCounter, *, step: int,
                     caller: str) -> None:
    """Every rank passed the same global batch (a fingerprint per rank, all-gathered): one rank
    with other data would otherwise train on silently."""
    ctx = program.ctx
    mine = torch.tensor([fingerprint(t) for t in tensors], dtype=torch.int64, device=ctx.device)
    every = mine.new_empty(ctx.world_size * mine.numel())
    with counter.blocking("all_gather", "world"):
        all_gather_flat(every, mine)
    every = every.cpu().view(ctx.world_size, mine.numel())
    differ = [r for r in range(ctx.world_size) if not torch.equal(every[r], every[0])]
    if differ:
        raise PartitaError(
            f"rank{'s' if len(differ) > 1 else ''} {', '.join(map(str, differ))} passed another global batch "
            f"to {caller} than rank 0 at step {step}",
            hint="every rank must pass the same global batch (seed the data loader alike on every rank), "
            "or pass local=True with each rank's own share")
