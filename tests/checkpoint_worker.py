"""Checks run inside each rank of the checkpoint tests (see test_checkpoint.py).

Exact resume: a run that saves at step K and goes on is compared, bit for bit, with a fresh model
(built from another seed, so nothing is inherited) that loads the checkpoint and trains the same
steps: same losses, same parameters and optimizer state afterwards.

Resharding: a checkpoint saved under one plan is loaded under another (other mesh, other ZeRO
stage, other cuts) in the same launch, and training goes on as one process would from that point,
within float tolerance (the reduction order differs between plans).
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist

from dp_worker import OPTIMIZERS, gpt_batch, gpt_loss
from harness import check_close, check_loss, reference_step
from partita.runtime.distributed import DistContext
from partita.runtime.engine import ParallelModel
from partita.core.options import Options
from zero_mesh_worker import mesh_case

K, MORE = 2, 2
RTOL, ATOL = 1e-4, 2e-5


def _plan(name, *, dp=1, tp=1, pp=1, zero=0, schedule="1f1b", accum=2):
    reference, plan, _ = mesh_case(name, pp=pp, tp=tp, dp=dp, cuts_at=(1,) if pp > 1 else (), schedule=schedule,
                                   accum=accum)
    plan = dataclasses.replace(plan, training=dataclasses.replace(plan.training, zero_stage=zero))
    return reference, plan


def _batches(plan, n):
    torch.manual_seed(1234)
    return [gpt_batch(plan.training.global_batch) for _ in range(n)]


def exact_resume(ctx: DistContext, outdir: str, name: str, async_save: bool = False, **mesh) -> dict:
    reference, plan = _plan(name, **mesh)
    batches = _batches(plan, K + MORE)
    path = Path(outdir, "ckpt-" + "-".join(f"{k}{v}" for k, v in mesh.items()) + f"-{name}")
    model = ParallelModel(copy.deepcopy(reference), plan, Options(loss=gpt_loss, optimizer=OPTIMIZERS["adamw"]), ctx=ctx)
    for x, y in batches[:K]:
        model.train_step(x, targets=y)
    assert model.step == K
    pending = model.save_checkpoint(path, extra={"data_position": K}, async_save=async_save)
    if pending is not None:
        pending.result()  # the write went on in the background
    after = [model.train_step(x, targets=y) for x, y in batches[K:]]
    want = model.full_state_dict()

    torch.manual_seed(999)  # another init: everything must come from the checkpoint
    fresh = copy.deepcopy(reference)
    for p in fresh.parameters():
        torch.nn.init.normal_(p)
    resumed = ParallelModel(fresh, plan, Options(loss=gpt_loss, optimizer=OPTIMIZERS["adamw"]), ctx=ctx)
    extra = resumed.load_checkpoint(path)
    assert extra == {"data_position": K} and resumed.step == K
    again = [resumed.train_step(x, targets=y) for x, y in batches[K:]]
    got = resumed.full_state_dict()
    assert again == after, (name, mesh, again, after)  # bit for bit
    for k, v in want.items():
        assert torch.equal(got[k], v), (name, mesh, k)
    assert resumed.step == K + MORE
    return {"case": f"resume/{name}/{mesh}", "losses": again}


def reshard(ctx: DistContext, outdir: str, name: str, src: dict, dst: dict) -> dict:
    reference, plan_a = _plan(name, **src)
    _, plan_b = _plan(name, **dst)
    assert plan_a.training.global_batch == plan_b.training.global_batch
    batches = _batches(plan_a, K + MORE)
    path = Path(outdir, f"reshard-{name}-" + "-".join(f"{k}{v}" for k, v in src.items()))
    a = ParallelModel(copy.deepcopy(reference), plan_a, Options(loss=gpt_loss, optimizer=OPTIMIZERS["adamw"]), ctx=ctx)
    ref = copy.deepcopy(reference)
    ref_opt = OPTIMIZERS["adamw"](ref.parameters())
    for x, y in batches[:K]:
        a.train_step(x, targets=y)
        reference_step(ref, ref_opt, gpt_loss, x, y)
    a.save_checkpoint(path)
    b = ParallelModel(copy.deepcopy(reference), plan_b, Options(loss=gpt_loss, optimizer=OPTIMIZERS["adamw"]), ctx=ctx)
    b.load_checkpoint(path)
    errs = []
    for x, y in batches[K:]:
        loss = b.train_step(x, targets=y)
        ref_loss = reference_step(ref, ref_opt, gpt_loss, x, y)
        errs.append(check_loss(loss, ref_loss, rtol=RTOL, atol=ATOL, what=(name, src, dst)))
    got = b.full_state_dict()
    want = {k: v for k, v in ref.state_dict().items() if k in got}
    err = check_close({k: got[k] for k in want}, want, rtol=RTOL, atol=ATOL, what=f"{src}->{dst}")
    return {"case": f"reshard/{name}/{src}->{dst}", "loss_err": max(errs), "param_err": err}


def to_torch_save(ctx: DistContext, outdir: str, name: str, **mesh) -> dict:
    """torch's own dcp_to_torch_save gives a file the unwrapped model loads with strict=True."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    reference, plan = _plan(name, **mesh)
    path = Path(outdir, f"plain-{name}")
    model = ParallelModel(copy.deepcopy(reference), plan, Options(loss=gpt_loss, optimizer=OPTIMIZERS["adamw"]), ctx=ctx)
    for x, y in _batches(plan, 1):
        model.train_step(x, targets=y)
    model.save_checkpoint(path)
    full = model.full_state_dict()
    if ctx.rank == 0:
        dcp_to_torch_save(str(path), str(path) + ".pt")
        plain = torch.load(str(path) + ".pt", weights_only=False)
        fresh = copy.deepcopy(reference)
        fresh.load_state_dict(plain["model"], strict=True)
        for k, v in fresh.named_parameters():
            assert torch.equal(v.detach(), full[k]), k
    dist.barrier()
    return {"case": f"torch_save/{name}/{mesh}"}


def pretrained(ctx: DistContext, outdir: str, name: str, fmt: str, **mesh) -> dict:
    """A plain state dict (torch.save or safetensors) loads into the plan: every parameter as saved."""
    reference, plan = _plan(name, **mesh)
    torch.manual_seed(77)
    source = copy.deepcopy(reference)
    for p in source.parameters():
        torch.nn.init.normal_(p)
    path = Path(outdir, f"weights-{name}.{'safetensors' if fmt == 'safetensors' else 'pt'}")
    if ctx.rank == 0:
        if fmt == "safetensors":
            from safetensors.torch import save_model

            save_model(source, str(path))
        else:
            torch.save(source.state_dict(), path)
    dist.barrier()
    model = ParallelModel(copy.deepcopy(reference), plan, Options(loss=gpt_loss, optimizer=OPTIMIZERS["adamw"], weights=path), ctx=ctx)
    got = model.full_state_dict()
    for k, v in source.state_dict().items():
        if k in got:
            assert torch.equal(got[k], v), (fmt, mesh, k)
    return {"case": f"pretrained/{fmt}/{mesh}"}


def save_only(ctx: DistContext, outdir: str, name: str, **mesh) -> dict:
    reference, plan = _plan(name, **mesh)
    model = ParallelModel(copy.deepcopy(reference), plan, Options(loss=gpt_loss, optimizer=OPTIMIZERS["adamw"]), ctx=ctx)
    for x, y in _batches(plan, K):
        model.train_step(x, targets=y)
    model.save_checkpoint(Path(outdir, f"save-{name}"))
    return {"case": f"save/{name}/{mesh}"}


def resume_2(ctx: DistContext, out: str) -> list[dict]:
    return [exact_resume(ctx, out, "gpt", dp=2),
            exact_resume(ctx, out, "gpt", dp=2, zero=3, async_save=True),
            exact_resume(ctx, out, "gpt", dp=2, zero=1),
            exact_resume(ctx, out, "gpt", tp=2),
            exact_resume(ctx, out, "tied-gpt", pp=2),
            to_torch_save(ctx, out, "tied-gpt", dp=2, zero=3),
            pretrained(ctx, out, "gpt", "torch", tp=2),
            pretrained(ctx, out, "tied-gpt", "safetensors", pp=2),
            pretrained(ctx, out, "gpt", "safetensors", dp=2, zero=3)]


def save_4(ctx: DistContext, out: str) -> list[dict]:
    return [save_only(ctx, out, "gpt", dp=2, tp=2, zero=3)]


def resume_reshard_4(ctx: DistContext, out: str) -> list[dict]:
    return [exact_resume(ctx, out, "gpt", dp=2, tp=2, zero=3),
            exact_resume(ctx, out, "hf-llama", pp=2, tp=2),
            reshard(ctx, out, "gpt", dict(dp=2, tp=2), dict(pp=2, dp=2, zero=1)),
            reshard(ctx, out, "gpt", dict(dp=4, zero=3, accum=1), dict(tp=2, pp=2, accum=4))]


LAUNCHES = {"resume-2": (2, resume_2), "save-4": (4, save_4), "resume-reshard-4": (4, resume_reshard_4)}
