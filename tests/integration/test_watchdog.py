"""The watchdog (runtime/processes/watchdog.py): what starts processes (gloo
ranks, launchers, the console script, a browser); tests/unit/test_watchdog.py has the one-process checks."""

from __future__ import annotations

import sys
import time

from partita.compiler.compile import compile_model
from partita.core.cluster import load_cluster
from partita.core.model.inputs import parse_input_spec
from partita.core.options import Options
from partita.runtime.processes.watchdog import EXIT_HUNG
from tests.harness import WORKERS, command
from tests.workers import tied_script as script


def test_an_injected_mismatch_ends_the_job_with_one_message_within_the_limit(tmp_path):
    plan = compile_model(script.build("tied-gpt"),
                         Options(inputs=[parse_input_spec(f"idx=int64[4,{script.SEQ}]")],
                                 cluster=load_cluster("local", devices=2), world_size=2, pp=2)).plan
    path = plan.save(tmp_path / "plan.json")
    limit = 4
    t0 = time.monotonic()
    # plain torchrun (not harness.torchrun's tee): the test reads the job's own output
    r = command(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                WORKERS / "hang_script.py", path, limit, check=False)
    elapsed = time.monotonic() - t0
    assert r.returncode != 0
    assert "unreachable" not in r.stderr
    assert r.stderr.count("partita: the run hung") == 1, r.stderr[-3000:]
    assert "rank 0 (pipeline stage 0): waiting in all_reduce over pp ranks [0, 1]" in r.stderr
    assert "rank 1 (pipeline stage 1): waiting in broadcast over pp ranks [0, 1] (4 B), step 1" in r.stderr
    assert "mismatched collectives" in r.stderr
    assert f"exitcode  : {EXIT_HUNG}" in r.stderr  # torchrun's summary: the rank's own exit code
    # start-up + one healthy step + the 4 s limit + the reports: 10-15 s here alone, more beside other
    # launcher tests; a guard that the job ended rather than hung (the limit itself is the hang report's)
    assert elapsed < 240, f"the job ended {elapsed:.0f} s after it started: the watchdog did not end it"
