"""Context parallelism at run time: partita's ring and all-to-all beside one process, and PyTorch's
own ``context_parallel`` where it runs (issue 42).

Run: ``.venv/bin/python benchmarks/cp_runtime_vs_torch.py [SEQ]`` (default 2048). Two gloo ranks
on this machine's CPU; the model is the example GPT (4 layers, 256 wide, 8 heads, SDPA, causal).

Per rank it reports, for one sequence of SEQ tokens (global batch 1): the bytes autograd saves for
backward (what context parallelism divides), the median step time of 5 after 2 warm-up steps, and
the collectives each step sends; beside it, one process holding the whole sequence. It then tries
PyTorch's ``torch.distributed.tensor.experimental.context_parallel`` on the same attention, the
CP torchtitan runs, and prints why it does not run here (its SDPA handlers cover the CUDA kernels;
on CPU SDPA dispatches to ``_scaled_dot_product_flash_attention_for_cpu``, which has no sharding
rule); where it cannot run, the collectives its ring sends (all-gather rotation, torchtitan's
default: K and V all-gathered once a layer in forward, again in backward, dK and dV
reduce-scattered) are set beside partita's, per rank per layer.

Measured on the 2-core dev machine (torch 2.13 CPU, load about 2.8 from other work), SEQ 2048,
2026-12-07 (saved bytes count the weights autograd keeps too, which cp does not divide):

    one process, whole sequence:   saved 153.4 MiB   step 1.13 s
    partita cp=2 ring:             saved  87.2 MiB   step 1.37 s  (0.57x, 1.21x)  24 sends of 1 MiB
    partita cp=2 all-to-all:       saved  87.3 MiB   step 1.20 s  (0.57x, 1.06x)  32 all-to-alls of 1 MiB
    torch context_parallel (CPU):  NotImplementedError: Operator
        aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy
        registered.

The two ranks share the machine's 2 cores (and its load), so the step times say what the
exchanges and the split kernels cost here, not a speed-up; the ring ran 5.41 s before its blocks
used the fused kernel (written-out fp32 blocks). Per layer per micro-batch a rank sends, in
blocks of its K or V (1 MiB here): partita's ring 6 (cp - 1) (K, V on cp - 1 times forward and
backward, dK, dV cp - 1 hops home), each exchange overlapped with a block's compute; torch's
all-gather ring the same 6 (cp - 1) as (cp - 1)/cp of an all-gather of K and V forward, again
backward, and a reduce-scatter of dK and dV: three collectives that wait before the compute.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from examples.models import GPT, GPTConfig
from partita.core.mesh import Mesh
from partita.core.model.inputs import InputSpec
from partita.core.options import Options
from partita.runtime.engine import ParallelModel
from tests.harness import launch
from tests.tp_choice import tp_plan

VOCAB = 1024


def model() -> GPT:
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=8192, n_layer=4, n_head=8, n_embd=256))


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _saved(step) -> int:
    seen: dict[int, torch.UntypedStorage] = {}

    def pack(t):
        s = t.untyped_storage()
        seen.setdefault(s.data_ptr(), s)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(s.nbytes() for s in seen.values())


def _timed(step) -> float:
    for _ in range(2):
        step()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def per_rank(ctx, seq: int) -> dict:
    torch.manual_seed(0)
    reference = model()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (1, seq + 1), generator=g)
    x, y = ids[:, :-1], ids[:, 1:]
    out = {}
    if ctx.rank == 0:  # one process, the whole sequence
        one = copy.deepcopy(reference)

        def step():
            loss_fn(one(x), y).backward()
        out["one process"] = (_saved(step), _timed(step), [])
    plan = tp_plan(copy.deepcopy(reference), [InputSpec("idx", torch.int64, (1, seq))], loss_fn, None, tp=1,
                   dp=2, mbs=1, accum=1, pins=None)
    for strategy in ("ring", "all-to-all"):
        p = dataclasses.replace(plan, mesh=Mesh(dp=2, cp=2), training=dataclasses.replace(
            plan.training, global_batch=1, cp_attention=strategy, optimizer="sgd"))
        m = ParallelModel(copy.deepcopy(reference), p, Options(loss=loss_fn, optimizer=functools.partial(
            torch.optim.SGD, lr=0.0)), ctx=ctx)
        saved = _saved(lambda m=m: m.train_step(x, targets=y))
        m.collectives.reset()
        m.train_step(x, targets=y)
        calls = [c for c in m.collectives.as_tuples() if c[1] == "cp"]
        out[f"partita cp=2 {strategy}"] = (saved, _timed(lambda m=m: m.train_step(x, targets=y)), calls)
    out["torch context_parallel"] = _torch_cp(ctx)
    return out


def _torch_cp(ctx) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    torch.manual_seed(0)
    m = model()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (1, 257), generator=g)
    x, y = ids[:, :-1].clone(), ids[:, 1:].clone()
    try:
        with context_parallel(mesh, buffers=[x, y], buffer_seq_dims=[1, 1]):
            loss_fn(m(x), y).backward()
    except Exception as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return "ran"


def main(seq: int = 2048) -> None:
    results = launch(2, per_rank, seq, timeout_s=900)
    base = results[0]["one process"]
    for name, value in results[0].items():
        if isinstance(value, str):
            print(f"{name:28s} {value}")
            continue
        saved, step, calls = value
        ratio = f"  ({saved / base[0]:.2f}x, {step / base[1]:.2f}x)" if name != "one process" else ""
        print(f"{name:28s} saved {saved / 2**20:7.1f} MiB   step {step:.2f} s{ratio}   {calls}")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
