"""What each rank of the activation-recomputation tests measures (test_runtime_recompute.py asserts it).

Each rank builds a test plan (tests/pp_choice.py's cuts, tests/tp_choice.py's
Megatron TP, the repeated layers from the planner's profile), and runs it twice,
as given and with ``Stage.recompute`` set on the chosen stages, side by side with
a single-process reference on the same global batch. It returns what the test checks:

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
from collections.abc import Callable

import torch
from torch.autograd.graph import saved_tensors_hooks

from partita.core.options import Options
from partita.core.recompute import FULL, NONE, SELECTIVE, rerun_regions
from partita.runtime.distributed import DistContext
from partita.runtime.engine import ParallelModel
from tests.harness import gaps, gather_tp, reference_step
from tests.workers.dp_worker import OPTIMIZERS, gpt_batch, gpt_loss
from tests.workers.zero_mesh_worker import _short, mesh_case

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

    tp = model.tensor_parallel
    rerun = rerun_regions(plan.stages, plan.nodes, tp.graph_module.graph.nodes, {*tp.param_nodes, *tp.buffer_nodes})
    runs = {n.name for n in tp.nodes}
    mine = [d for d in plan.nodes if d.name in rerun and d.name in runs]
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
            schedule: str = "1f1b", zero: int = 0, recompute: tuple[int, ...] = (0,), accum: int = 2,
            mode: str = FULL) -> dict:
    reference, plan, profile = mesh_case(name, pp=pp, tp=tp, dp=dp, cuts_at=cuts_at, schedule=schedule, accum=accum)
    plan = _with_layers(plan, profile)
    plan = dataclasses.replace(plan, training=dataclasses.replace(plan.training, zero_stage=zero))
    rc_plan = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, recompute=mode if s.index in recompute
                                                                         else NONE) for s in plan.stages))
    options = Options(loss=gpt_loss, optimizer=OPTIMIZERS["adamw"])
    plain = ParallelModel(copy.deepcopy(reference), plan, options, ctx=ctx)
    model = ParallelModel(copy.deepcopy(reference), rc_plan, options, ctx=ctx)
    program = model._program
    stage = program.pipeline.index if program.pipeline is not None else 0
    recomputes = stage in recompute
    saved_plain, saved_rc = [], []
    _measure_saved(plain, saved_plain)
    _measure_saved(model, saved_rc)
    grads: dict[str, torch.Tensor] = {}
    _grab_grads(model, grads)
    extra = _recomputed_forward_calls(rc_plan, model)

    ref_opt = OPTIMIZERS["adamw"](reference.parameters())
    x, y = gpt_batch(plan.training.global_batch)
    losses, plain_losses, ref_losses, added, ref_grads = [], [], [], [], {}
    for step in range(STEPS):
        losses.append(model.train_step(x, targets=y))
        with_rc = Counter(model.collectives.calls)
        plain_losses.append(plain.train_step(x, targets=y))
        without = Counter(plain.collectives.calls)
        if step > 0:  # step 0's counts include the test's own gather_grads
            added.append(sorted([k, a, b, with_rc[(k, a, b)] - without[(k, a, b)]]
                                for (k, a, b) in with_rc.keys() | without.keys()
                                if with_rc[(k, a, b)] != without[(k, a, b)]))
        ref_losses.append(reference_step(reference, ref_opt, gpt_loss, x, y, ref_grads if step == 0 else None))

    full_grads = gather_tp(model.tensor_parallel, grads)
    final = model.full_state_dict(buffers=False)
    plain.full_state_dict()  # a collective: every rank takes part
    ref_final = {n: p.detach() for n, p in reference.named_parameters(remove_duplicate=False)}  # tied names too
    return {
        "case": f"{name}/dp={dp}/tp={tp}/pp={pp}/{schedule if pp > 1 else 'none'}/zero{zero}/m={accum}"
                f"/{mode}{list(recompute)}",
        "stage": stage, "tp": tp, "recomputes": recomputes, "mode": mode,
        "losses": losses, "ref_losses": ref_losses, "plain_losses": plain_losses,
        "grads": gaps(full_grads, ref_grads),
        "params": gaps({k: v for k, v in final.items() if k in ref_final}, ref_final),
        "names_unlike_the_models": sorted(set(final) ^ set(ref_final)),
        # the activation bytes each micro-batch's forward saved, with recomputation and without
        "micro_batches": accum * STEPS, "saved_recompute": saved_rc, "saved_plain": saved_plain,
        # the collectives recomputation added each step after the first, and those the plan's recomputed
        # layers repeat in forward (all as [kind, axis, bytes, calls])
        "added_calls": added, "extra_calls_per_step": sorted([k, a, b, n] for (k, a, b), n in extra.items()),
    }


def two_ranks(ctx: DistContext, out: str) -> list[dict]:
    return [compare(ctx, "gpt", dp=2, zero=1), compare(ctx, "gpt", dp=2, zero=2), compare(ctx, "gpt", tp=2),
            compare(ctx, "gpt", pp=2, cuts_at=(1,), schedule="1f1b", recompute=(0,), accum=4),
            compare(ctx, "hf-llama", tp=2)]


def selective(ctx: DistContext, out: str) -> list[dict]:
    """Selective recomputation: the attention cores of a GPT whose attention is written out (its
    (T, T) scores and probabilities are what selective recomputation drops), and of the fused op."""
    return [compare(ctx, "gpt-manual", dp=2, zero=1, mode=SELECTIVE), compare(ctx, "gpt-manual", tp=2, mode=SELECTIVE),
            compare(ctx, "gpt-manual", pp=2, cuts_at=(1,), recompute=(0,), accum=4, mode=SELECTIVE),
            compare(ctx, "gpt", tp=2, mode=SELECTIVE)]


LAUNCHES: dict[str, tuple[int, Callable[[DistContext, str], list[dict]]]] = {
    "2ranks": (2, two_ranks), "selective": (2, selective)}
