"""A run to stop from outside (tests/integration/test_hygiene.py): each rank writes OUTDIR/pid.rankR once it
trains, then trains slowly; or, with ``hang-save``, rank 1 never joins rank 0's checkpoint save.

usage: hygiene_script.py OUTDIR (slow | hang-save)   (the repository's root on PYTHONPATH)
"""

import os
import sys
import time
from pathlib import Path

import torch

import partita
from tests.workers import tied_script as script

if __name__ == "__main__":
    out, case = Path(sys.argv[1]), sys.argv[2]
    model = partita.parallelize(script.build("tied-gpt"), optimizer=script.optimizer)
    seq = torch.randint(0, script.VOCAB, (model.plan.training.global_batch, script.SEQ + 1),
                        generator=torch.Generator().manual_seed(0))
    model.train_step(seq[:, :-1], targets=seq[:, 1:])
    Path(out, f"pid.rank{model.ctx.rank}").write_text(str(os.getpid()))
    if case == "hang-save":
        if model.ctx.rank == 1:
            time.sleep(600)  # never reaches the save: rank 0 waits in it
        model.save_checkpoint(out / "ckpt")
    for _ in range(600):
        model.train_step(seq[:, :-1], targets=seq[:, 1:])
        time.sleep(0.2)
