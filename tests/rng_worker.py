"""Checks run inside each rank of the random-state tests (see test_rng.py).

HF BERT (MLM) with its dropout on, planned on `local` (dropout replicated over "tp"), every rank
seeding its own generator differently after the model is built, as training scripts do:
- with the runtime's random state (runtime/rng.py) every replicated parameter stays bit-identical
  across its group (``check_replicas_every=1`` checks it every step and would raise);
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
from partita.core.errors import PartitaError
from partita.core.inputs import parse_input_spec
from partita.core.verify import load_plan
from partita.core.cluster import load_cluster
from partita.core.options import Pins
from partita.runtime.distributed import DistContext
from partita.runtime.engine import ParallelModel
from partita.core.options import Options

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
        compile_model(copy.deepcopy(model), Options(inputs=[parse_input_spec(f"input_ids=int64[{BATCH},{SEQ}]")], cluster=load_cluster("local", devices=ctx.world_size), world_size=ctx.world_size, **pins, loss=_loss)).plan.save(path)
    dist.barrier()
    return model, load_plan(path, world_size=ctx.world_size)


def _train(ctx: DistContext, model, plan, *, tracker: bool = True, check: int = 1) -> tuple[ParallelModel, list[float]]:
    torch.manual_seed(0)  # rank 0's initial seed: the run seed
    pm = ParallelModel(copy.deepcopy(model), plan, Options(loss=_loss, optimizer=_optimizer, check_replicas_every=0), ctx=ctx)
    if not tracker:
        pm.tensor_parallel.rng = None
    torch.manual_seed(1000 + ctx.rank)  # every rank its own seed, after building, as scripts do
    g = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(STEPS):
        x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        losses.append(pm.train_step(x, targets=x))
        if check:
            pm.check_replicas()
    return pm, losses


def replicas(ctx: DistContext, out: str, **pins) -> dict:
    model, plan = _plan(ctx, out, **pins)
    assert any("dropout" in d.op for d in plan.nodes)
    pm, losses = _train(ctx, model, plan)  # check_replicas after every step: raises on a drift
    # the check fires: perturb one replicated parameter on the second rank of each tp group
    name, (param, _) = next((n, v) for n, v in pm.tensor_parallel.local_parameters().items()
                            if not v[1].startswith("shard"))
    if pm.tensor_parallel.tp.rank == 1:
        with torch.no_grad():
            param.view(-1)[0] += 1e-3
    try:
        pm.check_replicas()
    except PartitaError as e:
        assert name in str(e) and "tp group" in str(e), str(e)
    else:
        raise AssertionError("an injected divergence was not reported")
    # without the runtime's random state, the per-rank seeds make the replicas drift, and it says so
    try:
        _train(ctx, model, plan, tracker=False)
    except PartitaError as e:
        drift = str(e)
    else:
        raise AssertionError("replicas did not drift without the random-state tracker")
    # same run seed, same run; a recomputing plan draws the same masks
    again = _train(ctx, model, plan)[1]
    assert again == losses, (again, losses)
    if plan.mesh.pp == 1:
        rc = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, recompute=True) for s in plan.stages))
        rc_losses = _train(ctx, model, rc)[1]
        assert rc_losses == losses, (rc_losses, losses)
    return {"case": f"rng/{pins}", "losses": losses, "drift_without": drift.split(" from ")[0]}


def tp2(ctx: DistContext, out: str) -> list[dict]:
    return [replicas(ctx, out, tp=2)]


def tp2xdp2_then_tp2xpp2(ctx: DistContext, out: str) -> list[dict]:
    return [replicas(ctx, out, tp=2, dp=2), replicas(ctx, out, tp=2, pp=2)]


LAUNCHES = {"tp2": (2, tp2), "tp2xdp2-tp2xpp2": (4, tp2xdp2_then_tp2xpp2)}
