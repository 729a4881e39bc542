"""Faults under `partita run` (issue 44): two runs on one checkpoint directory, a rank that raises, a
rank whose script ends before the others are done. Each ends in one message; nothing of another
run's is touched. The node lost under `--nnodes 1:2` is tests/integration/test_elastic.py's."""

from __future__ import annotations

import json
import subprocess
import time

from partita.runtime.state.lock import LOCK
from partita.runtime.state.marker import COMPLETE, read_marker, verify
from tests.harness import ENV, PARTITA, WORKERS, deadline

SCRIPT = WORKERS / "fault_script.py"


def start(plan, *args, env=None) -> subprocess.Popen:
    return subprocess.Popen([PARTITA, "run", *map(str, args[:-3]), str(plan), str(SCRIPT), *map(str, args[-3:])],
                            env={**ENV, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_second_run_on_a_checkpoint_directory_is_refused_and_the_first_run_is_untouched(dp2_plan, tmp_path):
    ckpt = tmp_path / "ckpt"
    go = tmp_path / "go"  # the first run waits after step 4 until the second has been refused
    first = start(dp2_plan, "--checkpoint-dir", ckpt, "--checkpoint-every", "2", "train", 10, 0.0,
                  env={"FAULT_GO": str(go)})
    with deadline(120, "the first run taking its checkpoint directory"):
        while not (ckpt / "step-00000004" / COMPLETE).is_file():
            assert first.poll() is None, first.communicate()
            time.sleep(0.2)
    held = json.loads((ckpt / LOCK).read_text())
    second = start(dp2_plan, "--checkpoint-dir", ckpt, "--checkpoint-every", "2", "train", 10, 0.0)
    out, err = second.communicate(timeout=120)
    assert second.returncode == 2, err[-3000:]
    assert "Traceback" not in out + err, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error")]
    assert errors == [f"error (every rank): checkpoint directory {ckpt} is in use by another run (host "
                      f"{held['host']}, process {held['pid']}, since " + errors[0].split(", since ")[1]], err
    assert "finished at" not in out
    go.touch()
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-3000:]
    assert out.count("finished at 10") == 2, out[-2000:]
    # the first run's checkpoints are whole (every file matches its digest) and its lock is gone with it
    steps = sorted(p.name for p in ckpt.iterdir())
    assert steps == ["step-00000006", "step-00000008", "step-00000010"], steps
    for name in steps:
        verify(ckpt / name, read_marker(ckpt / name))


def test_a_rank_that_raises_ends_the_run_with_its_traceback_once(dp2_plan, tmp_path):
    with deadline(60, "the launcher ending the run after rank 1 raised"):
        r = start(dp2_plan, "raise", 100, 0.1, env={"FAULT_AT": str(tmp_path / "raised")})
        out, err = r.communicate()
    ended = time.time()
    assert r.returncode == 1, err[-3000:]
    assert err.count("ValueError: rank 1's own bug") == 1, err[-3000:]
    assert err.count("Traceback") == 1, err[-3000:]
    assert err.rstrip().endswith("the run failed: rank 1 exited with code 1; its traceback is above"), err[-3000:]
    assert "finished at" not in out
    # how long rank 0 trained on alone (reported, not asserted: issue 44 asks for under 10 s)
    print(f"launcher ended {ended - float((tmp_path / 'raised').read_text()):.1f} s after rank 1 raised")


def test_a_rank_that_ends_before_building_the_model_stops_the_run_at_once(dp2_plan):
    with deadline(60, "the launcher ending the run after rank 1's script ended early"):  # (the group's timeout: 120 s)
        r = start(dp2_plan, "early", 3, 0.0)
        out, err = r.communicate()
    assert r.returncode == 2, err[-3000:]
    assert "Traceback" not in out + err, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error")]
    assert errors == ["error (rank 1): rank 1's script ended (exit code 0) before it built the model, while rank 0 "
                      "waits for every rank to join the run"], err
    assert "finished at" not in out
