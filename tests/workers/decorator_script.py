"""A user's training script: one decorator, one train_step call. Run by tests/unit/test_decorator.py
under torchrun (the plan made by rank 0), under `partita run PLAN.json` (the plan from a file),
and on the harness's gloo group with the plan passed as `partita run` passes it (``run_plan``).

usage: decorator_script.py OUT.json   (the repository's root on PYTHONPATH)
"""

import json
import sys
from pathlib import Path

import torch

import partita
from examples.models import gpt_tiny

STEPS, BATCH, SEQ = 3, 8, 32


@partita.parallelize(inputs={"idx": f"int64[{BATCH},{SEQ}]"}, cluster="local", grad_accum_steps=2,
                     optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2, eps=1e-5))
def make_model():
    torch.manual_seed(0)
    return gpt_tiny()


def batches():
    g = torch.Generator().manual_seed(7)
    for _ in range(STEPS):
        seq = torch.randint(0, 256, (BATCH, SEQ + 1), generator=g)
        yield seq[:, :-1], seq[:, 1:]


def write_results(model, out: Path) -> None:
    """Train, then (rank 0) write the losses, the collectives counted against the plan's, the
    gathered state and ZeRO's held bytes."""
    losses = [model.train_step(x, targets=y) for x, y in batches()]
    counted = [list(t) for t in model.collectives.as_tuples()]  # the last step's, before gathering below
    state = model.full_state_dict()  # every rank takes part
    if model.ctx.rank == 0:
        torch.save(state, out.with_suffix(".pt"))
        out.write_text(json.dumps({
            "losses": losses,
            "world_size": model.ctx.world_size,
            "mesh": [model.plan.mesh.dp, model.plan.mesh.tp, model.plan.mesh.pp],
            "micro_batch_size": model.plan.training.micro_batch_size,
            "grad_accum_steps": model.plan.training.grad_accum_steps,
            "counted": counted,
            # rank 0 holds pipeline stage 0 (pp is the outermost mesh axis)
            "planned": [[c.kind, c.axis, c.bytes, c.count] for c in model.plan.collectives if c.stage in (None, 0)],
            # the model state ZeRO keeps on this rank, and the plan's per-device prediction of it
            "held": model._program.zero.state_bytes() if model._program.zero is not None else None,
            "buckets": len(model._program.zero.buckets) if model._program.zero is not None else 0,
            "predicted_state": [getattr(model.plan.predicted.memory, k) for k in ("params", "grads", "optimizer")],
        }))


def run_plan(ctx, plan: str, out: str, trace: str | None = None) -> None:
    """tests/harness.py's entry: the decorated model on a running group, with ``plan`` (and
    ``trace``) as `partita run` passes them (PARTITA_PLAN, PARTITA_TRACE)."""
    import os
    from unittest import mock

    with mock.patch.dict(os.environ, {"PARTITA_PLAN": plan, **({"PARTITA_TRACE": trace} if trace else {})}):
        write_results(make_model(), Path(out))


if __name__ == "__main__":
    write_results(make_model(), Path(sys.argv[1]))
