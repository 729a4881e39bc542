"""What a checkpoint every step costs: step time with ``checkpoint_every=1`` over step time without.

The benchmark model: the example GPT (4 layers, width 256, vocabulary 256; 3.3 M parameters, a
40 MB checkpoint with AdamW's moments) on a dp2 plan over two gloo processes (one torch thread
each), a global batch of 64 x 128 tokens (``--batch``, ``--seq``). Three copies train side by
side in the same processes: without checkpoints, with a checkpoint every step written in the background (the default for
periodic checkpoints: a CPU copy taken at the step, DCP's planning and the writes on a thread and
a process group of their own) and with the step waiting for the write (``async_checkpoints=False``).
Each takes turns running a block of steps (a barrier before each; the background copy's last save
waited for inside its block) and the median per-step time of each is compared with the one
without checkpoints. Every save is complete: its files digested and its marker written; the
newest ``keep_last=2`` are kept. Run: ``python benchmarks/checkpoint_cost.py [--rounds 6]
[--batch 64 --seq 128]``.

On a CPU host every core trains, so the background write takes its CPU time (about 2 ms per MB
written and 0.1-0.3 ms per tensor, digests included) from the step; on a GPU host that time is
idle. Measured on the 2-core CI machine, shared with other jobs (two runs each; the machine's
load moves a ratio by up to 10%):

    batch x seq   without, ms/step   every step, in the background   every step, waiting
    64 x 128      2146 / 2581        1.03x / 1.06x                    1.13x / 0.96x
    16 x 64        300 / 253         2.01x / 1.80x                    1.77x / 1.94x

At 16 x 64 tokens a step's 250-300 ms of compute is little beside writing 40 MB every step, and
the two cores have no time to spare for it in the background.
"""

from __future__ import annotations

import argparse
import copy
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

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # examples/ is not installed; spawned ranks inherit sys.path
    sys.path.insert(0, str(ROOT))

from examples.models import GPT, GPTConfig  # noqa: E402
from partita.core.mesh import Mesh  # noqa: E402
from partita.core.options import Options  # noqa: E402
from partita.core.plans.plan import MemoryBreakdown, ModelInfo, Plan, Prediction, SolverReport, Training  # noqa: E402
from partita.runtime.distributed import init_distributed  # noqa: E402
from partita.runtime.engine import ParallelModel  # noqa: E402

WORLD, BLOCK = 2, 4
MODES = {"none": {}, "async": {"checkpoint_every": 1}, "sync": {"checkpoint_every": 1, "async_checkpoints": False}}


def model(seq: int) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, block_size=seq, n_layer=4, n_head=4, n_embd=256))


def _plan(batch: int) -> Plan:
    mem = MemoryBreakdown(0, 0, 0, 0, 1 << 40)
    return Plan(model=ModelInfo("bench", "0" * 16, 0, 0, (), "none", 0), cluster={}, mesh=Mesh(dp=WORLD),
                training=Training(global_batch=batch, micro_batch_size=batch // WORLD, grad_accum_steps=1),
                predicted=Prediction(0.0, 0.0, {}, 0.0, mem, {}, 0.0, None, 0.0, 0.0),
                solver=SolverReport("hand", "OPTIMAL", 0.0, 0.0, 1))


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _worker(rank: int, port: int, rounds: int, batch: int, seq: int, folder: str, queue) -> None:
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    ctx = init_distributed(timeout_s=120)
    base = model(seq)
    optimizer = lambda ps: torch.optim.AdamW(ps, lr=1e-4)
    models = {name: ParallelModel(copy.deepcopy(base), _plan(batch), Options(
        loss=_loss, optimizer=optimizer, log_every=0, keep_last=2,
        checkpoint_dir=str(Path(folder, name)) if extra else None, **extra), ctx=ctx)
        for name, extra in MODES.items()}
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 256, (batch, seq + 1), generator=g)
    x, y = idx[:, :-1], idx[:, 1:]

    def block(m: ParallelModel) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(BLOCK):
            m.train_step(x, targets=y)
        m.wait_for_checkpoint()
        return (time.perf_counter() - start) / BLOCK

    for m in models.values():  # warm-up
        block(m)
    times: dict[str, list[float]] = {name: [] for name in MODES}
    for r in range(rounds):
        order = list(MODES) if r % 2 == 0 else list(reversed(MODES))
        for name in order:
            times[name].append(block(models[name]))
    if rank == 0:
        params = sum(p.numel() for p in base.parameters())
        size = sum(f.stat().st_size for f in Path(folder, "sync").rglob("*") if f.is_file()) // 2  # 2 kept
        queue.put((params, size, {name: statistics.median(t) for name, t in times.items()}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="partita-ckpt-bench-") as folder:
        mp.spawn(_worker, args=(port, args.rounds, args.batch, args.seq, folder, queue), nprocs=WORLD)
    params, size, medians = queue.get()
    none = medians["none"]
    print(f"GPT {params / 1e6:.2f} M parameters, dp2 on {WORLD} gloo processes, batch {args.batch} x {args.seq} "
          f"tokens, a {size / 1e6:.0f} MB checkpoint; median over {args.rounds} rounds of {BLOCK} steps")
    for name, t in medians.items():
        print(f"  {name:>5}: {t * 1e3:7.1f} ms/step  {t / none:5.2f}x")


if __name__ == "__main__":
    main()
