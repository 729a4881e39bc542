"""Data-parallel runtime on real gloo processes, against a single-process reference.

Each launch (2 and 4 ranks) runs many cases (dp_worker.py measures, the test asserts):
MLP and tiny GPT, AdamW and SGD, gradient accumulation over 2 micro-batches,
3 steps; losses, first-step gradients and final parameters within fp32
tolerance; collectives counted per step equal to a hand-built plan's list;
ZeRO-1/2/3 through ParallelModel, their model state beside the cost model's;
plans for another world size or tp without node decisions refused; wrong batch sizes refused.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from partita.core.errors import PartitaError
from partita.core.options import Options
from partita.runtime.dp.buckets import bucket_layout
from partita.runtime.engine import ParallelModel
from tests.workers.dp_worker import MLP_BUCKET_BYTES, MLP_BUCKETS, OPTIMIZERS, make_plan, mlp, mlp_batch

# fp32: a plan sums the same numbers as one process, in another order (per-rank shares, buckets)
RTOL, ATOL = 1e-5, 1e-6


def test_bucket_layout_follows_the_stated_rule():
    assert bucket_layout(mlp().parameters(), MLP_BUCKET_BYTES) == list(MLP_BUCKETS)
    # One parameter over the cap is a bucket of its own; the cap closes a bucket once reached.
    big = torch.nn.Linear(64, 64)  # weight 16384 B, bias 256 B; reversed: bias, weight
    assert bucket_layout(big.parameters(), 1000) == [16384 + 256]
    assert bucket_layout(big.parameters(), 100) == [256, 16384]
    # A change of dtype closes the open bucket.
    mixed = [torch.nn.Parameter(torch.zeros(10)), torch.nn.Parameter(torch.zeros(10, dtype=torch.float64))]
    assert bucket_layout(mixed, 1 << 20) == [80, 40]
    frozen = torch.nn.Linear(4, 4).requires_grad_(False)
    assert bucket_layout(frozen.parameters()) == []


def test_single_process_runs_the_plan_micro_batching_like_the_plain_model():
    plan = make_plan(1)
    torch.manual_seed(0)
    reference = mlp()
    model = ParallelModel(mlp(), plan, Options(loss=F.mse_loss, optimizer=OPTIMIZERS["adamw"]))
    model.module.load_state_dict(reference.state_dict())
    opt = OPTIMIZERS["adamw"](reference.parameters())
    assert model.ctx.world_size == 1 and model.ctx.backend == "none"
    x, y = mlp_batch(plan.training.global_batch)
    for _ in range(3):
        loss = model.train_step(x, targets=y)
        ref = F.mse_loss(reference(x), y)
        ref.backward()
        opt.step()
        opt.zero_grad()
        assert loss == pytest.approx(ref.item(), rel=1e-5, abs=1e-6)
    torch.testing.assert_close(model(x), reference(x), rtol=1e-5, atol=1e-6)
    assert model.layers is model.module.layers  # attribute access falls through
    assert model.collectives.as_tuples() == []
    with pytest.raises(PartitaError, match="batch size 3"):
        model.train_step(x[:3], targets=y[:3])
