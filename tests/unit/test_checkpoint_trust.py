"""Checkpoints that can be trusted, in one process (runtime/state/): a checkpoint of another model
or optimizer is refused naming the first difference, and loads into them only when asked; a
failed load changes nothing and is one CheckpointError naming the file; every file's digest is
checked before anything is unpickled; periodic checkpoints keep the newest ``keep_last`` and a
restart skips a damaged newest one for the newest intact one, in one line."""

from __future__ import annotations

import copy
import json
import os
import pickle
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from examples.models import GPT, GPTConfig
from partita.compiler.compile import compile_model
from partita.core.cluster import load_cluster
from partita.core.errors import PartitaError
from partita.core.model.inputs import parse_input_spec
from partita.core.options import Options
from partita.runtime.engine import ParallelModel
from partita.runtime.state import periodic
from partita.runtime.state.lock import LOCK, DirectoryLock
from partita.runtime.state.marker import COMPLETE, METADATA, CheckpointError, file_digest


def gpt(layers: int) -> GPT:
    torch.manual_seed(layers)
    return GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=layers, n_head=2, n_embd=16))


@pytest.fixture(scope="module")
def plans():
    """One-process plans of a 2-layer and a 3-layer GPT."""
    return {n: compile_model(gpt(n), Options(inputs=[parse_input_spec("idx=int64[4,8]")],
                                             cluster=load_cluster("local", devices=1), world_size=1)).plan
            for n in (2, 3)}


def adamw(params, weight_decay=0.01):
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=weight_decay)


def model(plans, layers=2, optimizer=adamw, **options) -> ParallelModel:
    return ParallelModel(gpt(layers), plans[layers], Options(optimizer=optimizer, log_every=0, **options))


def trained(plans, steps=2, **kw) -> ParallelModel:
    m = model(plans, **kw)
    g = torch.Generator().manual_seed(5)
    for _ in range(steps):
        seq = torch.randint(0, 64, (4, 9), generator=g)
        m.train_step(seq[:, :-1], targets=seq[:, 1:])
    return m


def snapshot(m: ParallelModel) -> dict:
    """Every parameter and every optimizer state tensor, copied."""
    params = {n: p.detach().clone() for n, p in m.module.named_parameters()}
    state = {(i, k): v.clone() for i, p in enumerate(m.optimizer.param_groups[0]["params"])
             for k, v in m.optimizer.state.get(p, {}).items()}
    return {"params": params, "state": state, "groups": copy.deepcopy(
        [{k: v for k, v in g.items() if k != "params"} for g in m.optimizer.param_groups]), "step": m.step}


def same(a: dict, b: dict) -> bool:
    return (a["step"] == b["step"] and a["groups"] == b["groups"] and a["params"].keys() == b["params"].keys()
            and all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
            and a["state"].keys() == b["state"].keys() and all(torch.equal(a["state"][k], b["state"][k])
                                                               for k in a["state"]))


def refused(m: ParallelModel, path, **kw) -> str:
    """The message of the CheckpointError loading ``path`` raises; the model and optimizer unchanged."""
    before = snapshot(m)
    with pytest.raises(CheckpointError) as e:
        m.load_checkpoint(path, **kw)
    assert same(before, snapshot(m)), "a failed load changed the model or the optimizer"
    return e.value.message


def test_a_checkpoint_of_another_model_or_optimizer_is_refused_naming_the_first_difference(plans, tmp_path):
    trained(plans, layers=3).save_checkpoint(tmp_path / "three")
    trained(plans, optimizer=lambda p: torch.optim.SGD(p, lr=0.05)).save_checkpoint(tmp_path / "sgd")
    trained(plans, optimizer=lambda p: adamw(p, weight_decay=0.0)).save_checkpoint(tmp_path / "no-decay")
    mine = trained(plans)
    mine.save_checkpoint(tmp_path / "mine")

    fresh = model(plans)
    assert "the checkpoint holds transformer.h.2.ln_1.weight (float32[16]), which this model lacks" in refused(
        fresh, tmp_path / "three")
    assert "saved with a SGD optimizer, and this model's is AdamW" in refused(fresh, tmp_path / "sgd")
    assert "its AdamW has weight_decay=0.0, this one weight_decay=0.01" in refused(fresh, tmp_path / "no-decay")
    assert "this model's transformer.h.2.ln_1.weight (float32[16]) is not in the checkpoint" in refused(
        model(plans, layers=3), tmp_path / "mine")

    # asked explicitly: the model only, or the state with this run's hyperparameters, or a subset
    fresh.load_checkpoint(tmp_path / "sgd", optimizer="skip")
    assert fresh.optimizer.param_groups[0]["lr"] == 3e-3 and not fresh.optimizer.state
    fresh.load_checkpoint(tmp_path / "no-decay", optimizer="state")
    assert fresh.optimizer.param_groups[0]["weight_decay"] == 0.01 and fresh.optimizer.state
    bigger = model(plans, layers=3)
    bigger.load_checkpoint(tmp_path / "mine", partial=True)
    got = dict(bigger.module.named_parameters())
    for name, p in mine.module.named_parameters():
        assert torch.equal(got[name], p), name
    assert torch.equal(got["transformer.h.2.attn.q_proj.weight"],  # the tensor only it has: as built
                       dict(gpt(3).named_parameters())["transformer.h.2.attn.q_proj.weight"])

    # the same model and optimizer: everything as saved, the lr included
    again = model(plans)
    again.load_checkpoint(tmp_path / "mine")
    assert same(snapshot(again), snapshot(mine))


def test_a_damaged_file_is_one_error_naming_it_and_changes_nothing(plans, tmp_path):
    trained(plans).save_checkpoint(tmp_path / "c")
    shard = next(p for p in (tmp_path / "c").iterdir() if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:-100])  # cut short
    m = trained(plans, steps=1)
    assert f"{shard.name} does not match the digest its completion marker recorded" in refused(m, tmp_path / "c")

    # digests made to match the cut file: DCP's own failure (a BaseException) is the same one message
    marker = json.loads((tmp_path / "c" / COMPLETE).read_text())
    marker["files"][shard.name] = file_digest(shard)
    (tmp_path / "c" / COMPLETE).write_text(json.dumps(marker))
    fresh = model(plans)  # no optimizer state yet: a failed load gives it none
    assert f"cannot read checkpoint {tmp_path / 'c'}" in refused(fresh, tmp_path / "c")

    assert "has no partita-complete.json" in refused(m, tmp_path)
    assert "does not exist" in refused(m, tmp_path / "nowhere")


class _Payload:
    def __reduce__(self):
        return (Path.touch, (Path(self.target),))


def test_metadata_that_would_run_code_is_never_unpickled(plans, tmp_path):
    trained(plans).save_checkpoint(tmp_path / "c")
    payload = _Payload()
    payload.target = str(tmp_path / "ran")
    meta = tmp_path / "c" / METADATA
    meta.write_bytes(pickle.dumps(payload))
    m = model(plans)
    assert f"{METADATA} does not match the digest" in refused(m, tmp_path / "c")  # refused before unpickling
    marker = json.loads((tmp_path / "c" / COMPLETE).read_text())
    marker["files"][METADATA] = file_digest(meta)  # a marker forged to match
    (tmp_path / "c" / COMPLETE).write_text(json.dumps(marker))
    message = refused(m, tmp_path / "c")
    assert message == (f"refusing {meta}: it names pathlib.Path.touch, which a checkpoint's metadata never "
                       "holds"), message
    assert not (tmp_path / "ran").exists()


def test_periodic_checkpoints_keep_the_newest_and_a_restart_skips_a_damaged_one(plans, tmp_path, capsys):
    root = tmp_path / "ckpt"
    m = trained(plans, steps=5, checkpoint_dir=str(root), checkpoint_every=1, keep_last=2)
    m.wait_for_checkpoint()
    # the two newest saves, and the run's hold on the directory while it lives (runtime/state/lock.py)
    assert [p.name for p in sorted(root.iterdir())] == [LOCK, "step-00000004", "step-00000005"]
    shard = next(p for p in (root / "step-00000005").iterdir() if p.suffix == ".distcp")
    shard.write_bytes(b"\0" + shard.read_bytes()[1:])  # a flipped byte, the size unchanged
    capsys.readouterr()
    resumed = model(plans, checkpoint_dir=str(root))
    out = capsys.readouterr().out.splitlines()
    assert resumed.step == 4 and resumed.resumed_from == root / "step-00000004"
    assert out[0] == (f"partita: checkpoint {root / 'step-00000005'} is damaged: {shard.name} does not match the "
                      "digest its completion marker recorded (it was changed or cut short after it was written): "
                      "skipped it"), out
    assert out[1] == f"partita: resumed from {root / 'step-00000004'} (step 4)"
    # an interrupted save older than the newest complete one goes; a newer one may still be written
    (root / "step-00000001").mkdir()
    (root / "step-00000009").mkdir()
    assert periodic.prune(root, 2) == [root / "step-00000001"]


def test_a_newest_checkpoint_whose_marker_was_removed_is_named_when_skipped(plans, tmp_path, capsys):
    """It was passed over without a word: the resume named nothing and went back a step."""
    from partita.runtime.state.marker import COMPLETE

    root = tmp_path / "ckpt"
    m = trained(plans, steps=3, checkpoint_dir=str(root), checkpoint_every=1, keep_last=2)
    m.wait_for_checkpoint()
    (root / "step-00000003" / COMPLETE).unlink()
    capsys.readouterr()
    resumed = model(plans, checkpoint_dir=str(root))
    out = capsys.readouterr().out.splitlines()
    assert resumed.step == 2 and resumed.resumed_from == root / "step-00000002"
    assert out[0] == (f"partita: checkpoint {root / 'step-00000003'} has no completion marker ({COMPLETE}): its save "
                      "did not finish, or the marker was removed: skipped it"), out
    assert out[1] == f"partita: resumed from {root / 'step-00000002'} (step 2)"


def test_pruning_deletes_only_what_partita_wrote(tmp_path, capsys):
    """keep_last prunes partita's saves, never a user's files: a ``step-N`` folder of the user's own
    (no marker, no save started there) keeps everything; a file the user put in an old checkpoint
    stays (partita's files around it go); each kept folder is named once."""
    from partita.runtime.state.marker import COMPLETE, STARTED

    root = tmp_path / "ckpt"

    def save(step: int, *, complete: bool = True) -> Path:
        path = periodic.step_dir(root, step)
        path.mkdir(parents=True)
        (path / STARTED).touch()
        (path / "__0_0.distcp").write_bytes(b"data")
        (path / "__1_0.distcp").write_bytes(b"data")
        if complete:
            (path / ".metadata").write_bytes(b"meta")
            (path / COMPLETE).write_text(json.dumps({"files": {"__0_0.distcp": "x", "__1_0.distcp": "y",
                                                                ".metadata": "z"}}))
        return path

    users = periodic.step_dir(root, 1)
    users.mkdir(parents=True)
    (users / "notes.txt").write_text("mine")
    (users / "__0_0.distcp").write_bytes(b"looks like a shard, but no save of partita's started here")
    interrupted = save(2, complete=False)
    annotated = save(3)
    (annotated / "NOTES.md").write_text("why this step matters")
    plain = save(4)
    save(5)
    capsys.readouterr()
    assert periodic.prune(root, 1) == [interrupted, plain]
    assert sorted(p.name for p in users.iterdir()) == ["__0_0.distcp", "notes.txt"]
    assert [p.name for p in annotated.iterdir()] == ["NOTES.md"]  # partita's files gone, the user's kept
    assert not interrupted.exists() and not plain.exists()
    assert periodic.latest(root) == periodic.step_dir(root, 5)
    err = capsys.readouterr().err.splitlines()
    assert err == [f"partita: kept {users} while pruning old checkpoints: it holds what partita did not write "
                   "(__0_0.distcp, notes.txt)",
                   f"partita: kept {annotated} while pruning old checkpoints: it holds what partita did not "
                   "write (NOTES.md)"], err


def test_a_load_is_watched(plans, tmp_path, monkeypatch):
    """The watchdog watches a load as a step (runtime/processes/watchdog.py): busy, the wait named."""
    import torch.distributed.checkpoint as dcp

    from partita.runtime.processes.watchdog import FLIGHT

    trained(plans).save_checkpoint(tmp_path / "c")
    seen = []
    real = dcp.load
    monkeypatch.setattr(dcp, "load", lambda *a, **k: (seen.append((FLIGHT.busy, FLIGHT.recent[-1].kind)),
                                                      real(*a, **k))[1])
    model(plans).load_checkpoint(tmp_path / "c")
    assert seen == [(1, f"the checkpoint load of {tmp_path / 'c'}")] and FLIGHT.busy == 0


# -- one run to a checkpoint directory (runtime/state/lock.py) ---------------------------------------


def _other_run(root, **entry) -> dict:
    """A lock in ``root`` as another run would have left it: a live process on this host by default."""
    held = {"run": "another-run", "host": socket.gethostname(), "pid": os.getppid(), "since": time.time(),
            "beat": time.time(), **entry}
    root.mkdir(parents=True, exist_ok=True)
    (root / LOCK).write_text(json.dumps(held))
    return held


def test_a_directory_another_live_run_holds_is_refused_naming_its_host_and_process(plans, tmp_path):
    root = tmp_path / "ckpt"
    trained(plans, steps=2, checkpoint_dir=str(root), checkpoint_every=1).wait_for_checkpoint()
    before = {p.name: p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file() and p.name != LOCK}
    held = _other_run(root)
    with pytest.raises(PartitaError) as e:
        model(plans, checkpoint_dir=str(root))
    assert (f"checkpoint directory {root} is in use by another run (host {held['host']}, process {held['pid']}, "
            "since ") in e.value.message
    assert f"delete {root / LOCK}" in e.value.hint
    # nothing of the directory was touched: the other run's checkpoints and its lock stand
    assert {p.name: p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file() and p.name != LOCK} == before
    assert json.loads((root / LOCK).read_text())["run"] == "another-run"


def test_a_lock_on_another_host_is_live_while_its_heartbeat_is_fresh(plans, tmp_path):
    root = tmp_path / "ckpt"
    _other_run(root, host="elsewhere", pid=1)
    with pytest.raises(PartitaError, match="in use by another run \\(host elsewhere, process 1"):
        model(plans, checkpoint_dir=str(root))
    _other_run(root, host="elsewhere", pid=1, beat=time.time() - 3600)  # its heartbeat stopped an hour ago
    assert model(plans, checkpoint_dir=str(root)).step == 0


def test_a_dead_runs_lock_is_taken_over_with_one_line_and_released_at_the_end(tmp_path, capsys):
    root = tmp_path / "ckpt"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    _other_run(root, pid=int(dead.stdout))  # a process of this host that has ended
    lock = DirectoryLock(root, identity="this-run")
    note = lock.acquire()
    assert note is not None and "took over" in note and f"process {int(dead.stdout)}" in note
    assert json.loads((root / LOCK).read_text())["run"] == "this-run"
    assert DirectoryLock(root, identity="this-run").acquire() is None  # the same run again (a restart) is let in
    lock.release()
    assert not (root / LOCK).exists()
