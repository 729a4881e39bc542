"""Checks run inside each rank of a multi-process pipeline-parallel test (see test_runtime_pp.py).

Every rank builds a pipeline plan with tests/pp_choice.py (the planner's
capture, profile and ``stage_of_nodes`` at chosen layer boundaries; TP from
tests/tp_choice.py), runs partita's ParallelModel and, in the same process, a
single-process reference on the same global batch. It compares the loss of
every step, the first step's gradients and the parameters after STEPS steps of
the parameters its stage holds (gathered over tp to full), and checks that the
p2p sends counted per step equal the tensors crossing its cuts (from the
planner's graph) x micro-batches. Failures raise, and tests/harness.py reports them.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from dp_worker import OPTIMIZERS, SEQ, gpt_batch, gpt_loss
from examples.models import GPTConfig, gpt_tiny
from harness import check_close, check_loss, gather_tp, reference_backward
from partita.core.inputs import InputSpec
from partita.compiler.timeline import load_trace, measured_timeline
from partita.runtime.distributed import DistContext
from partita.runtime.engine import ParallelModel
from partita.runtime.pipeline.stage import schedule_order
from partita.core.options import Options
from pp_choice import expected_sends, pp_plan
from tied_script import TiedGPT
from tp_choice import MEGATRON
from tp_worker import hf_llama_tiny

RTOL, ATOL = 1e-4, 2e-5
STEPS = 3
MBS = 2


def tied_gpt() -> TiedGPT:
    return TiedGPT(GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64))


MODELS: dict[str, tuple[Callable, InputSpec]] = {
    "gpt": (gpt_tiny, InputSpec("idx", torch.int64, (1, SEQ))),
    "tied-gpt": (tied_gpt, InputSpec("idx", torch.int64, (1, SEQ))),
    "hf-llama": (hf_llama_tiny, InputSpec("input_ids", torch.int64, (1, SEQ))),
}


def compare(ctx: DistContext, name: str, *, pp: int, cuts_at: list[int], schedule: str, tp: int = 1,
            dp: int = 1, accum: int = 4, trace_dir: str | None = None) -> dict:
    factory, spec = MODELS[name]
    torch.manual_seed(100)
    reference = factory()
    plan, profile, stage = pp_plan(copy.deepcopy(reference), [spec], gpt_loss, None, pp=pp, cuts_at=cuts_at,
                                   schedule=schedule, tp=tp, dp=dp, mbs=MBS, accum=accum,
                                   pins=None if tp == 1 else MEGATRON)
    model = ParallelModel(copy.deepcopy(reference), plan, Options(loss=gpt_loss, optimizer=OPTIMIZERS["adamw"]), ctx=ctx)
    st = model.module
    local = st.local_parameters()
    names = {id(p): n for n, (p, _) in local.items()}
    grads: dict[str, torch.Tensor] = {}

    def grab(optimizer, args, kwargs):
        if not grads:
            grads.update({names[id(p)]: p.grad.detach().clone() for g in optimizer.param_groups for p in g["params"]})
    model.optimizer.register_step_pre_hook(grab)
    ref_opt = OPTIMIZERS["adamw"](reference.parameters())
    x, y = gpt_batch(plan.training.global_batch)
    sends = expected_sends(profile, stage, pp, accum)[st.index]
    loss_errs, ref_grads = [], {}
    for step in range(STEPS):
        loss = model.train_step(x, targets=y)
        ref_loss = reference_backward(reference, gpt_loss, x, y, accum if dp == 1 else 1)
        if step == 0:
            ref_grads = {n: p.grad.detach().clone() for n, p in reference.named_parameters()}
        ref_opt.step()
        ref_opt.zero_grad()
        loss_errs.append(check_loss(loss, ref_loss, rtol=RTOL, atol=ATOL, what=(name, step)))
        calls = model.collectives.calls
        p2p = sum(n for (kind, axis, _), n in calls.items() if kind == "send_recv" and axis == "pp")
        assert p2p == sends, (name, "stage", st.index, "p2p sends", p2p, "expected", sends)
    full_grads = gather_tp(model.tensor_parallel, grads)
    full_params = gather_tp(model.tensor_parallel, {n: p.detach() for n, (p, _) in local.items()})
    ref_final = {n: p.detach() for n, p in reference.named_parameters()}
    assert full_params and set(full_params) <= set(ref_final), sorted(set(full_params) - set(ref_final))
    grad_err = check_close(full_grads, ref_grads, rtol=RTOL, atol=ATOL, what=f"{name} stage {st.index} grad")
    param_err = check_close(full_params, ref_final, rtol=RTOL, atol=ATOL, what=f"{name} stage {st.index} param")
    # every parameter is held by some stage
    held = [None] * dist.get_world_size()
    dist.all_gather_object(held, sorted(full_params))
    assert set().union(*map(set, held)) == set(ref_final), name
    result = {
        "case": f"{name}/dp={dp}/tp={tp}/pp={pp}/{schedule}/m={accum}", "stage": st.index,
        "loss_err": max(loss_errs), "grad_err": grad_err, "param_err": param_err,
        "p2p_sends_per_step": sends,
    }
    if trace_dir is not None:
        result["trace"] = check_trace(model, plan, Path(trace_dir, f"{name}-{schedule}.json"))
    return result


def check_trace(model: ParallelModel, plan, path: Path) -> str:
    """The trace has every micro-batch's F and B on every rank, in the schedule's order, and loads
    in the plan viewer."""
    model.write_trace(path)
    dist.barrier()
    trace = load_trace(path)
    m, p = plan.training.grad_accum_steps, plan.mesh.pp
    spans = [ev for ev in trace["traceEvents"] if ev["ph"] == "X"]
    assert len(spans) == STEPS * 2 * m * plan.mesh.world_size, len(spans)
    assert trace["metadata"]["fingerprint"] == plan.model.fingerprint
    for s in range(p):
        rank = plan.stages[s].ranks[0]
        order = [(ev["name"][0], ev["args"]["microbatch"]) for ev in spans
                 if ev["pid"] == rank and ev["args"]["step"] == 0]
        assert order == schedule_order(plan.training.schedule, p, s, m), (s, order)
    measured_timeline(trace, plan)
    return "ok"


def compare_inference(ctx: DistContext, name: str, *, pp: int, cuts_at: list[int], dp: int = 1) -> dict:
    factory, spec = MODELS[name]
    torch.manual_seed(100)
    reference = factory()
    plan, _, _ = pp_plan(copy.deepcopy(reference), [spec], gpt_loss, None, pp=pp, cuts_at=cuts_at, schedule="none",
                         dp=dp, mbs=MBS, accum=4, pins=None, inference=True)
    model = ParallelModel(copy.deepcopy(reference), plan, Options(loss=gpt_loss, optimizer=OPTIMIZERS["adamw"]), ctx=ctx)
    x, _ = gpt_batch(plan.training.global_batch)
    out = model(x)
    with torch.no_grad():
        want = reference(x)
    err = check_close([out], [want], rtol=RTOL, atol=ATOL, what=f"{name} inference output")
    return {"case": f"{name}/inference/dp={dp}/pp={pp}", "out_err": err}


def pp2(ctx: DistContext, out: str) -> list[dict]:
    return [compare(ctx, "gpt", pp=2, cuts_at=[1], schedule="gpipe"),
            compare(ctx, "gpt", pp=2, cuts_at=[1], schedule="1f1b"),
            compare(ctx, "tied-gpt", pp=2, cuts_at=[1], schedule="1f1b"),
            compare_inference(ctx, "gpt", pp=2, cuts_at=[1])]


def pp4_dp2xpp2_tp2xpp2(ctx: DistContext, out: str) -> list[dict]:
    return [compare(ctx, "gpt", pp=4, cuts_at=[0, 1, 2], schedule="1f1b", trace_dir=out),
            compare(ctx, "gpt", pp=4, cuts_at=[0, 1, 2], schedule="gpipe", trace_dir=out),
            compare(ctx, "hf-llama", pp=4, cuts_at=[0, 1, 2], schedule="1f1b"),
            compare(ctx, "gpt", pp=2, dp=2, cuts_at=[1], schedule="1f1b"),
            compare(ctx, "gpt", pp=2, tp=2, cuts_at=[1], schedule="gpipe"),
            compare_inference(ctx, "gpt", pp=2, dp=2, cuts_at=[1])]


def dp2xtp2xpp2(ctx: DistContext, out: str) -> list[dict]:
    return [compare(ctx, "gpt", pp=2, tp=2, dp=2, cuts_at=[1], schedule="1f1b", accum=2)]


# launch name -> (world size, the checks each rank runs)
LAUNCHES: dict[str, tuple[int, Callable[[DistContext, str], list[dict]]]] = {
    "pp2": (2, pp2), "pp4-dp2xpp2-tp2xpp2": (4, pp4_dp2xpp2_tp2xpp2), "dp2xtp2xpp2": (8, dp2xtp2xpp2),
}
