"""What each rank of the any-model matrix measures (test_any_model.py asserts it).

Bare models as users write them (tiny Hugging Face configs of GPT-2, BART, DeBERTa-v2, Falcon,
Mixtral with its default experts, CLIP's vision tower, and a CNN with batch norm), each planned by
the planner under one mesh pin (dp2; tp2 on a fast-link cluster, where every parameter is really
sharded; pp2; dp2 with ZeRO-3) and one precision (fp32, bf16-mixed), trained ``STEPS`` steps on
two gloo ranks next to one process running the same recipe. Each case returns its losses and the
reference's, the parameters' distance after the steps, and whether ``full_state_dict()`` holds
every key of the plain model's ``state_dict()`` (tied aliases included); a case the planner or the
runtime refuses returns the message, so the test can say which cell fails and why.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from examples.models import SmallCNN
from partita.compiler.compile import compile_model
from partita.core.errors import PartitaError
from partita.core.model.losses import resolve_loss, training_loss
from partita.core.options import Options
from partita.core.precision import PrecisionPolicy
from partita.runtime.distributed import DistContext
from partita.runtime.engine import ParallelModel
from partita.runtime.mixed_precision import kept_whole
from tests.harness import gaps, plans_spread

STEPS, BATCH, SEQ, VOCAB = 2, 4, 8, 128
MESHES = {"dp2": dict(dp=2), "tp2": dict(tp=2), "pp2": dict(pp=2), "zero3": dict(dp=2, zero=3)}


def _lm(config_cls: Any, model_cls: Any, **kw: Any) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        return model_cls(config_cls(**kw))
    return build


def _models() -> dict[str, tuple[Callable[[], torch.nn.Module], list[str], Any, Callable]]:
    """name -> (factory, input specs, loss, batch(generator) -> (inputs, targets))."""
    import transformers as tf

    def tokens(g: torch.Generator) -> tuple[list[torch.Tensor], torch.Tensor]:
        idx = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        return [idx[:, :-1]], idx[:, 1:]

    def seq2seq(g: torch.Generator) -> tuple[list[torch.Tensor], torch.Tensor]:
        src = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
        tgt = torch.randint(3, VOCAB, (BATCH, SEQ + 1), generator=g)
        return [src, torch.ones_like(src), tgt[:, :-1]], tgt[:, 1:]

    def classes(g: torch.Generator) -> tuple[list[torch.Tensor], torch.Tensor]:
        return [torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)], torch.randint(0, 3, (BATCH,), generator=g)

    def images(g: torch.Generator, size: int = 32) -> tuple[list[torch.Tensor], torch.Tensor]:
        return [torch.randn(BATCH, 3, size, size, generator=g)], torch.randint(0, 10, (BATCH,), generator=g)

    ids = [f"input_ids=int64[{BATCH},{SEQ}]"]
    return {
        "gpt2": (_lm(tf.GPT2Config, tf.GPT2LMHeadModel, vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2,
                     n_head=2, use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), ids, None, tokens),
        "bart": (_lm(tf.BartConfig, tf.BartForConditionalGeneration, vocab_size=VOCAB, d_model=32,
                     encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
                     encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32, use_cache=False,
                     dropout=0.0), [*ids, f"attention_mask=int64[{BATCH},{SEQ}]",
                                    f"decoder_input_ids=int64[{BATCH},{SEQ}]"], None, seq2seq),
        "deberta-v2": (_lm(tf.DebertaV2Config, tf.DebertaV2ForSequenceClassification, vocab_size=VOCAB,
                           hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                           max_position_embeddings=32, num_labels=3, hidden_dropout_prob=0.0,
                           attention_probs_dropout_prob=0.0), ids, None, classes),
        "falcon": (_lm(tf.FalconConfig, tf.FalconForCausalLM, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                       num_attention_heads=2, use_cache=False), ids, None, tokens),
        "mixtral": (_lm(tf.MixtralConfig, tf.MixtralForCausalLM, vocab_size=VOCAB, hidden_size=32,
                        intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32, use_cache=False),
                    ids, None, tokens),
        "clip-vision": (_lm(tf.CLIPVisionConfig, tf.CLIPVisionModel, hidden_size=32, intermediate_size=64,
                            num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8),
                        [f"pixel_values=float32[{BATCH},3,32,32]"], _first_token_ce, images),
        "cnn-bn": (SmallCNN, [f"x=float32[{BATCH},3,32,32]"], None, images),
    }


def _first_token_ce(hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """CLIP's vision tower has no head: a cross-entropy over the first 10 features of its first token's
    last hidden state (its ``post_layernorm``, which only the pooled output reads, gets no gradient)."""
    return F.cross_entropy(hidden[:, 0, :10].float(), targets)


def reference(model: torch.nn.Module, loss: Any, xs: list[torch.Tensor], y: torch.Tensor, policy: PrecisionPolicy,
              micro_batch: int, optimizer: Callable, steps: int, dp: int = 1) -> list[float]:
    """The plan's recipe in one process: parameters in the policy's dtype (but batch norm's, which
    stay beside its fp32 statistics: partita's rule, ``kept_whole``), the forward under its autocast,
    fp32 masters stepped by the optimizer (fp32: the parameters themselves). The gradients of the
    micro-batches one of ``dp`` ranks runs accumulate in the parameters' dtype, the ranks' sums are
    added in fp32 (the plan's reduce dtype): a bf16 sum of every micro-batch would round where the
    plan does not, and a max-pool's tie that one such rounding flips moves a weight by a whole update."""
    keep = kept_whole(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.is_floating_point() and name not in keep:
                p.data = p.data.to(policy.param_dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    masters = [torch.nn.Parameter(p.detach().float()) for p in params] if policy.mixed else params
    opt = optimizer(masters)
    chunks = [slice(i, i + micro_batch) for i in range(0, y.shape[0], micro_batch)]
    per_rank = len(chunks) // dp
    losses = []
    for _ in range(steps):
        total = 0.0
        summed: list[torch.Tensor | None] = [None] * len(params)
        for i, rows in enumerate(chunks):
            with policy.autocast("cpu"):
                value = training_loss(loss, model, [x[rows] for x in xs], y[rows])
            (value / len(chunks)).backward()
            total += value.item() / len(chunks)
            if (i + 1) % per_rank == 0:  # this rank's micro-batches are done: into the fp32 sum
                for j, p in enumerate(params):
                    if p.grad is not None:
                        summed[j] = p.grad.float() if summed[j] is None else summed[j] + p.grad.float()
                        p.grad = None
        if policy.mixed:
            for g, m in zip(summed, masters):
                m.grad = g
        else:
            for g, p in zip(summed, params):
                p.grad = g
        opt.step()
        if policy.mixed:
            with torch.no_grad():
                for p, m in zip(params, masters):
                    p.copy_(m)
        for p in params:
            p.grad = None
        losses.append(total)
    return losses


def _optimizer(params: Any) -> torch.optim.Optimizer:
    """SGD with momentum: its update is linear in the gradient, so a few roundings apart stay a few
    roundings apart (Adam's normalised update magnifies them where a gradient is tiny); weight
    decay, which must touch only the parameters that got a gradient (CLIP's post-layernorm gets none).
    A step small enough that no model diverges (at 0.05 the CNN's loss doubled after one step, and a
    bf16 rounding apart then moved a weight by ten of its roundings)."""
    return torch.optim.SGD(params, lr=0.01, momentum=0.9, weight_decay=0.1)


def _setup(name: str, mesh: str, precision: str, fast_cluster: str) -> tuple[Callable, Any, Callable, Options]:
    """A cell's factory, loss, batch and options."""
    factory, specs, loss, batch = _models()[name]
    loss = resolve_loss(loss, "last_hidden_state" if name == "clip-vision" else None)
    targets = f"y=int64[{BATCH}]" if name == "clip-vision" else None  # its loss's, not implied by the output
    options = Options(inputs=specs, targets=targets, cluster=fast_cluster if mesh == "tp2" else "local", devices=2,
                      world_size=2, precision=precision, loss=loss, optimizer=_optimizer, log_every=0,
                      **MESHES[mesh])
    return factory, loss, batch, options


def _plan(name: str, mesh: str, precision: str, fast_cluster: str) -> Any:
    factory, _, _, options = _setup(name, mesh, precision, fast_cluster)
    return compile_model(factory, options, name=name).plan


def case(ctx: DistContext, planned: Any, name: str, mesh: str, precision: str, fast_cluster: str) -> dict:
    """One cell, given its plan (or what planning it raised)."""
    factory, loss, batch, options = _setup(name, mesh, precision, fast_cluster)
    out: dict[str, Any] = {"case": f"{name}/{mesh}/{precision}"}
    try:
        if isinstance(planned, Exception):
            raise planned
        plan = planned
        torch.manual_seed(0)
        built = factory()
        plain_keys = sorted(built.state_dict())
        model = ParallelModel(copy.deepcopy(built), plan, options, ctx=ctx)
        xs, y = batch(torch.Generator().manual_seed(1))
        losses = [float(model.train_step(*xs, targets=y)) for _ in range(STEPS)]
        full = model.full_state_dict()
    except PartitaError as e:
        return {**out, "refused": e.message}
    except Exception as e:  # the cell fails: what and where, for the test to say
        return {**out, "failed": f"{type(e).__name__}: {e}"[:2000]}
    policy = PrecisionPolicy.of(plan.training)
    ref_losses = reference(built, loss, xs, y, policy, plan.training.micro_batch_size, _optimizer, STEPS,
                           dp=plan.mesh.dp)
    ref_state = built.state_dict()
    params = {n: t.float() for n, t in full.items() if n in dict(built.named_parameters())}
    out.update(mesh=str(plan.mesh), losses=losses, ref_losses=ref_losses,
               params=gaps(params, {n: ref_state[n].float() for n in params}),
               missing_keys=sorted(set(plain_keys) - set(full)),
               sharded=sorted({pl for _, (_, pl) in model._program.local_parameters().items()}))
    return out


def run(ctx: DistContext, cells: list[tuple[str, str, str]], fast_cluster: str) -> list[dict]:
    """Every cell's plan, each made on one of the ranks (``plans_spread``), then each cell in turn."""
    plans = plans_spread(ctx, [functools.partial(_plan, *cell, fast_cluster) for cell in cells])
    return [case(ctx, plan, *cell, fast_cluster) for plan, cell in zip(plans, cells)]
