"""Checks run inside each rank of a multi-process ZeRO test (see test_runtime_zero.py).

Every rank trains with runtime/dp/zero.py's ZeroProgram (its own small train step,
the engine's micro-batch loop) and, in the same process, a plain single-process
reference over the same global batch; it compares losses, first-step gradients
and parameters after STEPS steps, the model-state bytes it holds with
passes/cost_model.model_state_memory, and the bytes its collectives send with
zero_traffic_elements. Failures raise; measured errors and sizes are returned for the log.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dp_worker import ATOL, MLP_BUCKET_BYTES, OPTIMIZERS, RTOL, gpt_batch, gpt_loss, mlp, mlp_batch
from examples.models import MLP, gpt_tiny
from harness import check_close, check_loss
from partita.passes.cost_model import (
    collective_traffic, model_state_memory, state_bytes_per_param, zero_traffic_elements,
)
from partita.runtime.collectives import CollectiveCounter
from partita.runtime.distributed import DistContext
from partita.runtime.dp.buckets import bucket_layout
from partita.runtime.dp.zero import ZeroProgram, apply_zero

STEPS = 3
MBS = 2
GPT_BUCKET_BYTES = 64 * 1024  # ~10 buckets over the tiny GPT, several straddling modules
ODD_BUCKET_BYTES = 256  # odd-sized buckets: shards need padding at dp=2 and 4
COST_MODEL_OPTIMIZER = {"adamw": "adamw", "sgd": "sgd-momentum"}  # OPTIMIZERS["sgd"] has momentum


def odd_mlp() -> nn.Module:
    return MLP(d_in=5, hidden=9, d_out=3, layers=3)  # 174 parameters


def odd_batch(global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(global_batch, 5, generator=g), torch.randn(global_batch, 3, generator=g)


def train_step(zp: ZeroProgram, forward: Callable, loss_fn: Callable, x: torch.Tensor, y: torch.Tensor,
               accum: int, group: dist.ProcessGroup, grads_out: dict | None = None) -> float:
    """The engine's step on this rank's share of the global batch; returns the global mean loss."""
    share = x.shape[0] // zp.size
    rows = slice(zp.rank * share, (zp.rank + 1) * share)
    x, y = x[rows], y[rows]
    mbs = share // accum
    zp.counter.reset()
    loss_sum = torch.zeros(())
    for i in range(accum):
        zp.begin_micro_batch(is_last=i == accum - 1)
        mb = slice(i * mbs, (i + 1) * mbs)
        loss = loss_fn(forward(x[mb]), y[mb])
        loss_sum += loss.detach()
        (loss / accum).backward()
        zp.after_backward()
        assert zp.launched_in_backward == len(zp.buckets) or (zp.stage == 1 and i < accum - 1), (
            "reduce-scatters launched after backward, not overlapped", zp.launched_in_backward)
    if grads_out is not None:  # inspection, not the step's traffic: count it elsewhere
        step_counter, zp.counter = zp.counter, CollectiveCounter()
        grads_out.update(zp.gather_grads())
        zp.counter = step_counter
    zp.step()
    zp.zero_grad()
    dist.all_reduce(loss_sum, group=group)  # for the comparison only, not counted
    return float(loss_sum) / (accum * zp.size)


def sent_bytes(counter: CollectiveCounter, n: int) -> float:
    return sum(collective_traffic(kind, nbytes, n) * calls for (kind, _axis, nbytes), calls in counter.calls.items())


def expected_traffic_bytes(num_params: int, stage: int, n: int, accum: int) -> float:
    """The plan's per-step figure, scaled for accumulation as runtime/dp/zero.py documents."""
    per_step = zero_traffic_elements(num_params, stage, n) * 4
    return per_step * {1: 1, 2: (accum + 1) / 2, 3: accum}[stage]


def functional_mlp(zp: ZeroProgram, layers: int) -> Callable:
    """MLP's forward written the way an fx Interpreter runs it: parameters fetched by name."""
    def forward(x: torch.Tensor) -> torch.Tensor:
        for i in range(layers):
            names = [f"layers.{i}.weight", f"layers.{i}.bias"]
            w, b = (zp.gather(n) for n in names)
            x = zp.release(names, F.linear(x, w, b))
            if i < layers - 1:
                x = F.relu(x)
        return x
    return forward


def compare_with_reference(ctx: DistContext, stage: int, model_name: str, opt_name: str,
                           *, accum: int = 2, interpreter: bool = False) -> dict:
    n = ctx.world_size
    group = dist.group.WORLD
    factory, batch, loss_fn, bucket_bytes = {
        "mlp": (mlp, mlp_batch, F.mse_loss, MLP_BUCKET_BYTES),
        "odd": (odd_mlp, odd_batch, F.mse_loss, ODD_BUCKET_BYTES),
        "gpt": (gpt_tiny, gpt_batch, gpt_loss, GPT_BUCKET_BYTES),
    }[model_name]
    torch.manual_seed(100)
    reference = factory()
    torch.manual_seed(100)  # the same start on every rank (compose broadcasts it)
    module = factory()
    num_params = sum(p.numel() for p in reference.parameters())
    counter = CollectiveCounter()
    zp = apply_zero(module.named_parameters(), stage, group, optimizer_factory=OPTIMIZERS[opt_name],
                    bucket_bytes=bucket_bytes, counter=counter)
    assert [b.numel * 4 for b in zp.buckets] == bucket_layout(reference.parameters(), bucket_bytes)
    if interpreter:
        forward = functional_mlp(zp, len(module.layers))
    else:
        forward = module
        if stage == 3:
            zp.install_module_hooks(module)
    ref_opt = OPTIMIZERS[opt_name](reference.parameters())
    x, y = batch(n * MBS * accum)
    grads: dict[str, torch.Tensor] = {}
    loss_errs, traffic = [], []
    for step in range(STEPS):
        loss = train_step(zp, forward, loss_fn, x, y, accum, group, grads if step == 0 else None)
        ref_loss = loss_fn(reference(x), y)
        ref_loss.backward()
        if step == 0:
            ref_grads = {name: p.grad.clone() for name, p in reference.named_parameters()}
        ref_opt.step()
        ref_opt.zero_grad()
        loss_errs.append(check_loss(loss, ref_loss.item(), rtol=RTOL, atol=ATOL))
        traffic.append(sent_bytes(counter, n))
    case = f"zero{stage}/{model_name}/{opt_name}/dp={n}/accum={accum}{'/interpreter' if interpreter else ''}"
    grad_err = check_close({k: grads[k] for k in ref_grads}, ref_grads, rtol=RTOL, atol=ATOL, what=f"{case} grad")

    # Model state held after a step, against the cost model (exact with padding counted).
    held = zp.state_bytes()
    predicted = model_state_memory(num_params, state_bytes_per_param("fp32", COST_MODEL_OPTIMIZER[opt_name]),
                                   zero_stage=stage, dp=n)
    padded = num_params + zp.padding_elements
    step_tensors = 4 * len(zp.buckets) if opt_name == "adamw" else 0  # AdamW's fp32 `step` per shard
    moments = {"adamw": 8, "sgd": 4}[opt_name]
    assert held == {
        "params": 4 * padded // (n if stage == 3 else 1),
        "grads": 4 * padded // (n if stage >= 2 else 1),
        "optimizer": moments * padded // n + step_tensors,
    }, held
    pad_bound = 16 * (n - 1) * len(zp.buckets) + step_tensors
    assert 0 <= sum(held.values()) - predicted.total <= pad_bound, (held, predicted)
    if stage == 3:  # no full copy survives the step
        assert all(b.params_flat.untyped_storage().nbytes() == 0 for b in zp.buckets)
    if stage >= 2:
        assert all(p.grad is None for p in module.parameters())

    # Traffic per step, against zero_traffic_elements (over padded buckets).
    expected = expected_traffic_bytes(num_params, stage, n, accum)
    for t in traffic:
        assert abs(t - expected * padded / num_params) < 1e-6 * expected, (t, expected)
    kinds = sorted({k for (k, _, _) in counter.calls})
    assert kinds == ["all_gather", "reduce_scatter"], kinds

    with zp.gathered():
        out = forward(x) if not interpreter else module(x)
        params = [p.detach().clone() for p in module.parameters()]
        ref_params = [p.detach() for p in reference.parameters()]
        param_err = check_close(params, ref_params, rtol=RTOL, atol=ATOL, what=f"{case} param")
        check_close([out.detach()], [reference(x).detach()], rtol=RTOL, atol=ATOL, what=f"{case} output")
    return {
        "case": case, "loss_err": max(loss_errs), "grad_err": grad_err, "param_err": param_err,
        "held": held, "predicted": [predicted.params, predicted.grads, predicted.optimizer],
        "padding_elements": zp.padding_elements, "buckets": len(zp.buckets),
        "traffic_bytes": traffic[-1], "predicted_traffic_bytes": expected,
    }


def check_refusals(ctx: DistContext) -> None:
    try:
        apply_zero(mlp().named_parameters(), 0, dist.group.WORLD, optimizer_factory=OPTIMIZERS["sgd"])
    except ValueError as e:
        assert "stage=0" in str(e)
    else:
        raise AssertionError("stage 0 accepted")
    zp = apply_zero(mlp().named_parameters(), 1, dist.group.WORLD, optimizer_factory=OPTIMIZERS["sgd"])
    try:
        zp.gather("layers.0.weight")
    except RuntimeError as e:
        assert "stage 3" in str(e)
    else:
        raise AssertionError("gather accepted on stage 1")


def checks(ctx: DistContext) -> list[dict]:
    """Every ZeRO check on this rank (19 cases), then the refusals."""
    results = [compare_with_reference(ctx, s, m, o) for s in (1, 2, 3) for m in ("mlp", "gpt") for o in ("adamw", "sgd")]
    results += [compare_with_reference(ctx, s, "mlp", "adamw", accum=1) for s in (1, 2, 3)]
    results += [compare_with_reference(ctx, s, "odd", "adamw") for s in (1, 2, 3)]
    results.append(compare_with_reference(ctx, 3, "mlp", "adamw", interpreter=True))
    check_refusals(ctx)
    return results
