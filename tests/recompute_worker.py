"""Checks run inside each rank of the activation-recomputation tests (see test_runtime_recompute.py).

Each rank builds a test plan (tests/pp_choice.py's cuts, tests/tp_choice.py's
Megatron TP, the repeated layers from the planner's profile), and runs it twice,
as given and with ``Stage.recompute`` set on the chosen stages, side by side with
a single-process reference on the same global batch. It checks:

- the recomputing run's loss every step, its first step's gradients and, after
  STEPS steps, every parameter (``full_state_dict``) against the reference;
- the collectives of a step: the recomputing run's equal the plain run's plus,
  per micro-batch, the forward-side TP collectives of the recomputed nodes this
  rank runs (their ``InputLayout.fwd`` reshards and ``internal`` ones, from the plan);
- the activation bytes saved for backward per micro-batch (each storage once,
  parameters and buffers left out, seen through ``saved_tensors_hooks`` around
  each micro-batch's forward): strictly fewer on a stage that recomputes, the
  same on one that does not.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter
from typing import Callable

import torch
from torch.autograd.graph import saved_tensors_hooks

from dp_worker import OPTIMIZERS, gpt_batch, gpt_loss
from harness import check_close, check_loss, gather_tp, reference_step
from partita.runtime.distributed import DistContext
from partita.runtime.engine import ParallelModel
from partita.core.options import Options
from zero_mesh_worker import _short, mesh_case

RTOL, ATOL = 1e-4, 2e-5
STEPS = 3
MBS = 2


def _with_layers(plan, profile):
    """The plan with each node's repeated layer from the planner's profile (``find_repeated_layers``)."""
    layer = {n: a.get("layer", "") for n, a in profile.graph.nodes(data=True)}
    return dataclasses.replace(plan, nodes=tuple(dataclasses.replace(d, layer=layer.get(d.name, ""))
                                                 for d in plan.nodes))


def _measure_saved(model: ParallelModel, store: list[int]) -> None:
    """Append to ``store`` the activation bytes each micro-batch's forward saves for backward."""
    program = model._program
    holder = model.tensor_parallel or model.module  # the module holding this rank's parameters
    held = {t.untyped_storage().data_ptr() for t in (*holder.parameters(), *holder.buffers())}

    def measured(run: Callable) -> Callable:
        def go(*args, **kwargs):
            storages: dict[int, int] = {}

            def pack(t: torch.Tensor) -> torch.Tensor:
                s = t.untyped_storage()
                if s.data_ptr() not in held:
                    storages[s.data_ptr()] = s.nbytes()  # alive until this micro-batch's backward
                return t

            with saved_tensors_hooks(pack, lambda t: t):
                out = run(*args, **kwargs)
            store.append(sum(storages.values()))
            return out
        return go

    if program.pipeline is not None:
        program.pipeline.forward_micro = measured(program.pipeline.forward_micro)
    else:
        program.loss = measured(program.loss)


def _recomputed_forward_calls(plan, model: ParallelModel) -> Counter:
    """Per step: the TP collectives recomputing this rank's nodes repeats, by the planner's
    ``layout.recompute_collectives`` (the function compile.py lists them with)."""
    from partita.core.tp.layout import recompute_collectives

    stages = {s.index for s in plan.stages if s.recompute}
    runs = {n.name for n in model.tensor_parallel.nodes}
    mine = [d for d in plan.nodes if d.layer and d.stage in stages and d.name in runs]
    calls: Counter = Counter()
    for kind, nbytes, n, _ in recompute_collectives(mine):
        calls[(kind, "tp", nbytes)] += n * plan.training.grad_accum_steps
    return calls


def _grab_grads(model: ParallelModel, store: dict[str, torch.Tensor]) -> None:
    """The first step's averaged TP-local gradients, by parameter name, before the update."""
    zp = model._program.zero
    names = {id(p): q for q, (p, _) in model.tensor_parallel.local_parameters().items()}

    def grab(optimizer, args, kwargs):
        if store:
            return
        if zp is not None:
            store.update({_short(n): g for n, g in zp.gather_grads().items()})
        else:
            store.update({names[id(p)]: p.grad.detach().clone() for g in optimizer.param_groups for p in g["params"]})
    model.optimizer.register_step_pre_hook(grab)


def compare(ctx: DistContext, name: str, *, tp: int = 1, dp: int = 1, pp: int = 1, cuts_at: tuple[int, ...] = (),
            schedule: str = "1f1b", zero: int = 0, recompute: tuple[int, ...] = (0,), accum: int = 2) -> dict:
    reference, plan, profile = mesh_case(name, pp=pp, tp=tp, dp=dp, cuts_at=cuts_at, schedule=schedule, accum=accum)
    plan = _with_layers(plan, profile)
    plan = dataclasses.replace(plan, training=dataclasses.replace(plan.training, zero_stage=zero))
    rc_plan = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, recompute=s.index in recompute)
                                                     for s in plan.stages))
    plain = ParallelModel(copy.deepcopy(reference), plan, Options(loss=gpt_loss, optimizer=OPTIMIZERS["adamw"]), ctx=ctx)
    model = ParallelModel(copy.deepcopy(reference), rc_plan, Options(loss=gpt_loss, optimizer=OPTIMIZERS["adamw"]), ctx=ctx)
    program = model._program
    stage = program.pipeline.index if program.pipeline is not None else 0
    recomputes = stage in recompute
    saved_plain, saved_rc = [], []
    _measure_saved(plain, saved_plain)
    _measure_saved(model, saved_rc)
    grads: dict[str, torch.Tensor] = {}
    _grab_grads(model, grads)
    extra = _recomputed_forward_calls(rc_plan, model)
    assert bool(extra) == (recomputes and tp > 1), (name, stage, extra)  # TP layers send in forward

    ref_opt = OPTIMIZERS["adamw"](reference.parameters())
    x, y = gpt_batch(plan.training.global_batch)
    loss_errs, plain_errs, ref_grads = [], [], {}
    for step in range(STEPS):
        loss = model.train_step(x, targets=y)
        with_rc = Counter(model.collectives.calls)
        plain_loss = plain.train_step(x, targets=y)
        without = Counter(plain.collectives.calls)
        if step > 0:  # step 0's counts include the test's own gather_grads
            diff = {k: with_rc[k] - without[k] for k in with_rc.keys() | without.keys() if with_rc[k] != without[k]}
            assert diff == dict(extra), (name, stage, "recompute added", diff, "expected", dict(extra))
        ref_loss = reference_step(reference, ref_opt, gpt_loss, x, y, ref_grads if step == 0 else None)
        loss_errs.append(check_loss(loss, ref_loss, rtol=RTOL, atol=ATOL, what=(name, step)))
        plain_errs.append(abs(loss - plain_loss))

    full_grads = gather_tp(model.tensor_parallel, grads)
    grad_err = check_close(full_grads, ref_grads, rtol=RTOL, atol=ATOL, what=f"{name} grad")
    final = model.full_state_dict(buffers=False)
    plain.full_state_dict()  # a collective: every rank takes part
    ref_final = {n: p.detach() for n, p in reference.named_parameters()}
    assert set(final) == set(ref_final), sorted(set(final) ^ set(ref_final))
    param_err = check_close(final, ref_final, rtol=RTOL, atol=ATOL, what=f"{name} param")

    # One figure per micro-batch, the same for all (the micro-batches have one shape).
    m = accum * STEPS
    assert len(saved_rc) == len(saved_plain) == m and len(set(saved_rc)) == len(set(saved_plain)) == 1, (
        saved_rc, saved_plain)
    if recomputes:
        assert saved_rc[0] < saved_plain[0], (name, stage, saved_rc[0], saved_plain[0])
    else:
        assert saved_rc[0] == saved_plain[0], (name, stage, saved_rc[0], saved_plain[0])
    return {
        "case": f"{name}/dp={dp}/tp={tp}/pp={pp}/{schedule if pp > 1 else 'none'}/zero{zero}/m={accum}"
                f"/recompute{list(recompute)}",
        "stage": stage, "loss_err": max(loss_errs), "vs_plain_loss_err": max(plain_errs),
        "grad_err": grad_err, "param_err": param_err,
        "saved_bytes_per_micro_batch": {"plain": saved_plain[0], "recompute": saved_rc[0]},
        "extra_calls_per_step": sorted((k, a, b, n) for (k, a, b), n in extra.items()),
    }


def two_ranks(ctx: DistContext, out: str) -> list[dict]:
    return [compare(ctx, "gpt", dp=2, zero=1), compare(ctx, "gpt", dp=2, zero=2), compare(ctx, "gpt", tp=2),
            compare(ctx, "gpt", pp=2, cuts_at=(1,), schedule="1f1b", recompute=(0,), accum=4),
            compare(ctx, "hf-llama", tp=2)]


LAUNCHES: dict[str, tuple[int, Callable[[DistContext, str], list[dict]]]] = {"2ranks": (2, two_ranks)}
