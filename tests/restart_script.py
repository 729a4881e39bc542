"""A training loop that survives a dying rank (run by tests/test_restarts.py under
`partita run --checkpoint-dir D --checkpoint-every 2 --max-restarts 1`).

usage: restart_script.py OUTDIR KILL_AT   (the repository's root on PYTHONPATH)

Rank 1 SIGKILLs itself right after step KILL_AT on the first attempt (0: never). Every attempt
appends its losses to OUTDIR/losses.jsonl; rank 0 saves the final parameters to OUTDIR/final.pt.
"""

import json
import os
import signal
import sys
from pathlib import Path

import torch

import partita
from tests import tied_script as script

STEPS = 6

if __name__ == "__main__":
    out, kill_at = Path(sys.argv[1]), int(sys.argv[2])
    model = partita.parallelize(script.build("tied-gpt"), optimizer=script.optimizer)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    batch = model.plan.training.global_batch
    while model.step < STEPS:
        g = torch.Generator().manual_seed(1000 + model.step)  # the data of step k, whoever runs it
        seq = torch.randint(0, script.VOCAB, (batch, script.SEQ + 1), generator=g)
        loss = model.train_step(seq[:, :-1], targets=seq[:, 1:])
        if model.ctx.rank == 0:
            with open(out / "losses.jsonl", "a") as f:
                f.write(json.dumps({"attempt": attempt, "step": model.step, "loss": loss}) + "\n")
        if model.step == kill_at and attempt == 0 and model.ctx.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
    state = model.full_state_dict()
    if model.ctx.rank == 0:
        torch.save(state, out / "final.pt")
