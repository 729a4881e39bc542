"""What each rank of the random-state tests measures (test_rng.py asserts it).

HF BERT (MLM) with its dropout on, planned on `local` (dropout replicated over "tp"), every rank
seeding its own generator differently after the model is built, as training scripts do:
- with the runtime's random state (runtime/rng.py) every replicated parameter stays bit-identical
  across its group (``check_replicas`` after every step: its message, None while they agree);
- without it (the tracker switched off) the replicas drift, and the check names the first
  parameter that differs: the failure the issue reported, caught;
- a recomputing plan draws the same dropout masks as the plain one: identical losses;
- the same run seed gives the same run.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist

from examples.models import hf_bert_mlm
from partita.compiler.compile import compile_model
from partita.core.cluster import load_cluster
from partita.core.errors import PartitaError
from partita.core.model.inputs import parse_input_spec
from partita.core.options import Options
from partita.core.plans.verify import load_plan
from partita.runtime.distributed import DistContext
from partita.runtime.engine import ParallelModel
from tests.workers.dp_worker import raised

STEPS, BATCH, SEQ, VOCAB = 3, 8, 16, 256


def _loss(out, y):
    return torch.nn.functional.cross_entropy(out.flatten(0, -2), y.flatten())


def _optimizer(ps):
    return torch.optim.AdamW(ps, lr=1e-2)


def _plan(ctx: DistContext, out: str, **pins):
    """The model, and its plan: compiled once, on rank 0, and read by every rank."""
    torch.manual_seed(0)
    model = hf_bert_mlm(vocab_size=VOCAB, dropout=0.1)
    path = Path(out, "bert-" + "-".join(f"{k}{v}" for k, v in pins.items()) + ".plan.json")
    if ctx.rank == 0:
        compile_model(copy.deepcopy(model), Options(inputs=[parse_input_spec(f"input_ids=int64[{BATCH},{SEQ}]")],
                                                    cluster=load_cluster("local", devices=ctx.world_size),
                                                    world_size=ctx.world_size, **pins, loss=_loss)).plan.save(path)
    dist.barrier()
    return model, load_plan(path, world_size=ctx.world_size)


def _train(ctx: DistContext, model, plan, *, tracker: bool = True) -> tuple[ParallelModel, list[float], str | None]:
    """STEPS steps, ``check_replicas`` after each: the model, the losses and the first drift the
    check reports (None: none; the run stops there)."""
    torch.manual_seed(0)  # rank 0's initial seed: the run seed
    pm = ParallelModel(copy.deepcopy(model), plan, Options(loss=_loss, optimizer=_optimizer, check_replicas_every=0),
                       ctx=ctx)
    if not tracker:
        pm.tensor_parallel.rng = None
    torch.manual_seed(1000 + ctx.rank)  # every rank its own seed, after building, as scripts do
    g = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(STEPS):
        x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        losses.append(pm.train_step(x, targets=x))
        drift = raised(pm.check_replicas, PartitaError)
        if drift is not None:
            return pm, losses, drift
    return pm, losses, None


def replicas(ctx: DistContext, out: str, **pins) -> dict:
    model, plan = _plan(ctx, out, **pins)
    pm, losses, drift = _train(ctx, model, plan)
    # the check fires: perturb one replicated parameter on the second rank of each tp group
    name, (param, _) = next((n, v) for n, v in pm.tensor_parallel.local_parameters().items()
                            if not v[1].startswith("shard"))
    if pm.tensor_parallel.tp.rank == 1:
        with torch.no_grad():
            param.view(-1)[0] += 1e-3
    injected = raised(pm.check_replicas, PartitaError)
    # without the runtime's random state, the per-rank seeds make the replicas drift, and it says so
    _, _, drift_without = _train(ctx, model, plan, tracker=False)
    # same run seed, same run; a recomputing plan draws the same masks
    _, again, drift_again = _train(ctx, model, plan)
    result = {"case": f"rng/{pins}", "dropout_nodes": sum("dropout" in d.op for d in plan.nodes),
              "losses": losses, "drift": drift, "injected_into": name, "injected": injected,
              "drift_without": drift_without, "again": again, "drift_again": drift_again}
    if plan.mesh.pp == 1:
        rc = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, recompute="full") for s in plan.stages))
        _, result["recompute_losses"], result["drift_recompute"] = _train(ctx, model, rc)
    return result


def tp2(ctx: DistContext, out: str) -> list[dict]:
    return [replicas(ctx, out, tp=2)]


def tp2xdp2_then_tp2xpp2(ctx: DistContext, out: str) -> list[dict]:
    return [replicas(ctx, out, tp=2, dp=2), replicas(ctx, out, tp=2, pp=2)]


LAUNCHES = {"tp2": (2, tp2), "tp2xdp2-tp2xpp2": (4, tp2xdp2_then_tp2xpp2)}
