"""Aten ops dispatched per training step: a 1-device bf16-mixed plan against eager autocast.

On a GPU every dispatched aten op is (at least) one kernel launch, and a mid-size model's step is
bound by the host when it launches more, smaller kernels than it needs (../shared/gpu: 1,745 a step
at 136M parameters, one norm kernel and one cast per parameter). The count is exact and the same on
any machine, so it is measured here on the CPU: ``train_step`` of the planner's 1-device bf16-mixed
plan (``dgx-h100`` preset, fused AdamW) against the same model in fp32 under
``torch.autocast(bfloat16)`` with fused AdamW, forward + loss + backward + step. Run:
``python benchmarks/dispatch_count.py``; tests/unit/test_dispatch_count.py checks the ratio.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # examples/ is not installed
    sys.path.insert(0, str(ROOT))

from examples.models import GPT, GPTConfig  # noqa: E402

MODELS = {  # name -> (config, batch, seq)
    "GPT 12 x 64": (GPTConfig(vocab_size=256, block_size=16, n_layer=12, n_head=4, n_embd=64), 4, 16),
    "GPT 4 x 256": (GPTConfig(vocab_size=1024, block_size=64, n_layer=4, n_head=4, n_embd=256), 4, 64),
}


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3, fused=True)


def dispatches(cfg: GPTConfig, batch: int, seq: int) -> tuple[int, int, dict[str, tuple[int, int]]]:
    """(partita's ops per step, eager autocast's, the ops whose counts differ: name -> both counts)."""
    from partita.compiler.compile import compile_model
    from partita.core.options import Options
    from partita.runtime.engine import ParallelModel
    from partita.runtime.trace import DispatchCount

    os.environ.setdefault("PARTITA_LOG_EVERY", "0")
    options = Options(inputs=[f"idx=int64[{batch},{seq}]"], cluster="dgx-h100", devices=1, world_size=1,
                      precision="bf16-mixed", loss=_loss, optimizer=_optimizer)
    plan = compile_model(lambda: GPT(cfg), options).plan
    torch.manual_seed(0)
    ours = ParallelModel(GPT(cfg), plan, options)
    eager = GPT(cfg)
    opt = _optimizer(eager.parameters())
    idx = torch.randint(0, cfg.vocab_size, (batch, seq + 1))
    x, y = idx[:, :-1], idx[:, 1:]

    def eager_step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _loss(eager(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):  # the optimizers' state exists from here on
        ours.train_step(x, targets=y)
        eager_step()
    with DispatchCount() as a:
        ours.train_step(x, targets=y)
    with DispatchCount() as b:
        eager_step()
    diff = {k: (a.ops[k], b.ops[k]) for k in set(a.ops) | set(b.ops) if a.ops[k] != b.ops[k]}
    return a.count, b.count, diff


def main() -> None:
    print("aten ops dispatched per step: partita's 1-device bf16-mixed plan vs eager autocast (fused AdamW)")
    for name, (cfg, batch, seq) in MODELS.items():
        ours, eager, diff = dispatches(cfg, batch, seq)
        print(f"{name} at [{batch} x {seq}]: partita {ours}, eager {eager}, ratio {ours / eager:.3f}")
        for op, (a, b) in sorted(diff.items(), key=lambda kv: kv[1][1] - kv[1][0])[:6]:
            print(f"    {op}: {a} vs {b}")


if __name__ == "__main__":
    main()
