"""What each rank of the mixed-precision test measures (test_mixed_precision.py asserts it, and
says why its tolerances are what they are).

Each case is a plan the planner writes under the CLI's pins with ``precision=bf16-mixed`` (or
fp16-mixed), run for STEPS steps beside a single-process reference that runs the same recipe
(``reference_mixed``, written out here on its own): parameters cast to the low dtype, an fp32
master copy that SGD updates, the forward under autocast, the micro-batches of the plan, and
(fp16) the loss multiplied by the scale and the gradients divided by it. Also: fp16's skipped
step, the model state held under ZeRO 0-3, the bf16 loss curve beside fp32's, gradient clipping,
and one optimizer over a tied parameter.
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from partita.core.errors import PartitaError
from partita.core.model.losses import default_loss, training_loss
from partita.core.options import Options
from partita.core.plans.verify import load_plan
from partita.core.precision import PrecisionPolicy
from partita.runtime.distributed import DistContext
from partita.runtime.engine import ParallelModel
from tests.harness import gaps, max_abs_diff, max_rel_diff
from tests.workers.dp_worker import OPTIMIZERS
from tests.workers.matrix_worker import MODELS

STEPS = 3
SGD = OPTIMIZERS["sgd"]

# (model, label, pins, precision)
PINS_2 = {
    "dp2": dict(dp=2), "dp2-zero1": dict(dp=2, zero=1), "dp2-zero2": dict(dp=2, zero=2),
    "dp2-zero3": dict(dp=2, zero=3), "tp2": dict(tp=2), "tp2-recompute": dict(tp=2, recompute=True),
    "tp2-selective": dict(tp=2, recompute="selective"), "tp2-sp": dict(tp=2, sequence_parallel=True),
    "dp2-offload": dict(dp=2, offload="optimizer"), "dp2-zero2-offload": dict(dp=2, zero=2, offload="optimizer"),
    "pp2-gpipe": dict(pp=2, schedule="gpipe"), "pp2-1f1b": dict(pp=2, schedule="1f1b"),
    "pp2-interleaved": dict(pp=2, schedule="interleaved-1f1b"),
}
PINS_4 = {"dp2xtp2-zero2": dict(dp=2, tp=2, zero=2), "tp2xpp2-1f1b": dict(tp=2, pp=2, schedule="1f1b"),
          "dp2xpp2-zero3": dict(dp=2, pp=2, schedule="gpipe", zero=3)}
CASES_2 = ([("gpt", label, pins, "bf16-mixed") for label, pins in PINS_2.items()]
           + [("mlp", label, PINS_2[label], "bf16-mixed") for label in ("dp2-zero3", "tp2")]
           + [("gpt", label, PINS_2[label], "fp16-mixed") for label in ("dp2", "dp2-zero3", "tp2", "pp2-1f1b")])
CASES_4 = [("gpt", label, pins, "bf16-mixed") for label, pins in PINS_4.items()] + [
    ("hf-llama", "dp2xtp2-zero2", PINS_4["dp2xtp2-zero2"], "bf16-mixed")]


def name(case: tuple) -> str:
    model, label, _, precision = case
    return f"{model}/{label}/{precision}"


def _plan_path(outdir: str, case: tuple) -> Path:
    return Path(outdir, "plans", name(case).replace("/", "__") + ".json")


def compile_case(case: tuple, outdir: str) -> None:
    model, _, pins, precision = case
    factory, spec, _ = MODELS[model]
    _compile(factory, spec, 4 if case in CASES_4 else 2, _plan_path(outdir, case), optimizer="sgd-momentum",
             precision=precision, pins=pins)


def reference_mixed(model: torch.nn.Module, policy: PrecisionPolicy, x: torch.Tensor, y: torch.Tensor,
                    micro_batch: int, steps: int, optimizer: Callable = SGD) -> list[float]:
    """The recipe in one process, written out plainly (module docstring)."""
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.to(policy.param_dtype)
    params = list(model.parameters())
    masters = [torch.nn.Parameter(p.detach().float()) for p in params]
    opt = optimizer(masters)
    scale = 2.0**16 if policy.loss_scaling else 1.0
    chunks = [slice(i, i + micro_batch) for i in range(0, x.shape[0], micro_batch)]
    losses = []
    for _ in range(steps):
        total = 0.0
        for rows in chunks:
            with torch.autocast("cpu", dtype=policy.param_dtype):
                loss = training_loss(default_loss, model, [x[rows]], y[rows])
            (loss * scale / len(chunks)).backward()
            total += loss.item() / len(chunks)
        finite = all(bool(torch.isfinite(p.grad).all()) for p in params if p.grad is not None)
        if finite:
            for p, m in zip(params, masters):
                m.grad = p.grad.float() / scale
            opt.step()
            with torch.no_grad():
                for p, m in zip(params, masters):
                    p.copy_(m)
        else:
            scale /= 2
        for p in params:
            p.grad = None
        losses.append(total)
    return losses


def run_case(ctx: DistContext, case: tuple, outdir: str) -> dict:
    model_name = case[0]
    plan = load_plan(_plan_path(outdir, case), world_size=ctx.world_size)
    policy = PrecisionPolicy.of(plan.training)
    factory, _, batch = MODELS[model_name]
    torch.manual_seed(100)
    reference = factory()
    x, y = batch(plan.training.global_batch)
    try:
        model = ParallelModel(copy.deepcopy(reference), plan, Options(loss=default_loss, optimizer=SGD), ctx=ctx)
        param_dtypes = sorted({str(p.dtype) for p in model.parameters() if p.is_floating_point()})
        updates = model._program.updates
        # where the masters live: "cpu" apart from the parameters under offload, else their device
        offloaded = updates is not None and updates.offload and all(
            m.device.type == "cpu" and m is not p for m, p in zip(updates.masters, updates.params))
        losses = [model.train_step(x, targets=y) for _ in range(STEPS)]
        final = model.full_state_dict(buffers=False)
    except PartitaError:
        raise
    except Exception as e:
        raise RuntimeError(f"{name(case)} ({plan.mesh}): the plan failed to run: {e}") from e
    start = {n: p.detach().clone() for n, p in reference.named_parameters()}
    ref_losses = reference_mixed(reference, policy, x, y, plan.training.micro_batch_size, STEPS)
    ref_final = {n: p.detach() for n, p in reference.named_parameters(remove_duplicate=False)}  # tied names too
    params = gaps({n: t.float() for n, t in final.items() if n in ref_final},
                  {n: t.float() for n, t in ref_final.items()})
    moved = max_abs_diff({n: ref_final[n] for n in final if n in ref_final}, start)
    loss_err = max_rel_diff(losses, ref_losses)
    skipped = model.skipped_steps
    del model
    gc.collect()
    if ctx.rank == 0:
        print(f"{name(case)}: loss err {loss_err:.2e}, param err {params['max_abs']:.2e}, moved {moved:.2e}",
              flush=True)
    return {"case": name(case), "mesh": str(plan.mesh), "zero": plan.training.zero_stage,
            "offload": plan.training.offload, "offloaded": offloaded,
            "sequence_parallel": plan.training.sequence_parallel,
            "param_dtype": str(policy.param_dtype),
            # the dtypes of the model's floating parameters as built, and of the full state after the steps
            "param_dtypes": param_dtypes, "final_dtypes": sorted({str(t.dtype) for t in final.values()}),
            "names_unlike_the_models": sorted(set(final) ^ set(ref_final)),
            "losses": losses, "ref_losses": ref_losses, "loss_rel_err": loss_err, "params": params,
            # how far the reference's steps moved its parameters
            "moved": moved, "skipped": skipped}


def held_state(model: ParallelModel) -> dict[str, int]:
    """Bytes of model state this rank holds between steps: parameters, gradient buffers, and the
    optimizer's fp32 masters and state (its per-tensor step counters left out)."""
    p = model._program
    if p.zero is not None:
        return p.zero.state_bytes()
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)
    params = nbytes(model.parameters())
    grads = nbytes(b.grad_flat for b in p.averager.buckets) if p.averager is not None else params
    state = [t for st in p.master.optimizer.state.values() for t in st.values()
             if isinstance(t, torch.Tensor) and t.dim()]
    return {"params": params, "grads": grads, "optimizer": nbytes(state) + p.master.master_bytes()}


def memory_held(ctx: DistContext, outdir: str) -> list[dict]:
    """What each rank holds in bf16-mixed under ZeRO 0-3, beside the plan's prediction (2 + 2 + 12
    bytes per parameter for Adam, divided as ZeRO says), with ZeRO's flat buckets (their padding)."""
    factory, spec, batch = MODELS["gpt"]
    out = []
    for stage in (0, 1, 2, 3):
        path = Path(outdir, f"memory-zero{stage}.json")
        if ctx.rank == 0:
            _compile(factory, spec, 2, path, optimizer="adamw", precision="bf16-mixed", pins=dict(dp=2, zero=stage))
        dist.barrier()
        plan = load_plan(path, world_size=ctx.world_size)
        torch.manual_seed(0)
        model = ParallelModel(factory(), plan, Options(loss=default_loss, optimizer=OPTIMIZERS["adamw"]), ctx=ctx)
        x, y = batch(plan.training.global_batch)
        model.train_step(x, targets=y)
        want = plan.predicted.memory
        out.append({"case": f"memory/zero{stage}", "stage": stage, "held": held_state(model),
                    "predicted": {"params": want.params, "grads": want.grads, "optimizer": want.optimizer},
                    "numel": sum(p.numel() for p in model.parameters()) if stage < 3 else None,
                    "buckets": len(model._program.zero.buckets) if stage > 0 else 0})
        del model
        gc.collect()
    return out


def fp16_skip(ctx: DistContext, outdir: str) -> dict:
    """fp16: an inf gradient on ONE rank, at the second step: the state before and after it, the
    steps skipped and the loss scale before and after it; then how far the next step moves the state."""
    plan = load_plan(_plan_path(outdir, ("gpt", "dp2", PINS_2["dp2"], "fp16-mixed")), world_size=ctx.world_size)
    factory, _, batch = MODELS["gpt"]
    torch.manual_seed(0)
    model = ParallelModel(factory(), plan, Options(loss=default_loss, optimizer=SGD), ctx=ctx)
    x, y = batch(plan.training.global_batch)
    model.train_step(x, targets=y)
    scale = model._loss_scale
    before = {n: t.clone() for n, t in model.full_state_dict().items()}
    first = next(q for q in model.parameters())
    hook = first.register_hook(lambda g: g.fill_(float("inf")) if ctx.rank == 1 else g)
    model.train_step(x, targets=y)
    hook.remove()
    after = model.full_state_dict()
    result = {"case": "fp16/skip", "state_over_the_skip": gaps({n: after[n] for n in before}, before),
              "skipped": model.skipped_steps, "scale": [scale, model._loss_scale]}
    model.train_step(x, targets=y)
    result["moved_next"] = max(float((model.full_state_dict()[n].float() - after[n].float()).abs().max())
                               for n in after)
    result["skipped_next"] = model.skipped_steps
    return result


def loss_curves(ctx: DistContext, outdir: str, steps: int = 20) -> dict:
    """The example GPT's bf16-mixed loss curve and fp32's over 20 AdamW steps (dp2)."""
    factory, spec, batch = MODELS["gpt"]
    curves = {}
    for precision in ("fp32", "bf16-mixed"):
        path = Path(outdir, f"curve-{precision}.json")
        if ctx.rank == 0:
            _compile(factory, spec, 2, path, optimizer="adamw", precision=precision, pins=dict(dp=2))
        dist.barrier()
        plan = load_plan(path, world_size=ctx.world_size)
        torch.manual_seed(0)
        model = ParallelModel(factory(), plan, Options(loss=default_loss, optimizer=OPTIMIZERS["adamw"]), ctx=ctx)
        x, y = batch(plan.training.global_batch)
        curves[precision] = [model.train_step(x, targets=y) for _ in range(steps)]
    worst = max(abs(a - b) / b for a, b in zip(curves["bf16-mixed"], curves["fp32"]))
    return {"case": "curve/bf16-vs-fp32", "worst_rel": worst, **curves}


CLIP = 0.05  # well below the tiny GPT's gradient norm (~0.5-1), so every step clips
CLIP_PINS_2 = {k: PINS_2[k] for k in ("dp2", "dp2-zero1", "dp2-zero3", "tp2", "pp2-1f1b")}
CLIP_PINS_4 = {"dp2xtp2-zero2": PINS_4["dp2xtp2-zero2"], "tp2xpp2-1f1b": PINS_4["tp2xpp2-1f1b"],
               "dp2xpp2-tied-zero1": dict(dp=2, pp=2, schedule="gpipe", zero=1)}


def _compile(factory: Callable, spec: str, devices: int, path: Path, **kw) -> None:
    from partita.compiler.compile import compile_model
    from partita.core.cluster import load_cluster
    from partita.core.model.inputs import parse_input_spec

    pins = kw.pop("pins")
    compile_model(factory, Options(inputs=[parse_input_spec(spec)], cluster=load_cluster("local", devices=devices),
                                   world_size=devices, **pins, **kw)).plan.save(path)


def clipping(ctx: DistContext, outdir: str, cases: dict[str, dict]) -> list[dict]:
    """Gradient clipping by the global norm (fp32 plans with max_grad_norm): the norm train_step
    reports and the clipped steps beside one process's ``clip_grad_norm_``, however the plan
    spreads the gradients (ZeRO shards, TP shards and replicas, pipeline stages, tied copies)."""
    from tests.workers import tied_script

    out = []
    for label, pins in cases.items():
        tied = "tied" in label
        factory = tied_script.tied_gpt if tied else MODELS["gpt"][0]
        spec, batch = ("idx=int64[8,16]", MODELS["gpt"][2])
        path = Path(outdir, f"clip-{label}.json")
        if ctx.rank == 0:
            _compile(factory, spec, ctx.world_size, path, optimizer="sgd-momentum", precision="fp32",
                     max_grad_norm=CLIP, pins=pins)
        dist.barrier()
        plan = load_plan(path, world_size=ctx.world_size)
        torch.manual_seed(5)
        reference = factory()
        model = ParallelModel(copy.deepcopy(reference), plan, Options(loss=default_loss, optimizer=SGD), ctx=ctx)
        x, y = batch(plan.training.global_batch)
        results = [model.train_step(x, targets=y) for _ in range(STEPS)]
        final = model.full_state_dict()
        opt = SGD(reference.parameters())
        mbs = plan.training.micro_batch_size
        chunks = [slice(i, i + mbs) for i in range(0, x.shape[0], mbs)]
        ref_losses, ref_norms = [], []
        for _ in range(STEPS):
            loss = sum(default_loss(reference(x[r]), y[r]) for r in chunks) / len(chunks)
            loss.backward()
            ref_norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)))
            opt.step()
            opt.zero_grad()
            ref_losses.append(loss.item())
        params = gaps({n: final[n] for n, _ in reference.named_parameters()},
                      {n: p.detach() for n, p in reference.named_parameters()})
        out.append({"case": f"clip/{label}", "max_grad_norm": plan.training.max_grad_norm,
                    "norms": [r.grad_norm for r in results], "ref_norms": ref_norms,
                    "losses": [float(r) for r in results], "ref_losses": ref_losses, "params": params})
        del model
        gc.collect()
    return out


def one_optimizer(ctx: DistContext, outdir: str) -> dict:
    """pp2 x dp2, ZeRO-1, a tied embedding, an LR schedule that sets lr = 0: the losses, and the
    tensors of the state that changed (before, a hidden optimizer of the tied parameter kept
    training it)."""
    from tests.workers import tied_script

    path = Path(outdir, "one-optimizer.json")
    if ctx.rank == 0:
        _compile(tied_script.tied_gpt, "idx=int64[8,16]", 4, path, optimizer="adamw", precision="bf16-mixed",
                 pins=dict(dp=2, pp=2, schedule="1f1b", zero=1))
    dist.barrier()
    plan = load_plan(path, world_size=ctx.world_size)
    torch.manual_seed(0)
    model = ParallelModel(tied_script.tied_gpt(), plan, Options(loss=default_loss, optimizer=OPTIMIZERS["adamw"]),
                          ctx=ctx)
    sched = torch.optim.lr_scheduler.LambdaLR(model.optimizer, lambda step: 0.0)
    x, y = MODELS["gpt"][2](plan.training.global_batch)
    before = model.full_state_dict()
    losses = []
    for _ in range(3):
        losses.append(float(model.train_step(x, targets=y)))
        sched.step()
    after = model.full_state_dict()
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    return {"case": "one-optimizer/lr0", "losses": losses, "changed": changed}


def compile_and_run_2(ctx: DistContext, outdir: str) -> list[dict]:
    Path(outdir, "plans").mkdir(exist_ok=True)
    cases = CASES_2 + CASES_4
    for case in cases[ctx.rank::ctx.world_size]:
        compile_case(case, outdir)
    dist.barrier()
    return ([run_case(ctx, case, outdir) for case in CASES_2] + [fp16_skip(ctx, outdir)]
            + memory_held(ctx, outdir) + [loss_curves(ctx, outdir)] + clipping(ctx, outdir, CLIP_PINS_2))


def run_4(ctx: DistContext, outdir: str) -> list[dict]:
    return ([run_case(ctx, case, outdir) for case in CASES_4] + clipping(ctx, outdir, CLIP_PINS_4)
            + [one_optimizer(ctx, outdir)])


LAUNCHES = {"compile+run2": (2, compile_and_run_2), "run4": (4, run_4)}
