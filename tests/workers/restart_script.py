"""A training loop that survives a dying rank or node (run by tests/unit/test_restarts.py and
tests/unit/test_elastic.py under `partita run --checkpoint-dir D --checkpoint-every 2 --max-restarts 1`).

usage: restart_script.py OUTDIR KILL_AT [launcher]   (the repository's root on PYTHONPATH)

Rank 1 SIGKILLs itself right after step KILL_AT on the first attempt (0: never), once the
checkpoint being written in the background is complete; with ``launcher``, the rank of the node
whose OUTDIR is named ``node1`` SIGKILLs its launcher instead (the node is lost: the rank dies
with it). Every attempt appends its losses to OUTDIR/losses.jsonl, with the world size and the
wall time at the end of each step (the killer writes the time of its kill to OUTDIR/killed_at);
rank 0 saves the plan it runs to OUTDIR/plan-wN.json (N: the world size) and the final parameters
to OUTDIR/final.pt.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

import partita
from tests.workers import tied_script as script

STEPS = 6

if __name__ == "__main__":
    out, kill_at = Path(sys.argv[1]), int(sys.argv[2])
    lose_node = sys.argv[3:] == ["launcher"]
    model = partita.parallelize(script.build("tied-gpt"), optimizer=script.optimizer)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank, world = model.ctx.rank, model.ctx.world_size
    if rank == 0:
        model.plan.save(out / f"plan-w{world}.json")
    killer = (out.name == "node1") if lose_node else (rank == 1)
    batch = model.plan.training.global_batch
    while model.step < STEPS:
        g = torch.Generator().manual_seed(1000 + model.step)  # the data of step k, whoever runs it
        seq = torch.randint(0, script.VOCAB, (batch, script.SEQ + 1), generator=g)
        loss = model.train_step(seq[:, :-1], targets=seq[:, 1:])
        if rank == 0:
            with open(out / "losses.jsonl", "a") as f:
                f.write(json.dumps({"attempt": attempt, "step": model.step, "loss": loss, "world": world,
                                    "t": time.time()}) + "\n")
        if model.step == kill_at and attempt == 0 and killer:
            model.wait_for_checkpoint()
            (out / "killed_at").write_text(repr(time.time()))
            os.kill(os.getppid() if lose_node else os.getpid(), signal.SIGKILL)
            time.sleep(60)  # the launcher's death takes this rank with it
    state = model.full_state_dict()
    if rank == 0:
        torch.save(state, out / "final.pt")
