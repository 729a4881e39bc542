"""What each rank of a multi-process ZeRO test measures (test_runtime_zero.py asserts it).

Every rank trains with runtime/dp/zero.py's ZeroProgram (its own small train step,
the engine's micro-batch loop) and, in the same process, a plain single-process
reference over the same global batch; it returns both runs' losses, how far the
first step's gradients, the parameters after STEPS steps and the output are from
the reference's, the model-state bytes it holds beside
passes/cost_model.model_state_memory, and the bytes its collectives send beside
zero_traffic_elements.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from examples.models import MLP, gpt_tiny
from partita.passes.cost_model import (
    collective_traffic,
    model_state_memory,
    state_bytes_per_param,
    zero_traffic_elements,
)
from partita.runtime.collectives import CollectiveCounter
from partita.runtime.distributed import DistContext
from partita.runtime.dp.buckets import bucket_layout
from partita.runtime.dp.zero import ZeroProgram, apply_zero
from tests.harness import gaps
from tests.workers.dp_worker import MLP_BUCKET_BYTES, OPTIMIZERS, gpt_batch, gpt_loss, mlp, mlp_batch, raised

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
               accum: int, group: dist.ProcessGroup, launched: list, grads_out: dict | None = None) -> float:
    """The engine's step on this rank's share of the global batch; returns the global mean loss,
    and appends to ``launched`` the reduce-scatters each micro-batch's backward launched, with the
    buckets, as [launched, buckets]."""
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
        launched.append([zp.launched_in_backward, len(zp.buckets)])
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
    buckets = [b.numel * 4 for b in zp.buckets]
    if interpreter:
        forward = functional_mlp(zp, len(module.layers))
    else:
        forward = module
        if stage == 3:
            zp.install_module_hooks(module)
    ref_opt = OPTIMIZERS[opt_name](reference.parameters())
    x, y = batch(n * MBS * accum)
    grads: dict[str, torch.Tensor] = {}
    losses, ref_losses, traffic, launched = [], [], [], []
    for step in range(STEPS):
        losses.append(train_step(zp, forward, loss_fn, x, y, accum, group, launched, grads if step == 0 else None))
        ref_loss = loss_fn(reference(x), y)
        ref_loss.backward()
        if step == 0:
            ref_grads = {name: p.grad.clone() for name, p in reference.named_parameters()}
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
        traffic.append(sent_bytes(counter, n))
    predicted = model_state_memory(num_params, state_bytes_per_param("fp32", COST_MODEL_OPTIMIZER[opt_name]),
                                   zero_stage=stage, dp=n)
    result = {
        "case": f"zero{stage}/{model_name}/{opt_name}/dp={n}/accum={accum}{'/interpreter' if interpreter else ''}",
        "stage": stage, "optimizer": opt_name, "accum": accum,
        "losses": losses, "ref_losses": ref_losses, "grads": gaps({k: grads[k] for k in ref_grads}, ref_grads),
        # per micro-batch of each step: [reduce-scatters launched during backward, buckets]
        "launched_in_backward": launched,
        "bucket_bytes": buckets, "planner_buckets": bucket_layout(reference.parameters(), bucket_bytes),
        "num_params": num_params, "padding_elements": zp.padding_elements,
        # the model state held after a step, and the cost model's
        "held": zp.state_bytes(),
        "predicted": {"params": predicted.params, "grads": predicted.grads, "optimizer": predicted.optimizer},
        # after the step: each bucket's gathered parameters (stage 3 keeps none), the gradients left on
        # the module's parameters (stage 2 and 3: none)
        "gathered_bytes": [b.params_flat.untyped_storage().nbytes() for b in zp.buckets],
        "module_grads": sum(p.grad is not None for p in module.parameters()),
        # bytes sent each step, and the plan's figure (over unpadded buckets)
        "traffic_bytes": traffic, "predicted_traffic_bytes": expected_traffic_bytes(num_params, stage, n, accum),
        "kinds": sorted({k for (k, _, _) in counter.calls}),
    }
    with zp.gathered():
        out = forward(x) if not interpreter else module(x)
        params = [p.detach().clone() for p in module.parameters()]
        ref_params = [p.detach() for p in reference.parameters()]
        result["params"] = gaps(params, ref_params)
        result["output"] = gaps([out.detach()], [reference(x).detach()])
    return result


def refusals(ctx: DistContext) -> dict[str, str | None]:
    """The messages of what ZeRO refuses (None: it did not): stage 0 (ValueError), a gather by
    name on stage 1 (RuntimeError)."""
    out = {"stage 0": raised(lambda: apply_zero(mlp().named_parameters(), 0, dist.group.WORLD,
                                                optimizer_factory=OPTIMIZERS["sgd"]), ValueError)}
    zp = apply_zero(mlp().named_parameters(), 1, dist.group.WORLD, optimizer_factory=OPTIMIZERS["sgd"])
    out["gather on stage 1"] = raised(lambda: zp.gather("layers.0.weight"), RuntimeError)
    return out


def checks(ctx: DistContext) -> dict:
    """Every ZeRO case on this rank (19), then the refusals."""
    cases = [compare_with_reference(ctx, s, m, o) for s in (1, 2, 3) for m in ("mlp", "gpt") for o in ("adamw", "sgd")]
    cases += [compare_with_reference(ctx, s, "mlp", "adamw", accum=1) for s in (1, 2, 3)]
    cases += [compare_with_reference(ctx, s, "odd", "adamw") for s in (1, 2, 3)]
    cases.append(compare_with_reference(ctx, 3, "mlp", "adamw", interpreter=True))
    return {"cases": cases, "refusals": refusals(ctx)}
