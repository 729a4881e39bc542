"""What each rank of a multi-process data-parallel test measures (test_runtime_dp.py asserts it),
and the small models, batches, optimizers and hand-built plans the other workers share.

Every rank runs partita's ParallelModel and, in the same process, a plain
single-process reference of the same model over the same global batch, and
returns both runs' losses, how far the first step's gradients and the final
parameters are from the reference's (``harness.gaps``), the collectives counted
each step and the plan's list, and the messages of the refusals.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from examples.models import MLP, gpt_tiny
from partita.core.errors import PartitaError, PlanError
from partita.core.mesh import Mesh
from partita.core.options import Options
from partita.core.plans.plan import Collective, MemoryBreakdown, ModelInfo, Plan, Prediction, SolverReport, Training
from partita.runtime.collectives import CollectiveCounter
from partita.runtime.distributed import DistContext
from partita.runtime.engine import ParallelModel
from tests.harness import gaps, reference_step

STEPS = 3
ACCUM = 2
MBS = 2
SEQ = 16
GPT_VOCAB = 256


def make_plan(dp: int, collectives: tuple[Collective, ...] = (), *, tp: int = 1,
              mbs: int = MBS, accum: int = ACCUM, zero_stage: int = 0) -> Plan:
    """A hand-built plan: only mesh, training and collectives matter to the runtime."""
    mem = MemoryBreakdown(params=0, grads=0, optimizer=0, activations=0, capacity=1 << 30)
    return Plan(
        model=ModelInfo("test", "0" * 16, 0, 0, (), "none", 0),
        cluster={},
        mesh=Mesh(dp=dp, tp=tp),
        training=Training(global_batch=dp * mbs * accum, micro_batch_size=mbs,
                          grad_accum_steps=accum, zero_stage=zero_stage),
        predicted=Prediction(0.0, 0.0, {}, 0.0, mem, {}, 0.0, None, 0.0, 0.0),
        solver=SolverReport("hand", "OPTIMAL", 0.0, 0.0, 1),
        collectives=collectives,
    )


def loss_collective(dp: int) -> Collective:
    return Collective("all_reduce", "dp", 4, 1, dp, "loss averaging", 0.0)


def grad_collective(nbytes: int, count: int, dp: int) -> Collective:
    return Collective("all_reduce", "dp", nbytes, count, dp, "gradient averaging", 0.0)


# MLP(16, 32, 8, layers=3): parameters in order w0 (32x16) b0 (32) w1 (32x32) b1 (32)
# w2 (8x32) b2 (8), fp32. Reversed: b2 32 B, w2 1024, b1 128, w1 4096 -> 5280 B >= 4096,
# closes; then b0 128, w0 2048 -> 2176 B at the end.
MLP_BUCKET_BYTES = 4096
MLP_BUCKETS = (5280, 2176)


def mlp() -> nn.Module:
    return MLP(d_in=16, hidden=32, d_out=8, layers=3)


def mlp_batch(global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(global_batch, 16, generator=g), torch.randn(global_batch, 8, generator=g)


def gpt_batch(global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    idx = torch.randint(0, GPT_VOCAB, (global_batch, SEQ + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# eps=1e-5, not 1e-8: the attention's key biases get gradients that are pure rounding
# noise (softmax ignores a constant shift), and with a tiny eps Adam scales that noise
# to lr-sized steps that differ between any two summation orders.
OPTIMIZERS: dict[str, Callable] = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, eps=1e-5, weight_decay=0.1),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
}


def _grab_grads(opt: torch.optim.Optimizer, store: list) -> None:
    """Keep a copy of the gradients the optimizer sees at its first step."""
    def hook(optimizer, args, kwargs):
        if not store:
            store.append([p.grad.detach().clone() for g in optimizer.param_groups for p in g["params"]])
    opt.register_step_pre_hook(hook)


def raised(make: Callable[[], object], error: type[Exception]) -> str | None:
    """The message of the ``error`` that ``make()`` raises; None if it raises nothing (another
    exception propagates)."""
    try:
        make()
    except error as e:
        return str(e)
    return None


def compare_with_reference(ctx: DistContext, dp: int, model_name: str, opt_name: str,
                           *, local: bool = False) -> dict:
    """Train STEPS steps with ParallelModel and with the plain model: both runs' losses, the
    gradients and final parameters against the reference's, the collectives of each step and
    the buckets averaged during backward."""
    factory, batch, loss_fn = (
        (mlp, mlp_batch, F.mse_loss) if model_name == "mlp" else (gpt_tiny, gpt_batch, gpt_loss)
    )
    torch.manual_seed(100)
    reference = factory()
    torch.manual_seed(100 + ctx.rank)  # other ranks start elsewhere: the broadcast must fix it
    module = factory()
    if model_name == "mlp":
        buckets = MLP_BUCKETS
        bucket_bytes = MLP_BUCKET_BYTES
        collectives = (grad_collective(buckets[0], 1, dp), grad_collective(buckets[1], 1, dp))
    else:  # the default 25 MiB bucket holds the whole tiny GPT
        bucket_bytes = 25 * 1024 * 1024
        nbytes = 4 * sum(p.numel() for p in reference.parameters())
        collectives = (grad_collective(nbytes, 1, dp),)
    plan = make_plan(dp, collectives + (loss_collective(dp),))
    model = ParallelModel(module, plan, Options(loss=loss_fn, optimizer=OPTIMIZERS[opt_name],
                                                bucket_bytes=bucket_bytes), ctx=ctx)
    ref_opt = OPTIMIZERS[opt_name](reference.parameters())
    grads, ref_grads = [], []
    _grab_grads(model.optimizer, grads)
    _grab_grads(ref_opt, ref_grads)
    x, y = batch(plan.training.global_batch)
    share = plan.training.global_batch // dp
    losses, ref_losses, calls, launched = [], [], [], []
    for _ in range(STEPS):
        if local:
            rows = slice(ctx.rank * share, (ctx.rank + 1) * share)
            losses.append(model.train_step(x[rows], targets=y[rows], local=True))
        else:
            losses.append(model.train_step(x, targets=y))
        ref_losses.append(reference_step(reference, ref_opt, loss_fn, x, y))
        calls.append(model.collectives.as_tuples())
        averager = model._program.averager
        launched.append([averager.launched_in_backward, len(averager.buckets)])
    params = [p.detach() for p in model.parameters()]
    ref_params = [p.detach() for p in reference.parameters()]
    return {"case": f"{model_name}/{opt_name}/dp={dp}{'/local' if local else ''}",
            "losses": losses, "ref_losses": ref_losses,
            "grads": gaps(grads[0], ref_grads[0]), "params": gaps(params, ref_params),
            "calls": calls, "planned_calls": sorted([c.kind, c.axis, c.bytes, c.count] for c in plan.collectives),
            # per step: the buckets whose all-reduce started during backward, and the buckets
            "launched_in_backward": launched}


def compare_zero(ctx: DistContext, dp: int, stage: int, model_name: str) -> dict:
    """A ZeRO-``stage`` plan run by ParallelModel against the plain model: losses each step, the
    parameters (gathered) after the last, and the model state each rank holds beside the cost model's."""
    from partita.passes.cost_model import model_state_memory, state_bytes_per_param

    factory, batch, loss_fn = (
        (mlp, mlp_batch, F.mse_loss) if model_name == "mlp" else (gpt_tiny, gpt_batch, gpt_loss)
    )
    torch.manual_seed(100)
    reference = factory()
    torch.manual_seed(100 + ctx.rank)
    plan = make_plan(dp, zero_stage=stage)
    model = ParallelModel(factory(), plan, Options(loss=loss_fn, optimizer=OPTIMIZERS["adamw"]), ctx=ctx)
    ref_opt = OPTIMIZERS["adamw"](reference.parameters())
    x, y = batch(plan.training.global_batch)
    losses, ref_losses = [], []
    for _ in range(STEPS):
        losses.append(model.train_step(x, targets=y))
        ref_losses.append(reference_step(reference, ref_opt, loss_fn, x, y))
    zero = model._program.zero
    with zero.gathered():
        params = [p.detach().clone() for p in model.module.parameters()]
    ref_params = [p.detach() for p in reference.parameters()]
    n = sum(p.numel() for p in reference.parameters())
    predicted = model_state_memory(n, state_bytes_per_param("fp32", "adamw"), zero_stage=stage, dp=dp)
    return {"case": f"zero{stage}/{model_name}/dp={dp}", "losses": losses, "ref_losses": ref_losses,
            "params": gaps(params, ref_params), "held": zero.state_bytes(), "buckets": len(zero.buckets),
            "predicted": {"params": predicted.params, "grads": predicted.grads, "optimizer": predicted.optimizer}}


def refusals(ctx: DistContext, dp: int) -> dict[str, str | None]:
    """The messages of what the runtime refuses (None: it did not): a plan for another world
    size, tp without node decisions (PlanError), a global batch and a local one of the wrong size
    (PartitaError)."""
    options = Options(loss=F.mse_loss, optimizer=OPTIMIZERS["sgd"])
    out = {
        "other world size": raised(lambda: ParallelModel(mlp(), make_plan(dp + 1), options, ctx=ctx), PlanError),
        "tp without nodes": raised(lambda: ParallelModel(mlp(), make_plan(dp // 2, tp=2), options, ctx=ctx),
                                   PlanError),
    }
    plan = make_plan(dp)
    model = ParallelModel(mlp(), plan, options, ctx=ctx)
    gb = plan.training.global_batch
    x, y = mlp_batch(gb + 2)
    out["global batch"] = raised(lambda: model.train_step(x, targets=y), PartitaError)
    out["local batch"] = raised(lambda: model.train_step(x[:gb], targets=y[:gb], local=True), PartitaError)
    return out


def checks(ctx: DistContext) -> dict:
    """Every data-parallel case on this rank: 5 cases, then ZeRO-1/2/3 through ParallelModel; then
    the refusals."""
    world = ctx.world_size
    cases = [compare_with_reference(ctx, world, m, o) for m in ("mlp", "gpt") for o in ("adamw", "sgd")]
    cases.append(compare_with_reference(ctx, world, "mlp", "adamw", local=True))
    cases += [compare_zero(ctx, world, stage, "gpt") for stage in (1, 2, 3)]
    return {"cases": cases, "refusals": refusals(ctx, world)}


def bf16_mean_kept(ctx: DistContext) -> dict:
    """bf16 gradients averaged in fp32 over 2 ranks: ``reduced_grads`` holds the fp32 mean of the
    ranks' bf16 gradients exactly (no rounding to bf16), while ``.grad`` keeps this rank's own."""
    import torch.distributed as dist

    from partita.runtime.dp.averaging import apply_data_parallel

    torch.manual_seed(0)
    p = nn.Parameter(torch.zeros(1000, dtype=torch.bfloat16))
    averager = apply_data_parallel([p], dist.group.WORLD, bucket_bytes=1 << 20, counter=CollectiveCounter(),
                                   axis="dp", reduce_dtype=torch.float32, keep_reduced=True)
    g = torch.Generator().manual_seed(1 + ctx.rank)
    mine = torch.randn(1000, generator=g).to(torch.bfloat16)
    averager.begin(sync=True)
    (p.float() * mine.float()).sum().backward()  # .grad = mine (bf16)
    averager.finish()
    theirs = [torch.zeros(1000, dtype=torch.bfloat16) for _ in range(2)]
    dist.all_gather(theirs, mine)
    exact = (theirs[0].float() / 2 + theirs[1].float() / 2)
    reduced = averager.reduced_grads()[id(p)]
    out = {"dtype": str(reduced.dtype), "exact": bool(torch.equal(reduced, exact)),
           "own_grad_kept": bool(torch.equal(p.grad, mine)),
           "rounding_differs": bool(not torch.equal(exact.to(torch.bfloat16).float(), exact))}
    averager.zero_grad()
    out["freed"] = averager.reduced_grads() == {}
    return out
