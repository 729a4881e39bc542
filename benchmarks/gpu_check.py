"""One GPU: a 1-device bf16-mixed plan of a ~100M-parameter GPT against eager PyTorch with autocast.

    python benchmarks/gpu_check.py [--steps 30] [--batch 8] [--seq 1024]

Without a GPU it prints why and exits 0 (CI has none). On one GPU it plans the model for one
device of the ``dgx-h100`` preset in ``bf16-mixed`` (partita's default on GPUs), runs the plan with
``ParallelModel.train_step`` and, from the same initial weights and batches, a plain eager loop
(fp32 parameters, ``torch.autocast(bfloat16)``, fused AdamW), and prints, per loop: the median step
time after warm-up and its ratio (goal: partita within 3% of eager), the peak memory
(``torch.cuda.max_memory_allocated``) next to the plan's prediction, and the losses side by side.
The two recipes differ on purpose in one point: partita keeps bf16 parameters with fp32 masters
(2 + 2 + 12 bytes per parameter), eager autocast keeps fp32 parameters and casts per op, so the
losses agree to bf16 rounding (about 1%), not bit for bit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def gpt_100m():
    from examples.models import GPT, GPTConfig

    # 12 layers x 768 wide over a 32k vocabulary with a separate head: ~110M parameters
    return GPT(GPTConfig(vocab_size=32768, block_size=1024, n_layer=12, n_head=12, n_embd=768))


def _time_steps(step, steps: int, warmup: int = 5) -> tuple[float, list[float]]:
    losses, times = [], []
    for k in range(warmup + steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        losses.append(step(k))
        torch.cuda.synchronize()
        if k >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times), losses


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to measure (this check needs one GPU)")
        return 0

    from partita.compiler.compile import compile_model
    from partita.core.cluster import load_cluster
    from partita.core.model.inputs import parse_input_spec
    from partita.core.model.losses import default_loss
    from partita.core.options import Options
    from partita.runtime.engine import ParallelModel

    B, T = args.batch, args.seq
    options = Options(inputs=[parse_input_spec(f"idx=int64[{B},{T}]")], cluster=load_cluster("dgx-h100", devices=1),
                      precision="bf16-mixed", optimizer="adamw", world_size=1)
    plan = compile_model(gpt_100m, options).plan
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 32768, (B, T + 1), generator=g) for _ in range(4)]
    opt = lambda ps: torch.optim.AdamW(ps, lr=3e-4, fused=True)

    torch.manual_seed(0)
    model = gpt_100m()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    torch.cuda.reset_peak_memory_stats()
    pm = ParallelModel(model, plan, Options(loss=default_loss, optimizer=opt))

    def partita_step(k: int) -> float:
        b = batches[k % len(batches)]
        return pm.train_step(b[:, :-1], targets=b[:, 1:])

    t_partita, l_partita = _time_steps(partita_step, args.steps)
    peak_partita = torch.cuda.max_memory_allocated()
    pm = model = None  # freed before the eager run measures its peak
    torch.cuda.empty_cache()

    eager = gpt_100m()
    eager.load_state_dict(init)
    eager = eager.cuda()
    eopt = opt(eager.parameters())
    torch.cuda.reset_peak_memory_stats()

    def eager_step(k: int) -> float:
        b = batches[k % len(batches)].cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = default_loss(eager(b[:, :-1]), b[:, 1:])
        loss.backward()
        eopt.step()
        eopt.zero_grad(set_to_none=True)
        return loss.item()

    t_eager, l_eager = _time_steps(eager_step, args.steps)
    peak_eager = torch.cuda.max_memory_allocated()
    predicted = plan.predicted.memory
    figures = {
        "device": torch.cuda.get_device_name(), "params": plan.model.num_params, "batch": [B, T],
        "step_ms": {"partita": t_partita * 1e3, "eager_autocast": t_eager * 1e3, "ratio": t_partita / t_eager},
        "peak_bytes": {"partita": peak_partita, "eager_autocast": peak_eager,
                       "plan_predicted": predicted.total,
                       "plan_state": predicted.params + predicted.grads + predicted.optimizer,
                       "plan_activations": predicted.activations},
        "loss": {"partita": l_partita[-1], "eager_autocast": l_eager[-1],
                 "max_rel_diff": max(abs(a - b) / abs(b) for a, b in zip(l_partita, l_eager))},
    }
    print(json.dumps(figures, indent=1))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
