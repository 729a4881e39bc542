"""Checks run inside each rank of a multi-process data-parallel test (see test_runtime_dp.py),
and the small models, batches, optimizers and hand-built plans the other workers share.

Every rank runs partita's ParallelModel and, in the same process, a plain
single-process reference of the same model over the same global batch, and
compares losses, first-step gradients and final parameters. Failures raise, and
tests/harness.py reports them; the largest errors are returned for the log.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from examples.models import MLP, gpt_tiny
from partita.core.errors import PartitaError, PlanError
from partita.core.plan import (
    Collective, MemoryBreakdown, Mesh, ModelInfo, Plan, Prediction, SolverReport, Training,
)
from harness import check_close, check_loss, reference_step
from partita.runtime.collectives import CollectiveCounter
from partita.runtime.distributed import DistContext
from partita.runtime.engine import ParallelModel
from partita.core.options import Options

RTOL, ATOL = 1e-5, 1e-6
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


def compare_with_reference(ctx: DistContext, dp: int, model_name: str, opt_name: str,
                           *, local: bool = False) -> dict:
    """Train STEPS steps with ParallelModel and with the plain model; assert they match."""
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
    model = ParallelModel(module, plan, Options(loss=loss_fn, optimizer=OPTIMIZERS[opt_name], bucket_bytes=bucket_bytes), ctx=ctx)
    ref_opt = OPTIMIZERS[opt_name](reference.parameters())
    grads, ref_grads = [], []
    _grab_grads(model.optimizer, grads)
    _grab_grads(ref_opt, ref_grads)
    x, y = batch(plan.training.global_batch)
    share = plan.training.global_batch // dp
    expected_calls = sorted((c.kind, c.axis, c.bytes, c.count) for c in plan.collectives)
    loss_errs = []
    for _ in range(STEPS):
        if local:
            rows = slice(ctx.rank * share, (ctx.rank + 1) * share)
            loss = model.train_step(x[rows], targets=y[rows], local=True)
        else:
            loss = model.train_step(x, targets=y)
        ref_loss = reference_step(reference, ref_opt, loss_fn, x, y)
        loss_errs.append(check_loss(loss, ref_loss, rtol=RTOL, atol=ATOL))
        assert model.collectives.as_tuples() == expected_calls, (
            model.collectives.as_tuples(), expected_calls)
        averager = model._program.averager
        assert averager.launched_in_backward == len(averager.buckets)  # overlapped, not after
    case = f"{model_name}/{opt_name}/dp={dp}{'/local' if local else ''}"
    grad_err = check_close(grads[0], ref_grads[0], rtol=RTOL, atol=ATOL, what=f"{case} grad")
    params = [p.detach() for p in model.parameters()]
    ref_params = [p.detach() for p in reference.parameters()]
    param_err = check_close(params, ref_params, rtol=RTOL, atol=ATOL, what=f"{case} param")
    return {"case": case, "loss_err": max(loss_errs), "grad_err": grad_err, "param_err": param_err}


def compare_zero(ctx: DistContext, dp: int, stage: int, model_name: str) -> dict:
    """A ZeRO-``stage`` plan run by ParallelModel against the plain model: losses each step, the
    parameters (gathered) after the last, and the model state each rank holds against the cost model."""
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
    loss_errs = []
    for _ in range(STEPS):
        loss = model.train_step(x, targets=y)
        ref_loss = reference_step(reference, ref_opt, loss_fn, x, y)
        loss_errs.append(check_loss(loss, ref_loss, rtol=RTOL, atol=ATOL, what=stage))
    zero = model._program.zero
    with zero.gathered():
        params = [p.detach().clone() for p in model.module.parameters()]
    ref_params = [p.detach() for p in reference.parameters()]
    param_err = check_close(params, ref_params, rtol=RTOL, atol=ATOL, what=f"zero{stage}/{model_name} param")
    held = zero.state_bytes()
    n = sum(p.numel() for p in reference.parameters())
    predicted = model_state_memory(n, state_bytes_per_param("fp32", "adamw"), zero_stage=stage, dp=dp)
    slack = 4 * (dp - 1) * len(zero.buckets) * 3 + 8 * len(zero.buckets)  # padding + AdamW's step counters
    for part in ("params", "grads", "optimizer"):
        assert abs(held[part] - getattr(predicted, part)) <= slack, (stage, part, held[part], getattr(predicted, part))
    return {"case": f"zero{stage}/{model_name}/dp={dp}", "loss_err": max(loss_errs),
            "param_err": param_err, "state_bytes": held,
            "predicted": {"params": predicted.params, "grads": predicted.grads, "optimizer": predicted.optimizer}}


def check_refusals(ctx: DistContext, dp: int) -> None:
    def refused(make: Callable[[], object], error: type, *words: str) -> None:
        try:
            make()
        except error as e:
            for w in words:
                assert w in str(e), (w, str(e))
        else:
            raise AssertionError(f"expected {error.__name__} mentioning {words}")

    refused(lambda: ParallelModel(mlp(), make_plan(dp + 1), Options(loss=F.mse_loss, optimizer=OPTIMIZERS["sgd"]), ctx=ctx),
            PlanError, f"{dp + 1} processes", f"{dp} were launched")
    refused(lambda: ParallelModel(mlp(), make_plan(dp // 2, tp=2), Options(loss=F.mse_loss, optimizer=OPTIMIZERS["sgd"]), ctx=ctx),
            PlanError, "tp=2", "no tensor-parallel node decisions")
    plan = make_plan(dp)
    model = ParallelModel(mlp(), plan, Options(loss=F.mse_loss, optimizer=OPTIMIZERS["sgd"]), ctx=ctx)
    gb = plan.training.global_batch
    x, y = mlp_batch(gb + 2)
    refused(lambda: model.train_step(x, targets=y), PartitaError,
            f"batch size {gb + 2}", f"global_batch is {gb}")
    refused(lambda: model.train_step(x[:gb], targets=y[:gb], local=True), PartitaError,
            f"batch size {gb}", f"dp={dp}) is {gb // dp}")


def checks(ctx: DistContext) -> list[dict]:
    """Every data-parallel check on this rank: 5 cases, then ZeRO-1/2/3 through ParallelModel, then
    the refusals."""
    world = ctx.world_size
    results = [compare_with_reference(ctx, world, m, o) for m in ("mlp", "gpt") for o in ("adamw", "sgd")]
    results.append(compare_with_reference(ctx, world, "mlp", "adamw", local=True))
    results += [compare_zero(ctx, world, stage, "gpt") for stage in (1, 2, 3)]
    check_refusals(ctx, world)
    return results


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
