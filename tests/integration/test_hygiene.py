"""`partita run` from outside: SIGTERM and SIGINT end it with 143 and 130 and one line, its ranks
stopped; a SIGKILLed launcher takes its workers with it (no orphan) and the other node names the
lost node and its ranks in one line; the watchdog ends a rank that waits in a checkpoint save."""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.harness import ENV, PARTITA, WORKERS, free_port


def start(*args: object) -> subprocess.Popen:
    return subprocess.Popen([PARTITA, "run", *map(str, args)], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def pids(out: Path, ranks: int, timeout_s: float = 120) -> dict[int, int]:
    """The workers' pids, once every rank trains."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = {int(p.name[8:]): int(p.read_text()) for p in out.glob("pid.rank*") if p.read_text()}
        if len(found) == ranks:
            return found
        time.sleep(0.2)
    raise AssertionError(f"the ranks did not start training in {timeout_s} s")


def said(err: str) -> list[str]:
    """The lines of ``err`` but Python's warnings (torch's deprecation warnings from the ranks, each
    a line and its indented source line, the ranks' possibly interleaved)."""
    return [line for line in err.splitlines() if "Warning: " not in line and not line.startswith(" ")]


def gone(pid: int, timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        with open(f"/proc/{pid}/stat") as f:  # a zombie is gone too (its parent has not reaped it yet)
            if f.read().split(")")[-1].split()[0] == "Z":
                return True
        time.sleep(0.1)
    return False
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_ends_the_run_with_its_code_and_one_line(dp2_plan, tmp_path, sig, code):
    p = start(dp2_plan, WORKERS / "hygiene_script.py", tmp_path, "slow")
    workers = pids(tmp_path, 2)
    p.send_signal(sig)
    out, err = p.communicate(timeout=60)
    assert p.returncode == code, err[-3000:]
    assert said(err) == [f"partita: stopped by {sig.name}; every rank on this node was stopped"], err[-3000:]
    assert all(gone(w) for w in workers.values())
def test_a_killed_launcher_takes_its_workers_and_the_other_node_names_it(dp2_plan, tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    outs = [tmp_path / "node0", tmp_path / "node1"]
    launchers = []
    for node, out in enumerate(outs):
        out.mkdir()
        launchers.append(start("--nnodes", 2, "--node-rank", node, "--rdzv-endpoint", endpoint, dp2_plan,
                               WORKERS / "hygiene_script.py", out, "slow"))
    (rank_1, pid_1), = pids(outs[1], 1).items()
    pids(outs[0], 1)
    launchers[1].kill()
    t0 = time.monotonic()
    assert gone(pid_1), "the killed launcher's worker trains on, an orphan"
    _, err = launchers[0].communicate(timeout=120)
    waited = time.monotonic() - t0
    launchers[1].communicate()
    assert launchers[0].returncode == 4, err[-3000:]
    assert said(err) == [f"partita: node 1 (host {os.uname().nodename}, rank {rank_1}) was lost (its launcher "
                         "stopped or its host went down); the ranks on this node were stopped"], err[-3000:]
    # a guard, not a timing (a few seconds here alone): the surviving node noticed, it did not hang
    assert waited < 120, f"the surviving node took {waited:.0f} s to notice the lost one: it hangs"
def test_the_watchdog_ends_a_rank_waiting_in_a_checkpoint_save(dp2_plan, tmp_path):
    p = start("--watchdog", 3, dp2_plan, WORKERS / "hygiene_script.py", tmp_path, "hang-save")
    _, err = p.communicate(timeout=120)
    assert p.returncode == 3, err[-3000:]
    assert "partita: the run hung: no progress for 3 s" in err
    assert f"rank 0 (pipeline stage 0): waiting in the checkpoint save of {tmp_path / 'ckpt'}, step" in err, err
    assert "rank 1 (pipeline stage 0): not in a step" in err
    assert "Traceback" not in err, err[-3000:]
