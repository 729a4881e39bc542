"""What each rank of the checkpoint tests measures (test_checkpoint.py asserts it).

Exact resume: a run that saves at step K and goes on, beside a fresh model (built from another
seed, so nothing is inherited) that loads the checkpoint and trains the same steps: both runs'
losses, and how far the fresh model's state is from the first's afterwards.

Resharding: a checkpoint saved under one plan is loaded under another (other mesh, other ZeRO
stage, other cuts) in the same launch, and training goes on beside one process from that point:
both runs' losses and how far the parameters are from the reference's.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist

from partita.core.options import Options
from partita.runtime.distributed import DistContext
from partita.runtime.engine import ParallelModel
from tests.harness import gaps, reference_step
from tests.workers.dp_worker import OPTIMIZERS, gpt_batch, gpt_loss, raised
from tests.workers.zero_mesh_worker import mesh_case

K, MORE = 2, 2
OPTIONS = Options(loss=gpt_loss, optimizer=OPTIMIZERS["adamw"])


def _plan(name, *, dp=1, tp=1, pp=1, zero=0, schedule="1f1b", accum=2, offload="none"):
    reference, plan, _ = mesh_case(name, pp=pp, tp=tp, dp=dp, cuts_at=(1,) if pp > 1 else (), schedule=schedule,
                                   accum=accum)
    plan = dataclasses.replace(plan, training=dataclasses.replace(plan.training, zero_stage=zero, offload=offload))
    return reference, plan


def _batches(plan, n):
    torch.manual_seed(1234)
    return [gpt_batch(plan.training.global_batch) for _ in range(n)]


def exact_resume(ctx: DistContext, outdir: str, name: str, async_save: bool = False, **mesh) -> dict:
    reference, plan = _plan(name, **mesh)
    batches = _batches(plan, K + MORE)
    path = Path(outdir, "ckpt-" + "-".join(f"{k}{v}" for k, v in mesh.items()) + f"-{name}")
    model = ParallelModel(copy.deepcopy(reference), plan, OPTIONS, ctx=ctx)
    for x, y in batches[:K]:
        model.train_step(x, targets=y)
    saved_at = model.step
    pending = model.save_checkpoint(path, extra={"data_position": K}, async_save=async_save)
    if pending is not None:
        pending.result()  # the write went on in the background
    after = [model.train_step(x, targets=y) for x, y in batches[K:]]
    want = model.full_state_dict()

    torch.manual_seed(999)  # another init: everything must come from the checkpoint
    fresh = copy.deepcopy(reference)
    for p in fresh.parameters():
        torch.nn.init.normal_(p)
    resumed = ParallelModel(fresh, plan, OPTIONS, ctx=ctx)
    extra = resumed.load_checkpoint(path)
    loaded_at = resumed.step
    again = [resumed.train_step(x, targets=y) for x, y in batches[K:]]
    got = resumed.full_state_dict()
    return {"case": f"resume/{name}/{mesh}", "saved_at": saved_at, "extra": extra, "loaded_at": loaded_at,
            "ended_at": resumed.step, "losses": again, "first_losses": after,
            "state": gaps({k: got[k] for k in want}, want)}


def reshard(ctx: DistContext, outdir: str, name: str, src: dict, dst: dict) -> dict:
    reference, plan_a = _plan(name, **src)
    _, plan_b = _plan(name, **dst)
    batches = _batches(plan_a, K + MORE)
    path = Path(outdir, f"reshard-{name}-" + "-".join(f"{k}{v}" for k, v in src.items()))
    a = ParallelModel(copy.deepcopy(reference), plan_a, OPTIONS, ctx=ctx)
    ref = copy.deepcopy(reference)
    ref_opt = OPTIMIZERS["adamw"](ref.parameters())
    for x, y in batches[:K]:
        a.train_step(x, targets=y)
        reference_step(ref, ref_opt, gpt_loss, x, y)
    a.save_checkpoint(path)
    b = ParallelModel(copy.deepcopy(reference), plan_b, OPTIONS, ctx=ctx)
    b.load_checkpoint(path)
    losses, ref_losses = [], []
    for x, y in batches[K:]:
        losses.append(b.train_step(x, targets=y))
        ref_losses.append(reference_step(ref, ref_opt, gpt_loss, x, y))
    got = b.full_state_dict()
    want = {k: v for k, v in ref.state_dict().items() if k in got}
    return {"case": f"reshard/{name}/{src}->{dst}", "losses": losses, "ref_losses": ref_losses,
            "params": gaps({k: got[k] for k in want}, want),
            # the two plans' global batches (the test's plans must agree on it)
            "global_batches": [plan_a.training.global_batch, plan_b.training.global_batch]}


def to_torch_save(ctx: DistContext, outdir: str, name: str, **mesh) -> dict:
    """torch's own dcp_to_torch_save gives a file the unwrapped model loads with strict=True (rank 0:
    the refusal's message, None if it loads; how far its parameters are from ``full_state_dict``'s)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    reference, plan = _plan(name, **mesh)
    path = Path(outdir, f"plain-{name}")
    model = ParallelModel(copy.deepcopy(reference), plan, OPTIONS, ctx=ctx)
    for x, y in _batches(plan, 1):
        model.train_step(x, targets=y)
    model.save_checkpoint(path)
    full = model.full_state_dict()
    result = {"case": f"torch_save/{name}/{mesh}"}
    if ctx.rank == 0:
        dcp_to_torch_save(str(path), str(path) + ".pt")
        plain = torch.load(str(path) + ".pt", weights_only=False)
        fresh = copy.deepcopy(reference)
        result["strict_load_refused"] = raised(lambda: fresh.load_state_dict(plain["model"], strict=True),
                                               RuntimeError)
        result["params"] = gaps({k: v.detach() for k, v in fresh.named_parameters()},
                                {k: full[k] for k, _ in fresh.named_parameters()})
    dist.barrier()
    return result


def pretrained(ctx: DistContext, outdir: str, name: str, fmt: str, **mesh) -> dict:
    """A plain state dict (torch.save or safetensors) loads into the plan: how far each of its
    tensors that the plan's state holds is from the one saved."""
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
    options = Options(loss=gpt_loss, optimizer=OPTIMIZERS["adamw"], weights=path)
    model = ParallelModel(copy.deepcopy(reference), plan, options, ctx=ctx)
    got = model.full_state_dict()
    saved = {k: v for k, v in source.state_dict().items() if k in got}
    return {"case": f"pretrained/{fmt}/{mesh}", "state": gaps({k: got[k] for k in saved}, saved)}


def save_only(ctx: DistContext, outdir: str, name: str, **mesh) -> dict:
    reference, plan = _plan(name, **mesh)
    model = ParallelModel(copy.deepcopy(reference), plan, OPTIONS, ctx=ctx)
    for x, y in _batches(plan, K):
        model.train_step(x, targets=y)
    model.save_checkpoint(Path(outdir, f"save-{name}"))
    return {"case": f"save/{name}/{mesh}"}


def resume_2(ctx: DistContext, out: str) -> list[dict]:
    return [exact_resume(ctx, out, "gpt", dp=2),
            exact_resume(ctx, out, "gpt", dp=2, zero=3, async_save=True),
            exact_resume(ctx, out, "gpt", dp=2, zero=1),
            exact_resume(ctx, out, "gpt", dp=2, zero=1, offload="optimizer"),  # the state in host memory
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
