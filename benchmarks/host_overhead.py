"""Host time per training step: partita's plans against an eager full-model step, on the same rank.

A GPT of many tiny ops (12 layers, hidden 64, batch 4 x 16 tokens) is host-bound on any device, as
a mid-size model is on a GPU: what a step costs is the Python and dispatch work per op. Each of two
gloo processes (one torch thread) runs, interleaved round by round after warm-up:

- eager: the whole model, its loss, backward and a fused AdamW step, plainly (the reference);
- tp2: the planner's plan pinned to tp=2 over the two processes;
- pp2: the planner's plan pinned to pp=2 (each rank runs half the layers; the planner takes one
  micro-batch of 4, as every op costs the host the same whatever its rows: docs/cost-model.md);
- pp2-m2: the same pinned to two micro-batches of 2 (each rank runs half the layers twice, as many
  ops as the eager step: the runtime's cost per op against eager's);
- recompute: a one-process plan that recomputes every layer (run in-process on each rank);

and reports each one's median thread CPU time per step (``time.thread_time``: waiting in a
collective costs no CPU time) over the eager step's, and the aten ops each dispatches per step
(``TorchDispatchMode``; the CPU proxy for kernel launches). Run:
``python benchmarks/host_overhead.py [--repeats 20]``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # examples/ is not installed; spawned ranks inherit sys.path
    sys.path.insert(0, str(ROOT))

from examples.models import GPT, GPTConfig  # noqa: E402

WORLD, BATCH, SEQ, WARMUP = 2, 4, 16, 3
CASES = {"tp2": dict(tp=2, world_size=2), "pp2": dict(pp=2, world_size=2),
         "pp2-m2": dict(pp=2, grad_accum_steps=2, world_size=2),
         "recompute": dict(recompute=True, world_size=1, devices=1)}


def model() -> GPT:
    return GPT(GPTConfig(vocab_size=256, block_size=SEQ, n_layer=12, n_head=4, n_embd=64))


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3, fused=True)


class Dispatches(TorchDispatchMode):
    """Counts the aten ops dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def plans(folder: Path) -> dict[str, str]:
    """Each case's plan, compiled once here (the planner is not what is measured)."""
    from partita.compiler.compile import compile_model
    from partita.core.options import Options

    out = {}
    for name, pins in CASES.items():
        world = pins.pop("world_size")
        devices = pins.pop("devices", world)
        options = Options(inputs=[f"idx=int64[{BATCH},{SEQ}]"], cluster="local", devices=devices, world_size=world,
                          loss=_loss, optimizer=_optimizer, **pins)
        path = folder / f"{name}.plan.json"
        compile_model(model, options, name="gpt-12x64").plan.save(path)
        out[name] = str(path)
    return out


def _worker(rank: int, port: int, repeats: int, plan_paths: dict[str, str], queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), PARTITA_LOG_EVERY="0")
    torch.set_num_threads(1)
    from partita.core.options import Options
    from partita.core.plans.verify import load_plan
    from partita.runtime.distributed import DistContext, init_distributed
    from partita.runtime.engine import ParallelModel

    ctx = init_distributed(timeout_s=120)
    torch.manual_seed(0)
    reference = model()
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 256, (BATCH, SEQ + 1), generator=g)
    x, y = idx[:, :-1], idx[:, 1:]
    options = Options(loss=_loss, optimizer=_optimizer)
    single = DistContext(0, 1, 0, "none", torch.device("cpu"), False)
    steps = {}
    for name, path in plan_paths.items():
        plan = load_plan(path)
        pm = ParallelModel(copy.deepcopy(reference), plan, options, ctx=ctx if plan.world_size > 1 else single)
        steps[name] = lambda pm=pm: pm.train_step(x, targets=y)
    eager = copy.deepcopy(reference)
    opt = _optimizer(eager.parameters())

    def eager_step() -> None:
        loss = _loss(eager(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    steps = {"eager": eager_step, **steps}
    for _ in range(WARMUP):
        for fn in steps.values():
            fn()
    dispatches = {}
    for name, fn in steps.items():
        with Dispatches() as d:
            fn()
        dispatches[name] = d.count
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, fn in steps.items():
            dist.barrier()
            t0 = time.thread_time()
            fn()
            times[name].append(time.thread_time() - t0)
    queue.put((rank, {name: statistics.median(t) for name, t in times.items()}, dispatches))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        paths = plans(Path(folder))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        procs = [ctx.Process(target=_worker, args=(r, port, args.repeats, paths, queue)) for r in range(WORLD)]
        for p in procs:
            p.start()
        got = [queue.get(timeout=1800) for _ in range(WORLD)]
        for p in procs:
            p.join()
    results = {r: (t, d) for r, t, d in got}
    print(f"host time per step (thread CPU, median of {args.repeats}), GPT 12 x 64 at [{BATCH} x {SEQ}], "
          f"{WORLD} gloo processes")
    print(f"{'case':<10} {'rank 0 ms':>10} {'rank 1 ms':>10} {'/ eager':>8} {'aten ops':>9} {'/ eager':>8}")
    for name in ("eager", *CASES):
        ms = [results[r][0][name] * 1e3 for r in range(WORLD)]
        ratio = max(results[r][0][name] / results[r][0]["eager"] for r in range(WORLD))
        ops = [results[r][1][name] for r in range(WORLD)]
        print(f"{name:<10} {ms[0]:>10.2f} {ms[1]:>10.2f} {ratio:>8.2f} {max(ops):>9} "
              f"{max(ops) / max(results[r][1]['eager'] for r in range(WORLD)):>8.2f}")
    print(json.dumps({name: max(results[r][0][name] / results[r][0]["eager"] for r in range(WORLD))
                      for name in CASES}))


if __name__ == "__main__":
    main()
