"""What each rank measures under expert parallelism (test_expert_parallel.py asserts it).

A tiny Mixtral (transformers' default experts: grouped matmuls over experts) planned with its experts
split over ``ep`` of the ``dp`` ranks (``--dp``/``--ep`` pinned), trained a few steps next to one
process running the same recipe (tests/workers/any_model_worker.py ``reference``). Each case returns its
losses and the reference's, the parameters' distance after the steps (``full_state_dict()``: the
experts gathered back over their group), the shape of the rank's own expert slice, and the
all-to-alls the step ran over "ep".
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch

from partita.compiler.compile import compile_model
from partita.core.errors import PartitaError
from partita.core.model.losses import resolve_loss
from partita.core.options import Options
from partita.core.precision import PrecisionPolicy
from partita.runtime.distributed import DistContext
from partita.runtime.engine import ParallelModel
from tests.harness import gaps, plans_spread
from tests.workers.any_model_worker import _optimizer, reference

STEPS, SEQ, VOCAB, EXPERTS = 3, 8, 128, 4


def mixtral() -> torch.nn.Module:
    import transformers as tf

    return tf.MixtralForCausalLM(tf.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, num_local_experts=EXPERTS, num_experts_per_tok=2, max_position_embeddings=32,
        use_cache=False))


def gpt_oss() -> torch.nn.Module:
    """A tiny GPT-OSS: its experts add a bias gathered by expert id to each grouped matmul's rows."""
    import transformers as tf

    return tf.GptOssForCausalLM(tf.GptOssConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=16, num_local_experts=EXPERTS, num_experts_per_tok=2,
        max_position_embeddings=32, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        use_cache=False))


def dbrx() -> torch.nn.Module:
    """A tiny DBRX: its experts loop over the experts a batch hits (captured as grouped matmuls,
    core/model/moe_loops.py), their weights (E x F, H) each."""
    import transformers as tf

    return tf.DbrxForCausalLM(tf.DbrxConfig(
        vocab_size=VOCAB, d_model=32, n_heads=2, n_layers=2, max_seq_len=32, use_cache=False,
        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        ffn_config={"ffn_hidden_size": 64, "moe_num_experts": EXPERTS, "moe_top_k": 2}))


def jetmoe() -> torch.nn.Module:
    """A tiny JetMoE: feed-forward and attention experts, each routed by a top-k gate that lists the rows
    per expert in Python (captured as grouped matmuls, core/model/moe_loops.py): three expert layers a
    layer (the feed-forward, the attention's query and output projections)."""
    import transformers as tf

    return tf.JetMoeForCausalLM(tf.JetMoeConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_key_value_heads=2, kv_channels=16,
        intermediate_size=64, num_local_experts=EXPERTS, num_experts_per_tok=2, max_position_embeddings=32,
        use_cache=False))


FAMILIES = {"mixtral": mixtral, "gpt-oss": gpt_oss, "dbrx": dbrx, "jetmoe": jetmoe}
# expert layers (regions of grouped matmuls sharing offsets, core/experts.py) per transformer layer
REGIONS = {"jetmoe": 3}
# each family's weights stacked over experts (the first names a layer's), by their names' endings
STACKED = {"mixtral": ("experts.gate_up_proj", "experts.down_proj"),
           "gpt-oss": ("experts.gate_up_proj", "experts.down_proj"),
           "dbrx": ("experts.mlp.w1", "experts.mlp.v1", "experts.mlp.w2"),
           "jetmoe": ("mlp.input_linear.weight", "mlp.output_linear.weight", "experts.input_linear.weight",
                      "experts.output_linear.weight")}


def _options(world: int, dp: int, ep: int, precision: str = "fp32", micro_batches: int = 1,
             recompute: str | None = None, zero: int | None = None, pp: int | None = None) -> Options:
    return Options(inputs=[f"input_ids=int64[{2 * dp * micro_batches},{SEQ}]"], cluster="local", devices=world,
                   world_size=world, precision=precision, optimizer=_optimizer, log_every=0, dp=dp, ep=ep,
                   grad_accum_steps=micro_batches, recompute=recompute, zero=zero, pp=pp)


def _plan(world: int, family: str, *cell: Any) -> Any:
    return compile_model(FAMILIES[family], _options(world, *cell), name=family).plan


def case(ctx: DistContext, planned: Any, dp: int, ep: int, precision: str, micro_batches: int = 1,
         recompute: str | None = None, zero: int | None = None, pp: int | None = None, family: str = "mixtral") -> dict:
    """One cell, given its plan (or what planning it raised)."""
    batch = 2 * dp * micro_batches
    options = _options(ctx.world_size, dp, ep, precision, micro_batches, recompute, zero, pp)
    out: dict[str, Any] = {"case": f"{family} dp{dp}/ep{ep}/{precision}/m{micro_batches}/{recompute}/z{zero}/pp{pp}"}
    factory = FAMILIES[family]
    try:
        if isinstance(planned, Exception):
            raise planned
        plan = planned
        torch.manual_seed(0)
        built = factory()
        model = ParallelModel(copy.deepcopy(built), plan, options, ctx=ctx)
        g = torch.Generator().manual_seed(1)
        idx = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=g)
        xs, y = [idx[:, :-1]], idx[:, 1:]
        losses = [float(model.train_step(*xs, targets=y)) for _ in range(STEPS)]
        full = model.full_state_dict()
        tp = model._program.tp_module  # (ep = 1 without recomputation runs the eager module)
        held = (tp.local_parameters() if tp is not None
                else {n: (q, "replicate") for n, q in model._program.module.named_parameters()})
        local = {n: tuple(q.shape) for n, (q, _) in held.items()}
        param_bytes = sum(q.numel() * q.element_size() for q, _ in held.values())
        calls: dict[str, int] = {}
        sizes: dict[str, list[int]] = {}  # bytes of each kind of call over "ep" and "edp" the step ran
        for (kind, axis, nbytes), n in model.collectives.calls.items():  # the last step's, by kind and axis
            calls[f"{kind}/{axis}"] = calls.get(f"{kind}/{axis}", 0) + n
            sizes.setdefault(f"{kind}/{axis}", []).append(nbytes)
        planned: dict[str, int] = {}
        planned_sizes: dict[str, list[int]] = {}
        stage = plan.mesh.stage_of(ctx.rank)  # (one chunk per rank: the plans here run 1F1B)
        for c in plan.collectives:
            if c.axis in ("ep", "edp") and c.stage in (None, stage):
                planned[f"{c.kind}/{c.axis}"] = planned.get(f"{c.kind}/{c.axis}", 0) + c.count
                planned_sizes.setdefault(f"{c.kind}/{c.axis}", []).append(c.bytes)
    except PartitaError as e:
        return {**out, "refused": e.message}
    policy = PrecisionPolicy.of(plan.training)
    ref_losses = reference(built, resolve_loss(None, None), xs, y, policy, plan.training.micro_batch_size,
                           _optimizer, STEPS, dp=plan.mesh.dp)
    ref = {n: t.float() for n, t in built.state_dict().items()}
    params = {n: t.float() for n, t in full.items() if n in dict(built.named_parameters())}
    first, *stacked = STACKED[family]
    name = next(k for k in full if k.endswith(first))  # a layer's stacked weight
    per = dict(built.named_parameters())[name].shape[0] // EXPERTS  # one expert's rows (DBRX's: F of E x F)
    out.update(mesh=str(plan.mesh), ep=plan.mesh.ep, losses=losses, ref_losses=ref_losses,
               params=gaps(params, {n: ref[n] for n in params}),
               local_expert=[next(v[0] for k, v in local.items() if k.endswith(first)) // per],
               full_expert=[full[name].shape[0] // per],
               calls=calls, sizes=sizes, planned=planned,
               planned_sizes=planned_sizes, param_bytes=param_bytes, predicted_params=plan.predicted.memory.params,
               param_numel=sum(q.numel() for q, _ in held.values()), stage_params=plan.stages[stage].params,
               moe_layers=sum(n.endswith(first) for n in held),
               expert_layers=sum(n.endswith(first) for n in held) * REGIONS.get(family, 1),
               layouts={p.name: dict(p.layout) for p in plan.params if p.name.endswith((first, *stacked))})
    return out


def run(ctx: DistContext, cells: list[tuple]) -> list[dict]:
    """Every cell's plan, each made on one of the ranks (``plans_spread``), then each cell in turn."""
    plans = plans_spread(ctx, [functools.partial(_plan, ctx.world_size, _family(cell), *cell[:7]) for cell in cells])
    return [case(ctx, plan, *cell) for plan, cell in zip(plans, cells)]


def _family(cell: tuple) -> str:
    return cell[7] if len(cell) > 7 else "mixtral"


def _model(ctx: DistContext, plan: Any, dp: int, ep: int, seed: int
           ) -> tuple[ParallelModel, list[torch.Tensor], torch.Tensor]:
    batch = 2 * dp
    options = _options(ctx.world_size, dp, ep)
    torch.manual_seed(seed)
    model = ParallelModel(mixtral(), plan, options, ctx=ctx)
    idx = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return model, [idx[:, :-1]], idx[:, 1:]


def checkpoint(ctx: DistContext, plans: tuple[Any, Any], outdir: str, dp: int, ep_from: int, ep_to: int) -> dict:
    """A checkpoint saved with the experts split over ``ep_from`` loads into a model (built from
    another seed) whose plan splits them over ``ep_to``: the whole state it holds then, and the
    next steps' losses, against the run that saved it going on."""
    path = f"{outdir}/ep{ep_from}-to-ep{ep_to}"
    a, xs, y = _model(ctx, plans[0], dp, ep_from, seed=0)
    a.train_step(*xs, targets=y)
    a.save_checkpoint(path)
    saved = {k: v.float() for k, v in a.full_state_dict().items()}
    going_on = [float(a.train_step(*xs, targets=y)) for _ in range(2)]
    b, xs, y = _model(ctx, plans[1], dp, ep_to, seed=1)
    b.load_checkpoint(path)
    loaded = {k: v.float() for k, v in b.full_state_dict().items()}
    resumed = [float(b.train_step(*xs, targets=y)) for _ in range(2)]
    return {"case": f"checkpoint/dp{dp}/ep{ep_from}->ep{ep_to}", "state": gaps(loaded, saved),
            "losses": resumed, "going_on": going_on}


def checkpoints(ctx: DistContext, outdir: str, cells: list[tuple]) -> list[dict]:
    """Both plans of every cell, each made on one of the ranks (``plans_spread``), then each cell in turn."""
    plans = plans_spread(ctx, [functools.partial(_plan, ctx.world_size, "mixtral", dp, ep)
                               for dp, ep_from, ep_to in cells for ep in (ep_from, ep_to)])
    for p in plans:
        if isinstance(p, Exception):
            raise p
    return [checkpoint(ctx, (plans[2 * i], plans[2 * i + 1]), outdir, *cell) for i, cell in enumerate(cells)]
