"""What each rank measures for per-rank data loading (test_per_rank_data.py asserts it).

A tiny GPT, planned once per mesh (dp2; tp2 on a fast-link cluster, where the plan really shards;
pp2; dp2 with ZeRO-3; each plan made on one of the ranks, ``plans_spread``), trains ``STEPS``
steps twice from the same initial weights: in the global-batch mode (every rank loads each whole
global batch and ``train_step`` takes its share) and through ``model.loader(...)`` with
``local=True``. Each run returns its losses, its final ``full_state_dict()`` (as a list of
numbers, compared exactly by the test) and how many bytes and which samples its dataset's
``__getitem__`` handed out on this rank. On pp2 a third run loads one dataset per field (inputs,
targets): each stage fetches only the one it reads, passing None for the other.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from examples.models import GPT, GPTConfig
from partita.compiler.compile import compile_model
from partita.core.options import Options
from partita.runtime.distributed import DistContext
from partita.runtime.engine import ParallelModel
from tests.harness import plans_spread

STEPS, BATCH, SEQ, VOCAB, SEED = 3, 8, 8, 64, 5
MESHES = {"dp2": dict(dp=2), "tp2": dict(tp=2), "pp2": dict(pp=2), "zero3": dict(dp=2, zero=3)}


class Tokens(Dataset):
    """``STEPS`` global batches of token sequences, (x, y) = (tokens[:-1], tokens[1:]); counts the
    bytes ``__getitem__`` returned and the indices it was asked for."""

    def __init__(self) -> None:
        self.tokens = torch.randint(0, VOCAB, (STEPS * BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
        self.bytes = 0
        self.read: list[int] = []

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.tokens[i, :-1].clone(), self.tokens[i, 1:].clone()  # (SEQ,), (SEQ,)
        self.bytes += x.nbytes + y.nbytes
        self.read.append(i)
        return x, y


class Field(Dataset):
    """One field of ``Tokens`` as a dataset of its own (0: the inputs, 1: the targets), for the
    loader's per-field form; counts the bytes it handed out."""

    def __init__(self, tokens: Tokens, field: int) -> None:
        self.tokens, self.field, self.bytes = tokens.tokens, field, 0

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, i: int) -> torch.Tensor:
        t = self.tokens[i, :-1] if self.field == 0 else self.tokens[i, 1:]
        self.bytes += t.nbytes
        return t.clone()


def _gpt() -> GPT:
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=2, n_embd=16))


def _train(model: ParallelModel, batches: Any, *, local: bool) -> dict:
    losses = [float(model.train_step(x, targets=y, local=local)) for x, y in batches]
    state = model.full_state_dict()
    return {"losses": losses, "state": {n: t.flatten().tolist() for n, t in state.items()}}


def _options(mesh: str, fast_cluster: str) -> Options:
    return Options(inputs=[f"idx=int64[{BATCH},{SEQ}]"], cluster=fast_cluster if mesh == "tp2" else "local",
                   devices=2, world_size=2, optimizer="adamw", log_every=0, **MESHES[mesh])


def _plan(mesh: str, fast_cluster: str) -> Any:
    return compile_model(_gpt, _options(mesh, fast_cluster), name="gpt").plan


def case(ctx: DistContext, mesh: str, plan: Any, fast_cluster: str) -> dict:
    """One mesh's runs, given its plan."""
    options = _options(mesh, fast_cluster)
    torch.manual_seed(0)
    built = _gpt()
    # the global-batch mode: every rank loads whole global batches, drawn as the per-rank loader draws them
    whole = Tokens()
    model = ParallelModel(copy.deepcopy(built), plan, options, ctx=ctx)
    order = torch.Generator().manual_seed(SEED)
    everything = _train(model, DataLoader(whole, batch_size=BATCH, shuffle=True, drop_last=True, generator=order),
                        local=False)
    # per rank: each loads only its share
    mine = Tokens()
    model = ParallelModel(copy.deepcopy(built), plan, options, ctx=ctx)
    shares = _train(model, model.loader(mine, shuffle=True, seed=SEED), local=True)
    out = {}
    if plan.mesh.pp > 1:  # one dataset per field: each stage fetches only the field it reads
        fields = Field(Tokens(), 0), Field(Tokens(), 1)
        model = ParallelModel(copy.deepcopy(built), plan, options, ctx=ctx)
        got = _train(model, model.loader(fields, shuffle=True, seed=SEED), local=True)
        out["fields"] = {**got, "reads": list(model.reads), "bytes": [f.bytes for f in fields]}
    return {**out, "mesh": mesh, "dp": plan.mesh.dp, "dp_rank": model._program.dp_rank,
            "sharded": sorted({pl for _, (_, pl) in model._program.local_parameters().items()}),
            "global": {**everything, "bytes": whole.bytes, "read": sorted(whole.read)},
            "local": {**shares, "bytes": mine.bytes, "read": sorted(mine.read)}}


def run(ctx: DistContext, fast_cluster: str) -> list[dict]:
    """Every mesh's plan, each made on one of the ranks (``plans_spread``), then each mesh in turn."""
    plans = plans_spread(ctx, [functools.partial(_plan, mesh, fast_cluster) for mesh in MESHES])
    for p in plans:
        if isinstance(p, Exception):
            raise p
    return [case(ctx, mesh, plan, fast_cluster) for mesh, plan in zip(MESHES, plans)]
