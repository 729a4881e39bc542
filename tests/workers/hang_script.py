"""A run that hangs: stage 1 skips the tied-gradient all-reduce its peer waits in (the old
tp x pp bug, injected). Run by tests/unit/test_watchdog.py under torchrun with a short watchdog limit.

usage: hang_script.py PLAN.json WATCHDOG_S   (the repository's root on PYTHONPATH)
"""

import sys

import partita
from tests.workers import tied_script as script

if __name__ == "__main__":
    model = partita.parallelize(script.build("tied-gpt"), plan=sys.argv[1], optimizer=script.optimizer,
                                watchdog_s=float(sys.argv[2]))
    batches = script.batches(model.plan.training.global_batch)
    x, y = next(batches)
    model.train_step(x, targets=y)  # a healthy step first
    if model.ctx.rank == 1:
        model._program.pipeline.sync_tied = lambda: None  # stage 1 never joins the tied all-reduce
    x, y = next(batches)
    model.train_step(x, targets=y)
    print("unreachable: the step returned", file=sys.stderr)
