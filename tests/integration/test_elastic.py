"""`partita run --nnodes 1:2`: what starts processes (gloo
ranks, launchers, the console script, a browser); tests/unit/test_elastic.py has the one-process checks."""

from __future__ import annotations

import json
import shutil
import subprocess
import time

import torch

from partita.compiler.compile import compile_model
from partita.core.cluster import load_cluster
from partita.core.model.inputs import parse_input_spec
from partita.core.options import Options
from partita.core.plans.verify import load_plan
from partita.runtime.engine import ParallelModel
from tests.harness import ENV, PARTITA, WORKERS
from tests.unit.test_elastic import batch
from tests.workers import tied_script as script


def test_a_lost_node_is_replanned_around_and_the_run_goes_on_as_a_fresh_resume(tmp_path):
    """Two launchers on this host, as the guide's one command starts them (no endpoint, no node rank:
    they meet at a local rendezvous the checkpoint directory names); node 1's launcher is SIGKILLed
    after step 3. The survivor says so in one line, with no traceback, re-plans for its own processes
    and resumes exactly."""
    plan = compile_model(script.build("tied-gpt"),
                         Options(inputs=[parse_input_spec(f"idx=int64[4,{script.SEQ}]")],
                                 cluster=load_cluster("local", devices=1, nodes=2), world_size=2, dp=2)).plan
    path = plan.save(tmp_path / "plan.json")
    ckpt = tmp_path / "ckpt"
    outs = [tmp_path / "node0", tmp_path / "node1"]
    launchers = []
    for node in (0, 1):  # node 0's launcher first: it hosts the rendezvous (the one that must outlive the loss)
        outs[node].mkdir()
        launchers.append(subprocess.Popen(
            [PARTITA, "run", "--nnodes", "1:2", "--rejoin-wait", "3", "--max-restarts", "1",
             "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2",
             str(path), str(WORKERS / "restart_script.py"), str(outs[node]), "3", "launcher"],
            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        if node == 0:
            time.sleep(2)
    survivor = launchers[0]
    out, err = survivor.communicate(timeout=300)
    launchers[1].communicate(timeout=30)
    assert survivor.returncode == 0, err[-4000:]
    assert "on this host: its nodes meet at localhost:" in err, err[-4000:]
    assert "partita: node 1 (host" in err and "was lost" in err, err[-4000:]
    assert "Traceback" not in err and "frame #" not in err, err[-4000:]
    assert "partita: re-planned for 1 process(es)" in err, err[-4000:]
    assert f"resumed from {ckpt / 'step-00000002'} (step 2)" in out, out[-3000:]

    lines = [json.loads(x) for x in (outs[0] / "losses.jsonl").read_text().splitlines()]
    after = {x["step"]: x["loss"] for x in lines if x["attempt"] == 1}
    assert sorted(after) == [3, 4, 5, 6] and {x["world"] for x in lines if x["attempt"] == 1} == {1}
    final = torch.load(outs[0] / "final.pt", weights_only=True)

    # a fresh one-process resume from that checkpoint into the plan the survivor made, on one
    # thread as the ranks run (another thread count sums in another order)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        want, got = fresh_resume(load_plan(outs[0] / "plan-w1.json"), ckpt / "step-00000002", tmp_path / "fresh")
    finally:
        torch.set_num_threads(threads)
    assert after == want
    assert set(got) == set(final)
    for k, v in got.items():
        assert torch.equal(final[k], v), k


def fresh_resume(replanned, checkpoint, fresh_dir):
    """The losses after each step from the checkpoint to step 6, and the final parameters."""
    shutil.copytree(checkpoint, fresh_dir)
    model = ParallelModel(script.build("tied-gpt"), replanned, Options(optimizer=script.optimizer, log_every=0))
    model.load_checkpoint(fresh_dir)
    want = {}
    while model.step < 6:
        seq = batch(model.step, replanned.training.global_batch)
        loss = model.train_step(seq[:, :-1], targets=seq[:, 1:])
        want[model.step] = loss
    return want, model.full_state_dict()


def test_an_elastic_run_needs_checkpoints_and_restarts(tmp_path):
    from tests.harness import partita_cli

    plan = tmp_path / "plan.json"
    compile_model(script.build("tied-gpt"), Options(inputs=[parse_input_spec(f"idx=int64[4,{script.SEQ}]")],
                                                    cluster=load_cluster("local", devices=2), world_size=2,
                                                    dp=2)).plan.save(plan)
    r = partita_cli("run", "--nnodes", "1:2", "--node-rank", "0", "--rdzv-endpoint", "localhost:1", plan,
                    WORKERS / "restart_script.py", check=False)
    assert r.returncode == 2 and "--nnodes 1:2 runs elastically" in r.stderr, r.stderr
    r = partita_cli("run", "--nnodes", "3:2", plan, WORKERS / "restart_script.py", check=False)
    assert r.returncode == 2 and "'3:2': MIN is more than MAX" in r.stderr, r.stderr
