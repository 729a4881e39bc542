"""What each rank of a multi-process pipeline-parallel test measures (test_runtime_pp.py asserts it).

Every rank builds a pipeline plan with tests/pp_choice.py (the planner's
capture, profile and ``stage_of_nodes`` at chosen layer boundaries; TP from
tests/tp_choice.py), runs partita's ParallelModel and, in the same process, a
single-process reference on the same global batch. It returns both runs' loss
of every step, how far the first step's gradients and the parameters after
STEPS steps of the parameters its stage holds (gathered over tp to full) are
from the reference's, which parameters each stage holds, and the p2p sends
counted per step beside the tensors crossing its cuts (from the planner's
graph) x micro-batches.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from examples.models import GPT, GPTConfig, gpt_tiny
from partita.compiler.timeline import load_trace, measured_timeline
from partita.core.model.inputs import InputSpec
from partita.core.options import Options
from partita.runtime.distributed import DistContext
from partita.runtime.engine import ParallelModel
from partita.runtime.pipeline.stage import schedule_order
from tests.harness import gaps, gather_tp, reference_backward
from tests.pp_choice import expected_sends, pp_plan
from tests.tp_choice import MEGATRON
from tests.workers.dp_worker import OPTIMIZERS, SEQ, gpt_batch, gpt_loss
from tests.workers.tied_script import TiedGPT
from tests.workers.tp_worker import hf_llama_tiny

STEPS = 3
MBS = 2


def tied_gpt() -> TiedGPT:
    return TiedGPT(GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64))


def gpt_4l() -> GPT:
    """gpt_tiny at 4 layers: parts enough for 2 ranks x 3 chunks."""
    return GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=64))


def gpt_manual() -> GPT:
    """gpt_tiny with its attention written out (matmul, softmax, matmul): selective recomputation's case."""
    return GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64, flash=False))


MODELS: dict[str, tuple[Callable, InputSpec]] = {
    "gpt": (gpt_tiny, InputSpec("idx", torch.int64, (1, SEQ))),
    "tied-gpt": (tied_gpt, InputSpec("idx", torch.int64, (1, SEQ))),
    "hf-llama": (hf_llama_tiny, InputSpec("input_ids", torch.int64, (1, SEQ))),
    "gpt-manual": (gpt_manual, InputSpec("idx", torch.int64, (1, SEQ))),
    "gpt-4l": (gpt_4l, InputSpec("idx", torch.int64, (1, SEQ))),
}


def compare(ctx: DistContext, name: str, *, pp: int, cuts_at: list[int], schedule: str, tp: int = 1,
            dp: int = 1, accum: int = 4, trace_dir: str | None = None, chunks: int = 1) -> dict:
    factory, spec = MODELS[name]
    torch.manual_seed(100)
    reference = factory()
    plan, profile, stage = pp_plan(copy.deepcopy(reference), [spec], gpt_loss, None, pp=pp, cuts_at=cuts_at,
                                   schedule=schedule, tp=tp, dp=dp, mbs=MBS, accum=accum,
                                   pins=None if tp == 1 else MEGATRON, chunks=chunks)
    model = ParallelModel(copy.deepcopy(reference), plan, Options(loss=gpt_loss, optimizer=OPTIMIZERS["adamw"]),
                          ctx=ctx)
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
    sends = expected_sends(profile, stage, pp, accum, chunks)[st.index]
    losses, ref_losses, p2p, ref_grads = [], [], [], {}
    for step in range(STEPS):
        losses.append(model.train_step(x, targets=y))
        ref_losses.append(reference_backward(reference, gpt_loss, x, y, accum if dp == 1 else 1))
        if step == 0:
            ref_grads = {n: p.grad.detach().clone() for n, p in reference.named_parameters()}
        ref_opt.step()
        ref_opt.zero_grad()
        calls = model.collectives.calls
        p2p.append(sum(n for (kind, axis, _), n in calls.items() if kind == "send_recv" and axis == "pp"))
    full_grads = gather_tp(model.tensor_parallel, grads)
    full_params = gather_tp(model.tensor_parallel, {n: p.detach() for n, (p, _) in local.items()})
    ref_final = {n: p.detach() for n, p in reference.named_parameters(remove_duplicate=False)}  # tied names too
    owned = {n for n, _ in reference.named_parameters()}  # a tied parameter is held under its first name
    unknown = sorted(set(full_params) - set(ref_final))
    held = [None] * dist.get_world_size()
    dist.all_gather_object(held, sorted(full_params))
    result = {
        "case": f"{name}/dp={dp}/tp={tp}/pp={pp}/{schedule}/m={accum}", "stage": st.index,
        "losses": losses, "ref_losses": ref_losses,
        "grads": gaps({n: full_grads[n] for n in full_grads if n in ref_grads}, ref_grads),
        "params": gaps({n: full_params[n] for n in full_params if n in ref_final}, ref_final),
        # the parameters this rank holds, those that are not the model's, and those no rank holds
        "held": len(full_params), "not_the_models": unknown,
        "held_by_none": sorted(owned - set().union(*map(set, held))),
        "held_by_some": sorted(set().union(*map(set, held)) - owned),
        "p2p_sends": p2p, "expected_sends": sends,
    }
    if trace_dir is not None:
        result["trace"] = trace_of(model, plan, Path(trace_dir, f"{name}-{schedule}-dp{dp}.json"))
    return result


def trace_of(model: ParallelModel, plan, path: Path) -> dict:
    """The trace: its spans (F and B of each micro-batch on each rank), its fingerprint and the
    plan's, and each stage's order of step 0 beside the schedule's; it loads in the plan viewer
    (``measured_timeline`` raises if not)."""
    model.write_trace(path)
    dist.barrier()
    trace = load_trace(path)
    m, p, v = plan.training.grad_accum_steps, plan.mesh.pp, plan.training.chunks
    spans = [ev for ev in trace["traceEvents"] if ev["ph"] == "X"]
    orders = []
    for s in range(p):
        rank = plan.stages[s].ranks[0]
        orders.append({"stage": s,
                       "order": [[ev["name"][0], ev["args"]["microbatch"], ev["args"]["stage"]] for ev in spans
                                 if ev["pid"] == rank and ev["args"]["step"] == 0],
                       "schedule": [list(a) for a in schedule_order(plan.training.schedule, p, s, m, v)]})
    measured_timeline(trace, plan)
    return {"spans": len(spans), "expected_spans": STEPS * 2 * m * v * plan.mesh.world_size,
            "fingerprint": trace["metadata"]["fingerprint"], "plan_fingerprint": plan.model.fingerprint,
            "orders": orders}


def compare_inference(ctx: DistContext, name: str, *, pp: int, cuts_at: list[int], dp: int = 1) -> dict:
    factory, spec = MODELS[name]
    torch.manual_seed(100)
    reference = factory()
    plan, _, _ = pp_plan(copy.deepcopy(reference), [spec], gpt_loss, None, pp=pp, cuts_at=cuts_at, schedule="none",
                         dp=dp, mbs=MBS, accum=4, pins=None, inference=True)
    model = ParallelModel(copy.deepcopy(reference), plan, Options(loss=gpt_loss, optimizer=OPTIMIZERS["adamw"]),
                          ctx=ctx)
    x, _ = gpt_batch(plan.training.global_batch)
    out = model(x)
    with torch.no_grad():
        want = reference(x)
    return {"case": f"{name}/inference/dp={dp}/pp={pp}", "output": gaps([out], [want])}


def pp2(ctx: DistContext, out: str) -> list[dict]:
    return [compare(ctx, "gpt", pp=2, cuts_at=[1], schedule="gpipe"),
            compare(ctx, "gpt", pp=2, cuts_at=[1], schedule="1f1b"),
            compare(ctx, "tied-gpt", pp=2, cuts_at=[1], schedule="1f1b"),
            compare_inference(ctx, "gpt", pp=2, cuts_at=[1]),
            # interleaved 1F1B, 2 chunks per rank: the tied embedding's copies on rank 0 (chunk 0) and rank 1
            compare(ctx, "gpt", pp=2, cuts_at=[0, 1, 2], schedule="interleaved-1f1b", chunks=2, trace_dir=out),
            compare(ctx, "tied-gpt", pp=2, cuts_at=[0, 1, 2], schedule="interleaved-1f1b", chunks=2, accum=6),
            # 3 chunks per rank (the planner weighs up to core/schedule.py MAX_CHUNKS)
            compare(ctx, "gpt-4l", pp=2, cuts_at=[0, 1, 2, 3, 4], schedule="interleaved-1f1b", chunks=3)]


def pp4_dp2xpp2_tp2xpp2(ctx: DistContext, out: str) -> list[dict]:
    return [compare(ctx, "gpt", pp=4, cuts_at=[0, 1, 2], schedule="1f1b", trace_dir=out),
            compare(ctx, "gpt", pp=4, cuts_at=[0, 1, 2], schedule="gpipe", trace_dir=out),
            compare(ctx, "hf-llama", pp=4, cuts_at=[0, 1, 2], schedule="1f1b"),
            compare(ctx, "gpt", pp=2, dp=2, cuts_at=[1], schedule="1f1b"),
            compare(ctx, "gpt", pp=2, tp=2, cuts_at=[1], schedule="gpipe"),
            compare_inference(ctx, "gpt", pp=2, dp=2, cuts_at=[1]),
            compare(ctx, "hf-llama", pp=2, dp=2, cuts_at=[0, 1, 2], schedule="interleaved-1f1b", chunks=2),
            compare(ctx, "gpt", pp=2, tp=2, cuts_at=[0, 1, 2], schedule="interleaved-1f1b", chunks=2, accum=2)]


def dp2xtp2xpp2(ctx: DistContext, out: str) -> list[dict]:
    return [compare(ctx, "gpt", pp=2, tp=2, dp=2, cuts_at=[1], schedule="1f1b", accum=2)]


# launch name -> (world size, the checks each rank runs); dp2xtp2xpp2 (8 ranks) runs in the 8-rank mesh's
# one launch with the other files' 8-rank parts (mesh8_worker.py)
LAUNCHES: dict[str, tuple[int, Callable[[DistContext, str], list[dict]]]] = {
    "pp2": (2, pp2), "pp4-dp2xpp2-tp2xpp2": (4, pp4_dp2xpp2_tp2xpp2),
}

