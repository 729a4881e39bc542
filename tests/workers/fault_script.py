"""Faults under `partita run` (tests/integration/test_faults.py).

usage: fault_script.py CASE STEPS PAUSE_S   (the repository's root on PYTHONPATH)

CASE: ``train`` (STEPS steps, PAUSE_S seconds after each, then ``finished at N``; with $FAULT_GO set,
it waits after step 4 until that file exists), ``raise`` (rank 1
raises a ValueError after its first step, writing the time it raised to $FAULT_AT), ``early`` (rank 1's
script ends, exit code 0, before it builds the model).
"""

import os
import sys
import time

import torch

import partita
from tests.workers import tied_script as script

if __name__ == "__main__":
    case, steps, pause = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    if case == "early" and os.environ["RANK"] == "1":
        sys.exit(0)
    model = partita.parallelize(script.build("tied-gpt"), optimizer=script.optimizer)
    batch = model.plan.training.global_batch
    while model.step < steps:
        g = torch.Generator().manual_seed(1000 + model.step)  # the data of step k, whoever runs it
        seq = torch.randint(0, script.VOCAB, (batch, script.SEQ + 1), generator=g)
        model.train_step(seq[:, :-1], targets=seq[:, 1:])
        if case == "raise" and model.ctx.rank == 1:
            with open(os.environ["FAULT_AT"], "w") as f:
                f.write(repr(time.time()))
            raise ValueError("rank 1's own bug")
        time.sleep(pause)
        if os.environ.get("FAULT_GO") and model.step == 4:
            deadline = time.monotonic() + 120
            while not os.path.exists(os.environ["FAULT_GO"]) and time.monotonic() < deadline:
                time.sleep(0.1)
    print(f"finished at {model.step}", flush=True)
