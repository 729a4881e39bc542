"""What each rank of a multi-process tensor-parallel test measures (test_runtime_tp.py asserts it).

Every rank builds a plan from a Megatron-style hand choice (tests/tp_choice.py),
runs partita's ParallelModel and, in the same process, a single-process
reference of the same model on the same global batch, and returns both runs'
losses each step, how far the first step's gradients (gathered back to full) and
the parameters after STEPS steps are from the reference's, and the collectives
counted each step beside the plan's list.
"""

from __future__ import annotations

import copy
import functools
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from examples.models import LogitsOnly, gpt_tiny
from partita.core.model.inputs import InputSpec
from partita.core.options import Options
from partita.runtime.distributed import GROUPS, DistContext
from partita.runtime.dp.buckets import bucket_layout
from partita.runtime.engine import ParallelModel
from tests.harness import gaps, gather_tp, reference_backward, threads_of
from tests.tp_choice import MEGATRON, tp_plan
from tests.workers.dp_worker import GPT_VOCAB, OPTIMIZERS, SEQ, gpt_batch, gpt_loss, mlp, mlp_batch

STEPS = 3
MBS, ACCUM = 2, 2

MLP_PINS = {(r"^layers\.0$", "linear"): "col", (r"^layers\.1$", "linear"): "row",
            (r"^layers\.2$", "linear"): "col"}


def hf_gpt2_tiny() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=GPT_VOCAB, n_positions=64,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa",
                     bos_token_id=0, eos_token_id=0)
    return LogitsOnly(GPT2LMHeadModel(cfg))


def hf_llama_tiny() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                      intermediate_size=128, vocab_size=GPT_VOCAB, max_position_embeddings=64,
                      attn_implementation="sdpa", bos_token_id=0, eos_token_id=0)
    return LogitsOnly(LlamaForCausalLM(cfg))


# name -> (factory, batch, loss, input spec, target spec or None (inferred), pins)
MODELS: dict[str, tuple] = {
    "gpt": (gpt_tiny, gpt_batch, gpt_loss, InputSpec("idx", torch.int64, (1, SEQ)), None, MEGATRON),
    "mlp": (mlp, mlp_batch, F.mse_loss, InputSpec("x", torch.float32, (1, 16)),
            InputSpec("targets", torch.float32, (1, 8)), MLP_PINS),
    "hf-gpt2": (hf_gpt2_tiny, gpt_batch, gpt_loss, InputSpec("input_ids", torch.int64, (1, SEQ)), None, MEGATRON),
    "hf-llama": (hf_llama_tiny, gpt_batch, gpt_loss, InputSpec("input_ids", torch.int64, (1, SEQ)), None, MEGATRON),
}


def expected_calls(plan, model: ParallelModel, bucket_bytes: int) -> list[list]:
    """The plan's TP collectives (grouped by kind, axis and bytes) plus the DP ones this run needs,
    as [kind, axis, bytes, calls]."""
    calls: Counter = Counter()
    for c in plan.collectives:
        calls[(c.kind, c.axis, c.bytes)] += c.count
    if plan.mesh.dp > 1:
        for nbytes in bucket_layout(model.module.parameters(), bucket_bytes):
            calls[("all_reduce", "dp", nbytes)] += 1
        calls[("all_reduce", "dp", 4)] += 1  # the loss
    return sorted([k, a, b, n] for (k, a, b), n in calls.items())


def compare(ctx: DistContext, name: str, *, tp: int, dp: int = 1, replicated: bool = False,
            checkpoint_dir: str | None = None, opt_name: str = "adamw", sequence_parallel: bool = False) -> dict:
    factory, batch, loss_fn, spec, target_spec, pins = MODELS[name]
    torch.manual_seed(100)
    reference = factory()
    inputs = [InputSpec(spec.name, spec.dtype, (MBS, *spec.shape[1:]))]
    plan = tp_plan(copy.deepcopy(reference), inputs, loss_fn, target_spec, tp=tp, dp=dp, mbs=MBS,
                   accum=ACCUM, pins=None if replicated else pins, sequence_parallel=sequence_parallel)
    checkpoint = None
    if checkpoint_dir is not None:  # weights from a file into a module on the meta device
        checkpoint = Path(checkpoint_dir, f"{name}.pt")
        if ctx.rank == 0:
            torch.save(reference.state_dict(), checkpoint)
        dist.barrier()
        with torch.device("meta"):
            module = factory()
    else:
        module = copy.deepcopy(reference)
    bucket_bytes = 25 * 1024 * 1024
    model = ParallelModel(module, plan, Options(loss=loss_fn, optimizer=OPTIMIZERS[opt_name], bucket_bytes=bucket_bytes,
                                                weights=checkpoint), ctx=ctx)
    local = model.module.local_parameters()
    ref_params = dict(reference.named_parameters())
    result = {
        # the process groups this process has made, and its threads: a later program of the same mesh
        # makes none (runtime/distributed.py ``_Groups``)
        "groups_made": sum(map(len, GROUPS.made.values())), "threads": threads_of(),
        "case": f"{name}/dp={dp}/tp={tp}{'/replicated' if replicated else ''}{'/checkpoint' if checkpoint else ''}"
                f"{'/sp' if sequence_parallel else ''}",
        "replicated": replicated, "checkpoint": checkpoint is not None,
        # the test's plan: node decisions, all of them replicate (or not)
        "nodes": len(plan.nodes), "all_replicate": all(d.strategy == "replicate" for d in plan.nodes),
    }
    if checkpoint is not None:  # each rank holds exactly its slices of the saved weights
        result["module_left_on_meta"] = all(p.device.type == "meta" or type(p).__name__ == "FakeTensor"
                                            for p in module.parameters())
        slices = {}
        for n, (_, placement) in local.items():
            want = ref_params[n].detach()
            if placement.startswith("shard("):
                want = want.chunk(tp, dim=int(placement[6:-1]))[model.module.tp.rank]
            slices[n] = want
        result["loaded_slices"] = gaps({n: p.detach() for n, (p, _) in local.items()}, slices)
    names = {id(p): n for n, (p, _) in local.items()}
    grads: dict[str, torch.Tensor] = {}

    def grab(optimizer, args, kwargs):
        if not grads:
            grads.update({names[id(p)]: p.grad.detach().clone()
                          for g in optimizer.param_groups for p in g["params"]})
    model.optimizer.register_step_pre_hook(grab)
    ref_opt = OPTIMIZERS[opt_name](reference.parameters())
    ref_grads: dict[str, torch.Tensor] = {}
    x, y = batch(plan.training.global_batch)
    want_calls = expected_calls(plan, model, bucket_bytes)
    losses, ref_losses, calls = [], [], []
    saved: dict[int, torch.UntypedStorage] = {}  # held to the end of the step, so no address is reused
    for step in range(STEPS):
        if step == 0:  # the bytes autograd keeps, each storage once
            with torch.autograd.graph.saved_tensors_hooks(functools.partial(_note_saved, saved), lambda t: t[1]):
                losses.append(model.train_step(x, targets=y))
        else:
            losses.append(model.train_step(x, targets=y))
        # at dp=1 the same micro-batches, so that a replicated plan can match exactly
        ref_losses.append(reference_backward(reference, loss_fn, x, y, ACCUM if dp == 1 else 1))
        if step == 0:
            ref_grads = {n: p.grad.detach().clone() for n, p in reference.named_parameters()}
        ref_opt.step()
        ref_opt.zero_grad()
        calls.append(model.collectives.as_tuples())
    full_grads = gather_tp(model.tensor_parallel, grads)
    full_params = gather_tp(model.tensor_parallel, {n: p.detach() for n, (p, _) in local.items()})
    ref_final = {n: p.detach() for n, p in reference.named_parameters(remove_duplicate=False)}  # tied names too
    return {
        **result, "losses": losses, "ref_losses": ref_losses,
        "grads": gaps(full_grads, ref_grads), "params": gaps(full_params, ref_final),
        "calls": calls, "expected_calls": want_calls,
        "tp_calls_per_step": sum(n for k, a, b, n in want_calls if a == "tp"),
        "saved_per_micro_batch": sum(s.nbytes() for s in saved.values()) / ACCUM,
    }


def _note_saved(saved: dict[int, torch.UntypedStorage], t: torch.Tensor) -> tuple[torch.UntypedStorage, torch.Tensor]:
    """A pack hook: count ``t``'s storage once. ``saved`` holds it until the step is over: autograd
    frees a micro-batch's saved tensors in its backward, and the allocator would give the next
    micro-batch's the same addresses (counted once: the sum then moved by 5% between equal runs)."""
    storage = t.untyped_storage()
    saved.setdefault(storage.data_ptr(), storage)
    return storage, t


def tp2(ctx: DistContext, out: str) -> list[dict]:
    return [compare(ctx, "gpt", tp=2), compare(ctx, "gpt", tp=2, sequence_parallel=True),
            compare(ctx, "hf-llama", tp=2, sequence_parallel=True), compare(ctx, "mlp", tp=2),
            compare(ctx, "gpt", tp=2, replicated=True),
            compare(ctx, "gpt", tp=2, checkpoint_dir=out), compare(ctx, "hf-gpt2", tp=2),
            compare(ctx, "hf-llama", tp=2)]


def tp4(ctx: DistContext, out: str) -> list[dict]:
    return [compare(ctx, "gpt", tp=4), compare(ctx, "mlp", tp=4)]


def dp2xtp2(ctx: DistContext, out: str) -> list[dict]:
    return [compare(ctx, "gpt", tp=2, dp=2), compare(ctx, "mlp", tp=2, dp=2, opt_name="sgd")]


# launch name -> (world size, the checks each rank runs)
LAUNCHES: dict[str, tuple[int, Callable[[DistContext, str], list[dict]]]] = {
    "tp2": (2, tp2), "tp4": (4, tp4), "dp2xtp2": (4, dp2xtp2),
}
