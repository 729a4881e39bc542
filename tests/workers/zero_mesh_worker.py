"""What each rank of the ZeRO-with-TP-and-PP tests measures (test_runtime_zero_mesh.py asserts it).

ZeRO over the dp axis of a 2- or 3-axis mesh: each rank builds a test plan
(tests/pp_choice.py's cuts, tests/tp_choice.py's Megatron TP) with the ZeRO
stage set, runs partita's ParallelModel and, in the same process, a
single-process reference on the same global batch, and returns what the test
checks:

- the loss of every step, the first step's gradients (ZeRO's shard gradients
  gathered over dp, then the TP shards over tp) and, after STEPS steps, every
  parameter (``full_state_dict``) against the reference;
- the model state each rank holds (the bytes of the tensors ZeRO keeps) against
  ``cost_model.model_state_memory`` of the parameters its stage holds, exact up to
  the documented padding (at most dp - 1 elements per bucket) and AdamW's step
  counters;
- the dp collectives of a step, call for call: ``zero_collectives(stage, m)`` per
  bucket, buckets laid out by the planner's ``bucket_layout`` over the stage's
  TP-local parameters; stage 3 keeps no gathered bucket after the step.

A parameter tied across stages stays out of ZeRO (engine.compose): it is
averaged whole, and its bytes are counted apart.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from partita.core.options import Options
from partita.passes.cost_model import model_state_memory, state_bytes_per_param, zero_collectives
from partita.runtime.distributed import DistContext
from partita.runtime.dp.buckets import bucket_layout
from partita.runtime.engine import ParallelModel
from tests.harness import gaps, gather_tp, reference_step
from tests.pp_choice import pp_plan
from tests.tp_choice import MEGATRON
from tests.workers.dp_worker import OPTIMIZERS, gpt_batch, gpt_loss
from tests.workers.pp_worker import MODELS

STEPS = 3
MBS = 2
BUCKET_BYTES = 48 * 1024  # several buckets per stage, some straddling modules


def _short(name: str) -> str:
    """A ZeRO program's parameter name (``tp.shards.a/b``) as the model's (``a.b``)."""
    return name.split("shards.")[-1].replace("/", ".")


def mesh_case(name: str, *, pp: int, tp: int, dp: int, cuts_at: tuple[int, ...], schedule: str, accum: int):
    """(reference model, test plan, profile) for MODELS[name] on a dp x tp x pp mesh
    (tests/pp_choice.py's cuts, tests/tp_choice.py's Megatron TP at tp > 1)."""
    factory, spec = MODELS[name]
    torch.manual_seed(100)
    reference = factory()
    plan, profile, _ = pp_plan(copy.deepcopy(reference), [spec], gpt_loss, None, pp=pp, cuts_at=list(cuts_at),
                               schedule=schedule if pp > 1 else "none", tp=tp, dp=dp, mbs=MBS, accum=accum,
                               pins=None if tp == 1 else MEGATRON)
    return reference, plan, profile


def compare(ctx: DistContext, name: str, *, zero: int, dp: int, pp: int = 1, tp: int = 1,
            cuts_at: tuple[int, ...] = (), schedule: str = "1f1b", accum: int = 4) -> dict:
    import dataclasses

    reference, plan, _ = mesh_case(name, pp=pp, tp=tp, dp=dp, cuts_at=cuts_at, schedule=schedule, accum=accum)
    plan = dataclasses.replace(plan, training=dataclasses.replace(plan.training, zero_stage=zero,
                                                                  grad_bucket_bytes=BUCKET_BYTES))
    model = ParallelModel(copy.deepcopy(reference), plan, Options(loss=gpt_loss, optimizer=OPTIMIZERS["adamw"]),
                          ctx=ctx)
    zp = model._program.zero
    if zp is None:
        raise RuntimeError(f"no ZeRO program for a ZeRO-{zero} plan ({plan.mesh})")
    program = model._program
    tp_program = model.tensor_parallel
    local = tp_program.local_parameters()  # qualified name -> (TP-local parameter, placement)
    in_zero = {id(p) for b in zp.buckets for p in b.members}
    grads: dict[str, torch.Tensor] = {}

    def grab(optimizer, args, kwargs):  # the first step's averaged gradients, before the update
        if not grads:
            grads.update({_short(n): g for n, g in zp.gather_grads().items()})
            for q, (p, _) in local.items():
                if id(p) not in in_zero and p.grad is not None:  # tied across stages: averaged whole
                    grads[q] = p.grad.detach().clone()
    zp.optimizer.register_step_pre_hook(grab)

    ref_opt = OPTIMIZERS["adamw"](reference.parameters())
    x, y = gpt_batch(plan.training.global_batch)
    losses, ref_losses, dp_calls, ref_grads = [], [], [], {}
    for step in range(STEPS):
        losses.append(model.train_step(x, targets=y))
        if step > 0:  # step 0's counts include the test's own gather_grads
            dp_calls.append(sorted([k, b, c] for (k, axis, b), c in model.collectives.calls.items()
                                   if axis == "dp" and k in ("reduce_scatter", "all_gather")))
        ref_losses.append(reference_step(reference, ref_opt, gpt_loss, x, y, ref_grads if step == 0 else None))

    full_grads = gather_tp(tp_program, {q: grads[q] for q in local})
    final = model.full_state_dict(buffers=False)
    ref_final = {n: p.detach() for n, p in reference.named_parameters(remove_duplicate=False)}  # tied names too

    # Model state held: the cost model's figure for this rank's (stage's, TP-local) parameters.
    bucket_of = {id(p): b for b in zp.buckets for p in b.members}
    # the parameters at their TP-local shapes (ZeRO-3 parks them empty between uses)
    zero_params = [torch.empty(bucket_of[id(p)].shapes[bucket_of[id(p)].index[id(p)]], device="meta",
                               requires_grad=True) for p, _ in local.values() if id(p) in in_zero]
    numel = sum(p.numel() for p in zero_params)
    predicted = model_state_memory(numel, state_bytes_per_param("fp32", "adamw"), zero_stage=zero, dp=dp)

    # The dp collectives of a step, call for call, from the planner's bucket rule.
    expected: dict[tuple[str, int], int] = {}
    for b in zp.buckets:
        for kind, calls, _ in zero_collectives(zero, accum):
            expected[(kind, b.nbytes)] = expected.get((kind, b.nbytes), 0) + calls
    stage = program.pipeline.index if program.pipeline is not None else 0
    return {
        "case": f"{name}/zero{zero}/dp={dp}/tp={tp}/pp={pp}/{schedule if pp > 1 else 'none'}/m={accum}",
        "stage": stage, "zero": zero, "zero_stage": zp.stage, "dp": dp, "losses": losses, "ref_losses": ref_losses,
        "grads": gaps(full_grads, ref_grads),
        "params": gaps({k: v for k, v in final.items() if k in ref_final}, ref_final),
        "names_unlike_the_models": sorted(set(final) ^ set(ref_final)),
        # the model state held, and the cost model's for the rank's parameters
        "held": zp.state_bytes(), "predicted": [predicted.params, predicted.grads, predicted.optimizer],
        "buckets": len(zp.buckets),
        "bucket_bytes": [b.numel * 4 for b in zp.buckets], "planner_buckets": bucket_layout(zero_params, BUCKET_BYTES),
        "gathered_bytes": [b.params_flat.untyped_storage().nbytes() for b in zp.buckets],
        # each step after the first: [kind, bytes, calls] of the dp collectives, and the planner's rule's
        "dp_calls": dp_calls, "expected_dp_calls": sorted([k, b, c] for (k, b), c in expected.items()),
        "tied_outside_zero": sum(1 for p, _ in local.values() if id(p) not in in_zero),
    }


def dp2xpp2(ctx: DistContext, out: str) -> list[dict]:
    return [compare(ctx, "gpt", zero=1, dp=2, pp=2, cuts_at=(1,), schedule="1f1b"),
            compare(ctx, "gpt", zero=2, dp=2, pp=2, cuts_at=(1,), schedule="gpipe"),
            compare(ctx, "gpt", zero=3, dp=2, pp=2, cuts_at=(1,), schedule="1f1b"),
            compare(ctx, "tied-gpt", zero=3, dp=2, pp=2, cuts_at=(1,), schedule="1f1b")]


def dp2xtp2(ctx: DistContext, out: str) -> list[dict]:
    return [compare(ctx, "gpt", zero=3, dp=2, tp=2, accum=2), compare(ctx, "hf-llama", zero=3, dp=2, tp=2, accum=2)]


def dp2xtp2xpp2(ctx: DistContext, out: str) -> list[dict]:
    return [compare(ctx, "gpt", zero=3, dp=2, tp=2, pp=2, cuts_at=(1,), schedule="1f1b", accum=2)]


# dp2xtp2xpp2 (8 ranks) runs in the 8-rank mesh's one launch with the other files' 8-rank parts (mesh8_worker.py)
LAUNCHES: dict[str, tuple[int, Callable[[DistContext, str], list[dict]]]] = {
    "dp2xpp2": (4, dp2xpp2), "dp2xtp2": (4, dp2xtp2),
}
