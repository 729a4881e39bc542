"""What each rank of the memory-per-rank test measures (test_runtime_memory.py asserts it).

Each rank runs a plan of the example GPT (4.2M parameters) at tp=2 or pp=2 and
counts the bytes of every live tensor it holds (each storage once; fake and meta
tensors hold none), with the garbage collector off from before the model is
built, so that memory only a collection would free counts as held:

- after building: the parameters this rank's part of the plan holds, and
  nothing else (no captured program's copy of the model, no full weights);
- at each optimizer step (its pre-hook): those, their gradients and, from the
  second step, AdamW's state;
- after each step: the parameters and AdamW's state;

each beside the cost model's model state for the parameters the plan places
on this rank (``model_state_memory`` of their local elements, which the plan's
``predicted.memory`` states for its most loaded device); and the tensors a
collection (``DEBUG_SAVEALL``) finds in reference cycles after each step.

``step_peaks``: the most bytes a step holds under each axis (dp, tp, pp, ZeRO-2/3, recomputation,
sequence parallelism, offload, experts, one process), beside the plan's predicted peak (the section
at the end).
"""

from __future__ import annotations

import functools
import gc
import math
import time
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor

from examples.models import GPT, GPTConfig
from partita.core.model.losses import default_loss
from partita.core.options import Options
from partita.core.plans.plan import Plan
from partita.core.plans.verify import load_plan
from partita.passes.cost_model import model_state_memory, state_bytes_per_param
from partita.runtime.distributed import DistContext
from partita.runtime.engine import ParallelModel

VOCAB, SEQ, BATCH, STEPS = 2048, 32, 8, 3


def gpt() -> GPT:
    """examples/models.py's GPT at 4.2M parameters (17 MB in fp32)."""
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=64, n_layer=4, n_head=4, n_embd=256))


def adamw(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def live_storages(extra: Iterable[torch.Tensor] = ()) -> dict[int, int]:
    """data_ptr -> bytes of every storage a live (gc-tracked) tensor, or one of ``extra``, holds."""
    out: dict[int, int] = {}
    for t in (*(o for o in gc.get_objects() if isinstance(o, torch.Tensor)), *extra):
        if isinstance(t, FakeTensor) or t.device.type == "meta":
            continue
        try:
            s = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # no storage (sparse, nested): nothing here
            continue
        if s.nbytes():
            out[s.data_ptr()] = s.nbytes()
    return out


def garbage_tensors() -> list[str]:
    """The tensors a collection finds in reference cycles (shape and dtype each), then freed."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        found = [f"{tuple(o.shape)} {o.dtype}" for o in gc.garbage if isinstance(o, torch.Tensor)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    gc.collect()  # without DEBUG_SAVEALL: the cycles are freed
    return found


def _plan(ctx: DistContext, pins: dict, outdir: str, precision: str | None = None) -> Plan:
    """Rank 0 compiles the plan (as `partita compile` would), the others read it."""
    path = f"{outdir}/gpt-{'-'.join(f'{k}{v}' for k, v in pins.items())}-{precision}.plan.json"
    if ctx.rank == 0:
        from partita.compiler.compile import compile_model
        from partita.core.cluster import load_cluster
        from partita.core.model.inputs import parse_input_spec

        compile_model(gpt, Options(inputs=[parse_input_spec(f"idx=int64[{BATCH},{SEQ}]")],
                                   cluster=load_cluster("local", devices=ctx.world_size), optimizer="adamw",
                                   precision=precision, world_size=ctx.world_size, **pins)).plan.save(path)
    dist.barrier()
    return load_plan(path, world_size=ctx.world_size)


def predicted_state(plan: Plan, pp_rank: int):
    """The cost model's model state of the parameters the plan places on pipeline rank ``pp_rank``,
    per device: under interleaved 1F1B the rank holds every virtual stage c with c mod pp = pp_rank."""
    tp = plan.mesh.tp
    numel = sum(math.prod(p.shape) // (tp if p.layout.get("tp", "replicate").startswith("shard") else 1)
                for p in plan.params if p.stage % plan.mesh.pp == pp_rank)
    state = state_bytes_per_param(plan.training.precision, plan.training.optimizer)
    return model_state_memory(numel, state, zero_stage=plan.training.zero_stage, dp=plan.mesh.dp)


def measure(ctx: DistContext, outdir: str, pins: dict, slack: int) -> dict:
    """The bytes held at each point, and what the plan predicts (with the step counters it may add);
    ``slack``: the bytes over those within which a measurement is taken as settled (gloo's)."""
    plan = _plan(ctx, pins, outdir)
    stages = range(plan.mesh.pp)
    # The plan's predicted memory is its most loaded device's: the largest stage's model state.
    most = max((predicted_state(plan, s) for s in stages), key=lambda m: m.params)

    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    x, y = idx[:, :-1], idx[:, 1:]
    gc.collect()
    gc.disable()  # from here, memory that only a collection would free counts as held
    try:
        before = live_storages()

        def held(bound: int, extra: Callable[[], Iterable[torch.Tensor]] = tuple) -> int:
            """Bytes of the tensors made since ``before``. A synchronous gloo collective's work
            object can keep its tensors for a moment after the call returns (released on gloo's
            own thread): while above ``bound``, measure again, for up to half a second."""
            for _ in range(50):
                got = sum(b for ptr, b in live_storages(extra()).items() if ptr not in before)
                if got <= bound:
                    break
                time.sleep(0.01)
            return got

        torch.manual_seed(0)
        model = ParallelModel(gpt(), plan, Options(loss=default_loss, optimizer=adamw), ctx=ctx)
        stage = model._program.pipeline.index if model._program.pipeline is not None else 0
        want = predicted_state(plan, stage)
        params = list(model.parameters())
        counters = 4 * len(params)  # AdamW's step counters, from the first update on
        # (what is measured, the plan's prediction of it, the step counters it may add)
        expected = {"after building": (want.params, 0)}
        for k in range(STEPS):
            moments, extra = (want.optimizer, counters) if k > 0 else (0, 0)  # AdamW's state: from step 0's update
            expected[f"at step {k}'s update"] = (want.params + want.grads + moments, extra)
            expected[f"after step {k}"] = (want.params + want.optimizer, counters)
        bound = {what: want_b + extra + slack for what, (want_b, extra) in expected.items()}
        measured = {"after building": held(bound["after building"])}

        def at_update(opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
            what = f"at step {len(measured) // 2}'s update"
            measured[what] = held(bound[what], lambda: [p.grad for p in params if p.grad is not None])
        model.optimizer.register_step_pre_hook(at_update)
        garbage = []
        for k in range(STEPS):
            model.train_step(x, targets=y)
            measured[f"after step {k}"] = held(bound[f"after step {k}"])
            garbage.append(garbage_tensors())  # an explicit collection: gc stays off for the next step
    finally:
        gc.enable()

    return {"case": f"gpt/{'-'.join(f'{k}{v}' for k, v in pins.items())}", "stage": stage,
            # the most loaded stage's model state by the cost model, and the plan's predicted memory
            "most_loaded": [most.params, most.grads, most.optimizer],
            "plan_predicted": [plan.predicted.memory.params, plan.predicted.memory.grads,
                               plan.predicted.memory.optimizer],
            "param_bytes": sum(p.numel() * p.element_size() for p in params),
            "predicted": {"params": want.params, "grads": want.grads, "optimizer": want.optimizer},
            # what -> bytes held; what -> [the plan's prediction, the step counters it may add]
            "measured": measured, "expected": {what: list(v) for what, v in expected.items()},
            "garbage": garbage}


def tp2_then_pp2(ctx: DistContext, out: str, slack: int) -> list[dict]:
    return [measure(ctx, out, dict(tp=2), slack), measure(ctx, out, dict(pp=2), slack)]


MIXED_BUCKET_BYTES = 1 << 20  # small buckets, so that the 4.2M-parameter model's state is many of them


def mixed_step_bytes(ctx: DistContext, outdir: str, zero_stage: int) -> dict:
    """bf16-mixed ZeRO at dp=2 with 1 MiB gradient buckets: the most bytes of tensors held (made
    since before the model was built) at any of the optimizer's steps (one per chunk of masters)
    in the last of ``STEPS`` train steps (AdamW's state exists by then), beside the cost model's
    model state for the rank."""
    import dataclasses

    plan = _plan(ctx, dict(dp=2, zero=zero_stage), outdir, precision="bf16-mixed")
    plan = dataclasses.replace(plan, training=dataclasses.replace(plan.training, grad_bucket_bytes=MIXED_BUCKET_BYTES))
    idx = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    gc.collect()
    gc.disable()
    try:
        before = live_storages()
        torch.manual_seed(0)
        model = ParallelModel(gpt(), plan, Options(loss=default_loss, optimizer=adamw), ctx=ctx)
        seen: list[int] = []
        model.optimizer.register_step_pre_hook(
            lambda *_: seen.append(sum(b for ptr, b in live_storages().items() if ptr not in before)))
        for _ in range(STEPS):
            del seen[:]
            model.train_step(idx[:, :-1], targets=idx[:, 1:])
        shards = model._program.zero.shards
        largest = max(s.numel() for s in shards) * 4  # the largest fp32 master, one bucket's shard
    finally:
        gc.enable()
    want = predicted_state(plan, 0)
    return {"zero": zero_stage, "held_at_step": max(seen), "steps_per_step": len(seen), "shards": len(shards),
            "largest_master": largest,
            "predicted": want.params + want.grads + want.optimizer}


def mixed_zero(ctx: DistContext, out: str) -> list[dict]:
    return [mixed_step_bytes(ctx, out, 1), mixed_step_bytes(ctx, out, 2)]


LAUNCHES: dict[str, tuple[int, Callable[[DistContext, str, int], list[dict]]]] = {"tp2+pp2": (2, tp2_then_pp2)}


# -- the step's peak, as the CPU allocator sees it (test_runtime_memory.py, issue 26) -------------------------
#
# Each case is a model shape and a plan on 2 gloo ranks (a one-process case: on each rank alone): the bytes
# the rank holds after its warm-up steps (model state, made since before the model was built) plus the most
# the CPU allocator held at once above that during one more step (torch.profiler's allocation events, summed
# in time order), beside the plan's predicted peak for the rank's stage.

GPT_4 = dict(n_layer=4, vocab_size=2048, n_embd=256, n_head=4, block_size=64)
PEAK_CASES = {  # name -> (model: a GPT's config or a factory, input spec, pins, processes)
    "logits-heavy gpt, dp2": (dict(n_layer=2, vocab_size=8192, n_embd=256, n_head=4, block_size=128),
                              "idx=int64[8,128]", dict(dp=2), 2),
    "layer-heavy gpt, pp2": (dict(n_layer=8, vocab_size=256, n_embd=256, n_head=4, block_size=64),
                             "idx=int64[8,64]", dict(pp=2), 2),
    "gpt, tp2": (GPT_4, "idx=int64[8,64]", dict(tp=2), 2),
    "wide gpt, zero3 dp2": (dict(n_layer=3, vocab_size=1024, n_embd=384, n_head=6, block_size=96),
                            "idx=int64[8,96]", dict(dp=2, zero=3), 2),
    "deep narrow gpt, dp2": (dict(n_layer=12, vocab_size=512, n_embd=128, n_head=4, block_size=32),
                             "idx=int64[16,32]", dict(dp=2), 2),
    "gpt, zero2 dp2": (GPT_4, "idx=int64[8,64]", dict(dp=2, zero=2), 2),
    "gpt, selective recompute dp2": (GPT_4, "idx=int64[8,64]", dict(dp=2, recompute="selective"), 2),
    "gpt, full recompute tp2": (GPT_4, "idx=int64[8,64]", dict(tp=2, recompute="full"), 2),
    "gpt, tp2 + sequence parallel": (GPT_4, "idx=int64[8,64]", dict(tp=2, sequence_parallel=True), 2),
    "gpt, offload dp2": (GPT_4, "idx=int64[8,64]", dict(dp=2, offload="optimizer"), 2),
    "gpt, offload zero2 dp2": (GPT_4, "idx=int64[8,64]", dict(dp=2, zero=2, offload="optimizer"), 2),
    "mixtral, ep2": ("mixtral", "input_ids=int64[8,32]", dict(dp=2, ep=2), 2),
    "12-layer gpt, one process": (dict(n_layer=12, vocab_size=512, n_embd=128, n_head=4, block_size=32),
                                  "idx=int64[8,32]", {}, 1),
}


MIXTRAL_VOCAB = 512


def _mixtral() -> torch.nn.Module:
    """A small Mixtral (4 experts, 2 a token) for the expert-parallel case."""
    import transformers as tf

    return tf.MixtralForCausalLM(tf.MixtralConfig(
        vocab_size=MIXTRAL_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        use_cache=False))


def _gpt_of(cfg: dict) -> GPT:
    return GPT(GPTConfig(**cfg))


FACTORIES = {"mixtral": _mixtral}


def _case_plan(ctx: DistContext, name: str, outdir: str) -> tuple[Plan, Callable[[], torch.nn.Module], DistContext]:
    """The case's plan (rank 0 compiles it, the others read it), its model and the context it runs in:
    a one-process case runs on each rank alone."""
    model, spec, pins, world = PEAK_CASES[name]
    factory = FACTORIES[model] if isinstance(model, str) else functools.partial(_gpt_of, model)
    slug = "".join(c if c.isalnum() else "-" for c in name)
    path = f"{outdir}/peak-{slug}-{ctx.rank if world == 1 else 'all'}.plan.json"
    if world == 1 or ctx.rank == 0:
        from partita.compiler.compile import compile_model
        from partita.core.cluster import load_cluster

        compile_model(factory, Options(inputs=[spec], cluster=load_cluster("local", devices=world),
                                       optimizer="adamw", world_size=world, **pins)).plan.save(path)
    dist.barrier()
    run_ctx = ctx if world == ctx.world_size else DistContext(0, 1, 0, "none", ctx.device, False)
    return load_plan(path, world_size=world), factory, run_ctx


def step_peak(ctx: DistContext, outdir: str, name: str) -> dict:
    """One case's measured peak on this rank and the plan's prediction for the rank's stage."""
    from torch.profiler import ProfilerActivity, profile

    plan, factory, ctx = _case_plan(ctx, name, outdir)
    model_of, spec, _, _ = PEAK_CASES[name]
    batch, seq = (int(d) for d in spec.split("[")[1].rstrip("]").split(","))
    vocab = model_of["vocab_size"] if isinstance(model_of, dict) else MIXTRAL_VOCAB
    idx = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(1))
    x, y = idx[:, :-1], idx[:, 1:]
    gc.collect()
    before = live_storages()
    torch.manual_seed(0)
    model = ParallelModel(factory(), plan, Options(loss=default_loss, optimizer="adamw"), ctx=ctx)
    for _ in range(2):  # the optimizer's state exists from the first step on
        model.train_step(x, targets=y)
    gc.collect()
    held = sum(b for ptr, b in live_storages().items() if ptr not in before)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model.train_step(x, targets=y)
    live = peak = 0
    for e in sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    stage = model._program.pipeline.index if model._program.pipeline is not None else 0
    predicted = plan.stages[stage].memory_bytes if plan.mesh.pp > 1 else plan.predicted.memory.total
    m = plan.predicted.memory
    return {"case": name, "stage": stage, "mesh": str(plan.mesh), "zero": plan.training.zero_stage,
            "held": held, "transient": peak, "measured": held + peak, "predicted": predicted,
            "terms": {"state": m.state, "activations": m.activations, "transient": m.transient,
                      "collectives": m.collectives, "step": m.step, "host": m.host}}


def step_peaks(ctx: DistContext, outdir: str, names: list[str] | None = None) -> list[dict]:
    return [step_peak(ctx, outdir, name) for name in (names or PEAK_CASES)]
