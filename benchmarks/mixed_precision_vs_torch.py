"""partita in bf16-mixed against torch's own recipes, side by side on two gloo processes.

- data parallelism: partita's bf16-mixed DP plan (bf16 parameters and compute, fp32 master
  weights and AdamW state, gradients reduced in fp32) against ``DistributedDataParallel`` with
  ``torch.autocast(bfloat16)`` (fp32 parameters, bf16 matmuls);
- ZeRO-3: partita's bf16-mixed ZeRO-3 plan against FSDP2 (``fully_shard`` per layer and at the
  root, ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``).

Step time: both systems train the same model from the same weights with the same AdamW and the
same per-rank batch in the same processes; after warm-up they step in alternation (a barrier
before each timed step) and the medians are compared, as benchmarks/dp_vs_ddp.py does.

Peak transient memory: over two steps of each system after the timing, the most bytes the CPU
allocator held at once above what it held before (torch.profiler's allocation events, summed in
time order, on rank 0): what a step allocates and frees, model state excluded.

Run: ``python benchmarks/mixed_precision_vs_torch.py [--repeats 20]``.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:  # spawned ranks inherit sys.path
        sys.path.insert(0, str(p))

from dp_vs_ddp import alternate  # noqa: E402

from examples.models import MLP  # noqa: E402
from partita.core.options import Options  # noqa: E402
from partita.runtime.distributed import init_distributed  # noqa: E402
from partita.runtime.engine import ParallelModel  # noqa: E402

WORLD, WARMUP, BATCH = 2, 3, 64


def _model() -> MLP:
    torch.manual_seed(0)
    return MLP(d_in=1024, hidden=1024, d_out=1024, layers=4)


def _optimizer(ps):
    return torch.optim.AdamW(ps, lr=1e-4)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(BATCH, 1024, generator=g), torch.randn(BATCH, 1024, generator=g)


def _ours(ctx, zero: int) -> ParallelModel:
    """The planner's bf16-mixed plan at (dp=2, ZeRO ``zero``), at its default unit: ZeRO-3 gathers a
    layer at a time (the plan's ``zero_units``, the repeated layers), as FSDP2 per layer does."""
    from partita.compiler.compile import compile_model

    options = Options(inputs=[f"x=float32[{BATCH},1024]"], targets=f"y=float32[{BATCH},1024]", loss=F.mse_loss,
                      cluster="local", devices=WORLD, world_size=WORLD, precision="bf16-mixed", dp=WORLD,
                      zero=zero, micro_batch_size=BATCH // WORLD, optimizer=_optimizer)
    plan = compile_model(_model, options).plan
    return ParallelModel(_model(), plan, options, ctx=ctx)


def _torch_step(kind: str, rank: int):
    """DDP + autocast, or FSDP2 with a mixed-precision policy: one step's closure."""
    x, y = _data()
    share = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
    x, y = x[share], y[share]
    model = _model()
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    opt = _optimizer(model.parameters())

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=kind == "ddp"):
            loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        dist.all_reduce(loss.detach().div_(WORLD))  # train_step returns the global mean too

    return step


def _init(rank: int, port: int):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), PARTITA_LOG_EVERY="0")
    torch.set_num_threads(1)
    return init_distributed(timeout_s=120)


def _time_worker(rank: int, port: int, repeats: int, queue) -> None:
    ctx = _init(rank, port)
    x, y = _data()
    for label, zero, kind in (("DP, bf16-mixed vs DDP + autocast", 0, "ddp"),
                              ("ZeRO-3, bf16-mixed vs FSDP2 + MixedPrecisionPolicy", 3, "fsdp2")):
        ours = _ours(ctx, zero)
        theirs = _torch_step(kind, rank)
        mine = lambda m=ours: m.train_step(x, targets=y)
        t_ours, t_theirs = alternate(mine, theirs, repeats, WARMUP)
        peaks = (peak_transient_bytes(mine), peak_transient_bytes(theirs))
        if rank == 0:
            queue.put(("time", label, statistics.median(t_ours), statistics.median(t_theirs)))
            queue.put(("memory", label, *peaks))
    dist.destroy_process_group()


def peak_transient_bytes(step, steps: int = 2) -> int:
    """The most bytes the CPU allocator held at once during ``steps`` calls of ``step``, above
    what was held before them (torch.profiler's allocation events, summed in time order)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(steps):
            step()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.spawn(_time_worker, args=(_port(), args.repeats, queue), nprocs=WORLD)
    from rich.console import Console
    from rich.table import Table

    results = []
    while not queue.empty():
        results.append(queue.get())
    table = Table(title=f"bf16-mixed on {WORLD} gloo processes, MLP 1024x4 (4.2 M), median of {args.repeats} steps")
    for col in ("comparison", "partita", "torch", "partita / torch"):
        table.add_column(col, justify="left" if col == "comparison" else "right")
    for kind, label, ours, theirs in results:
        if kind == "time":
            table.add_row(label + ": step ms", f"{ours * 1e3:.1f}", f"{theirs * 1e3:.1f}", f"{ours / theirs:.3f}")
        else:
            table.add_row(label + ": peak transient MB", f"{ours / 2**20:.1f}", f"{theirs / 2**20:.1f}",
                          f"{ours / theirs:.3f}")
    Console().print(table)


if __name__ == "__main__":
    main()
