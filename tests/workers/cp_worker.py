"""What each rank of a context-parallel test measures (tests/integration/test_context_parallel.py
asserts it).

Every rank builds a plan (a hand choice, tests/tp_choice.py, made context-parallel: ``mesh.cp`` and
``training.cp_attention`` set, the global batch over dp / cp sample groups), runs partita's
ParallelModel and, in the same process, one process's run of the same model on the same global
batch, and returns both runs' losses each step, how far the first step's gradients (gathered back
to full over "tp") and the parameters after STEPS steps are from the reference's, and the
collectives counted on "cp".
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable

import torch

from examples.models import GPT, GPTConfig
from partita.core.mesh import Mesh
from partita.core.model.inputs import InputSpec
from partita.core.options import Options
from partita.runtime.distributed import DistContext
from partita.runtime.engine import ParallelModel
from tests.harness import gaps, gather_tp, plans_spread, reference_backward
from tests.pp_choice import pp_plan
from tests.tp_choice import MEGATRON, tp_plan
from tests.workers.dp_worker import GPT_VOCAB, OPTIMIZERS, SEQ, gpt_batch, gpt_loss
from tests.workers.tp_worker import hf_llama_tiny

STEPS = 3
MBS, ACCUM = 2, 2


def gpt_cp() -> GPT:
    """The example GPT (SDPA, causal) with 4 heads of 16: heads divide over cp = 2 and 4 (all-to-all)."""
    return GPT(GPTConfig(vocab_size=GPT_VOCAB, block_size=64, n_layer=2, n_head=4, n_embd=64))


def hf_qwen2_tiny() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from examples.models import LogitsOnly

    cfg = Qwen2Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=GPT_VOCAB, max_position_embeddings=64,
                      attn_implementation="sdpa", bos_token_id=0, eos_token_id=0)
    return LogitsOnly(Qwen2ForCausalLM(cfg))


def gpt_written_out() -> GPT:
    """The example GPT with its attention written out (Q K^T, scale, causal mask, softmax, P V)."""
    return GPT(GPTConfig(vocab_size=GPT_VOCAB, block_size=64, n_layer=2, n_head=4, n_embd=64, flash=False))


class PaddedLlama(torch.nn.Module):
    """HF Llama (sdpa) taking a padding mask: ``forward(input_ids, attention_mask)`` -> logits."""

    def __init__(self) -> None:
        super().__init__()
        self.model = hf_llama_tiny().model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


def padding(rows: int) -> torch.Tensor:
    """Right padding: each row keeps its first 6 to 16 tokens (all rows but the first padded), one
    row left-padded (its first 3 tokens padding)."""
    keep = torch.tensor([SEQ] + [6 + (5 * i) % (SEQ - 5) for i in range(1, rows)])[:rows, None]
    mask = (torch.arange(SEQ)[None, :] < keep).long()
    if rows > 1:
        mask[-1] = (torch.arange(SEQ) >= 3).long()
    return mask


MODELS: dict[str, tuple[Callable, str]] = {"gpt": (gpt_cp, "idx"), "gpt-eager": (gpt_written_out, "idx"),
                                           "hf-llama-padded": (PaddedLlama, "input_ids"),
                                           "hf-llama": (hf_llama_tiny, "input_ids"),
                                           "hf-qwen2": (hf_qwen2_tiny, "input_ids")}


def cp_plan(reference: torch.nn.Module, name: str, *, dp: int, cp: int, tp: int = 1, strategy: str = "ring",
            zero: int = 0, precision: str = "fp32", pp: int = 1, sp: bool = False):
    """The hand choice at dp x tp (x pp: 1F1B, one layer a stage), made context-parallel over cp of
    the dp ranks."""
    inputs = [InputSpec(MODELS[name][1], torch.int64, (MBS, SEQ))]
    if name.endswith("-padded"):
        inputs.append(InputSpec("attention_mask", torch.int64, (MBS, SEQ)))
    targets = InputSpec("targets", torch.int64, (MBS, SEQ))
    if pp > 1:
        plan = pp_plan(copy.deepcopy(reference), inputs, gpt_loss, targets, pp=pp, cuts_at=[1], schedule="1f1b",
                       tp=tp, dp=dp, mbs=MBS, accum=ACCUM, pins=MEGATRON if tp > 1 else None)[0]
    else:
        plan = tp_plan(copy.deepcopy(reference), inputs, gpt_loss, targets, tp=tp, dp=dp, mbs=MBS, accum=ACCUM,
                       pins=MEGATRON if tp > 1 else None, sequence_parallel=sp)
    training = dataclasses.replace(plan.training, global_batch=dp // cp * MBS * ACCUM, cp_attention=strategy,
                                   zero_stage=zero, precision=precision, sequence_parallel=sp)
    return dataclasses.replace(plan, mesh=Mesh(dp=dp, tp=tp, pp=pp, cp=cp), training=training)


def compare(ctx: DistContext, name: str, *, cp: int, tp: int = 1, strategy: str = "ring", zero: int = 0,
            precision: str = "fp32", pp: int = 1, sp: bool = False) -> dict:
    dp = ctx.world_size // tp // pp
    torch.manual_seed(100)
    reference = MODELS[name][0]()
    plan = cp_plan(reference, name, dp=dp, cp=cp, tp=tp, strategy=strategy, zero=zero, precision=precision, pp=pp,
                   sp=sp)
    model = ParallelModel(copy.deepcopy(reference), plan, Options(loss=gpt_loss, optimizer=OPTIMIZERS["adamw"]),
                          ctx=ctx)
    local = model.module.local_parameters()
    names = {id(p): n for n, (p, _) in local.items()}
    grads: dict[str, torch.Tensor] = {}

    def grab(optimizer, args, kwargs):
        if not grads:
            grads.update({names[id(p)]: p.grad.detach().clone() for g in optimizer.param_groups for p in g["params"]})
    if precision == "fp32" and not zero:  # (else the optimizer steps masters or shards: parameters and losses)
        model.optimizer.register_step_pre_hook(grab)
    ref_opt = OPTIMIZERS["adamw"](reference.parameters())
    x, y = gpt_batch(plan.training.global_batch)
    xs = (x, padding(x.shape[0])) if name.endswith("-padded") else (x,)
    losses, ref_losses, calls = [], [], []
    for step in range(STEPS):
        losses.append(model.train_step(*xs, targets=y))
        # bf16-mixed: the same recipe in one process (fp32 weights, the forward under bf16 autocast)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "fp32"):
            loss = gpt_loss(reference(*xs), y)
        loss.backward()
        ref_losses.append(float(loss.detach()))
        if step == 0:
            ref_grads = {n: p.grad.detach().clone() for n, p in reference.named_parameters()}
        ref_opt.step()
        ref_opt.zero_grad()
        calls.append([c for c in model.collectives.as_tuples() if c[1] == "cp"])
    full_grads = gather_tp(model.tensor_parallel, grads) if grads else {}
    ref_final = {n: p.detach() for n, p in reference.named_parameters(remove_duplicate=False)}
    full_params = {n: t.float() for n, t in model.full_state_dict(buffers=False).items() if n in ref_final}
    extra = ((f"/pp={pp}" if pp > 1 else "") + ("/sp" if sp else "") + (f"/zero{zero}" if zero else "")
             + (f"/{precision}" if precision != "fp32" else ""))
    return {"case": f"{name}/dp={dp // cp}/cp={cp}/tp={tp}/{strategy}{extra}", "precision": precision,
            "losses": losses, "ref_losses": ref_losses, "calls": calls,
            "grads": gaps(full_grads, ref_grads) if full_grads else None, "params": gaps(full_params, ref_final)}


def refusal(ctx: DistContext, what: str) -> dict:
    """The one message a plan this runtime cannot split gets, before the first step."""
    from partita.core.errors import PartitaError

    torch.manual_seed(100)
    if what == "attention dropout":
        reference = GPT(GPTConfig(vocab_size=GPT_VOCAB, block_size=64, n_layer=2, n_head=4, n_embd=64, dropout=0.1))
        plan = cp_plan(reference, "gpt", dp=ctx.world_size, cp=2)
    else:  # a micro-batch as long as a rank's slice of the sequence: positions and batch indices look alike
        reference = gpt_cp()
        plan = cp_plan(reference, "gpt", dp=ctx.world_size, cp=2)
        plan = dataclasses.replace(plan, training=dataclasses.replace(
            plan.training, micro_batch_size=SEQ // 2, grad_accum_steps=1, global_batch=SEQ // 2))
    try:
        ParallelModel(reference, plan, Options(loss=gpt_loss), ctx=ctx)
    except PartitaError as e:
        return {"case": f"refused: {what}", "message": str(e)}
    return {"case": f"refused: {what}", "message": None}


def resume(ctx: DistContext, out: str, to_cp: int) -> dict:
    """A checkpoint saved at cp = 2 after a step, loaded by a plan at ``to_cp`` over the same ranks:
    the weights and the optimizer's state come back bit for bit (cp ranks hold the same parameters,
    so it is one replica's state under any cp), and the next step's loss is one process's."""
    from pathlib import Path

    torch.manual_seed(100)
    reference = gpt_cp()
    opts = Options(loss=gpt_loss, optimizer=OPTIMIZERS["adamw"])
    first = ParallelModel(copy.deepcopy(reference), cp_plan(reference, "gpt", dp=ctx.world_size, cp=2), opts, ctx=ctx)
    x, y = gpt_batch(16)
    n1 = first.plan.training.global_batch
    first.train_step(x[:n1], targets=y[:n1])
    path = Path(out, "cp-resume")
    first.save_checkpoint(path)
    saved = first.full_state_dict(buffers=False)
    second = ParallelModel(gpt_cp(), cp_plan(reference, "gpt", dp=ctx.world_size, cp=to_cp), opts, ctx=ctx)
    second.load_checkpoint(path)
    loaded = second.full_state_dict(buffers=False)
    same = sorted(saved) == sorted(loaded) and all(torch.equal(saved[k], loaded[k]) for k in saved)
    # each parameter's AdamW state (step, and the moments' sums), as a set over the parameters: the
    # two runs hold their parameters in other orders (cp = 1 at tp = 1 runs the eager module)
    state = [sorted(tuple(sorted((k, v.double().sum().item()) for k, v in s.items() if torch.is_tensor(v)))
                    for s in m.optimizer.state.values()) for m in (first, second)]
    n2 = second.plan.training.global_batch
    dist_loss = second.train_step(x[:n2], targets=y[:n2])
    ref_opt = OPTIMIZERS["adamw"](reference.parameters())
    reference_backward(reference, gpt_loss, x[:n1], y[:n1], 1)
    ref_opt.step()
    ref_opt.zero_grad()
    ref_loss = reference_backward(reference, gpt_loss, x[:n2], y[:n2], 1)
    return {"case": f"resume cp=2 -> cp={to_cp}", "same_weights": same,
            "same_optimizer_state": state[0] == state[1],
            "loss": dist_loss, "ref_loss": ref_loss}


def loader(ctx: DistContext, out: str) -> dict:
    """``model.loader`` under cp: each rank loads its sample group's rows (whole sequences) and
    ``train_step(..., local=True)`` keeps its slice of each: the same losses and parameters as the
    global batch passed to every rank."""
    torch.manual_seed(100)
    reference = gpt_cp()
    plan = cp_plan(reference, "gpt", dp=ctx.world_size, cp=2)
    opts = Options(loss=gpt_loss, optimizer=OPTIMIZERS["adamw"])
    x, y = gpt_batch(plan.training.global_batch * 3)
    dataset = torch.utils.data.TensorDataset(x, y)
    runs = []
    for local in (True, False):
        m = ParallelModel(copy.deepcopy(reference), plan, opts, ctx=ctx)
        if local:
            losses = [m.train_step(xb, targets=yb, local=True) for xb, yb in m.loader(dataset)]
        else:
            n = plan.training.global_batch
            losses = [m.train_step(x[i:i + n], targets=y[i:i + n]) for i in range(0, len(x), n)]
        runs.append((losses, m.full_state_dict(buffers=False)))
    (a, pa), (b, pb) = runs
    return {"case": "loader local=True", "losses": a, "ref_losses": b,
            "same_params": all(torch.equal(pa[k], pb[k]) for k in pa)}


def cp2(ctx: DistContext, out: str) -> list[dict]:
    # the planner's two plans, each made on one of the ranks (``plans_spread``), before the cases run
    selective, full = plans_spread(ctx, [functools.partial(compiled_plan, ctx.world_size, "selective"),
                                         functools.partial(compiled_plan, ctx.world_size, "full", "all-to-all")])
    return [compare(ctx, "gpt", cp=2), compare(ctx, "gpt", cp=2, strategy="all-to-all"),
            compare(ctx, "hf-llama", cp=2), compare(ctx, "hf-qwen2", cp=2, strategy="all-to-all"),
            compare(ctx, "gpt", cp=2, precision="bf16-mixed"), compare(ctx, "gpt-eager", cp=2),
            compare(ctx, "hf-llama-padded", cp=2), compare(ctx, "hf-llama-padded", cp=2, strategy="all-to-all"),
            compare(ctx, "hf-llama", cp=2, strategy="all-to-all", precision="bf16-mixed"),
            refusal(ctx, "attention dropout"), refusal(ctx, "micro-batch as long as the slice"),
            resume(ctx, out, 1), loader(ctx, out), compiled(ctx, selective, "selective"),
            compiled(ctx, full, "full", "all-to-all")]


def compiled_plan(world: int, recompute: str, strategy: str = "ring"):
    """The plan ``partita compile`` writes for --cp 2 (and --recompute, --cp-attention) at ``world`` ranks."""
    from partita.compiler.compile import compile_model
    from partita.core.cluster import load_cluster
    from partita.core.model.inputs import parse_input_spec

    torch.manual_seed(100)
    return compile_model(gpt_cp(), Options(
        inputs=[parse_input_spec(f"idx=int64[{2 * world // 2},{SEQ}]")],
        cluster=load_cluster("local", devices=world), world_size=world, cp=2,
        cp_attention=strategy, recompute=recompute, loss=gpt_loss)).plan


def compiled(ctx: DistContext, plan, recompute: str, strategy: str = "ring") -> dict:
    """``plan`` (``compiled_plan``'s, or what making it raised), run against one process: the planner's
    cp plan, its recomputed layers or cores rerun over the cp group."""
    if isinstance(plan, Exception):
        raise plan
    torch.manual_seed(100)
    reference = gpt_cp()
    model = ParallelModel(copy.deepcopy(reference), plan, Options(loss=gpt_loss, optimizer=OPTIMIZERS["adamw"]),
                          ctx=ctx)
    ref_opt = OPTIMIZERS["adamw"](reference.parameters())
    x, y = gpt_batch(plan.training.global_batch)
    losses, ref_losses, calls = [], [], []
    for _ in range(STEPS):
        model.collectives.reset()
        losses.append(model.train_step(x, targets=y))
        calls.append(sorted((k, b, n) for k, a, b, n in model.collectives.as_tuples() if a == "cp"))
        ref_losses.append(reference_backward(reference, gpt_loss, x, y, 1))
        ref_opt.step()
        ref_opt.zero_grad()
    ref_final = {n: p.detach() for n, p in reference.named_parameters(remove_duplicate=False)}
    full = {n: t for n, t in model.full_state_dict(buffers=False).items() if n in ref_final}
    planned: dict = {}
    for c in plan.collectives:
        if c.axis == "cp":
            planned[c.kind, c.bytes] = planned.get((c.kind, c.bytes), 0) + c.count
    return {"case": f"compiled cp=2 {strategy} recompute={recompute}", "precision": "fp32", "grads": None,
            "losses": losses, "ref_losses": ref_losses, "params": gaps(full, ref_final), "calls": calls,
            "planned": sorted((k, b, n) for (k, b), n in planned.items()),
            "plan": (plan.mesh.cp, plan.training.cp_attention, sorted({s.recompute for s in plan.stages}))}


def cp4(ctx: DistContext, out: str) -> list[dict]:
    return [compare(ctx, "gpt", cp=2), compare(ctx, "gpt", cp=2, tp=2), compare(ctx, "gpt", cp=2, tp=2, sp=True),
            compare(ctx, "gpt", cp=4),
            compare(ctx, "gpt", cp=4, strategy="all-to-all"), compare(ctx, "hf-llama", cp=2, zero=3),
            compare(ctx, "gpt", cp=2, pp=2),
            resume(ctx, out, 4)]


LAUNCHES = {"cp2": (2, cp2), "cp4": (4, cp4)}
