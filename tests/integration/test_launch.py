"""`partita run`: what starts processes (gloo
ranks, launchers, the console script, a browser); tests/unit/test_launch.py has the one-process checks."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from partita.compiler.compile import compile_model
from partita.core.cluster import load_cluster
from partita.core.model.inputs import parse_input_spec
from partita.core.options import Options
from tests.harness import ENV, PARTITA, WORKERS, free_port, partita_cli
from tests.workers import tied_script as script


@pytest.mark.parametrize("case, words", [
    ("batch", ["with batch size 6, but the plan's global_batch is 4",
               "hint: pass the same global batch of 4 on every rank"]),
    ("other-data", ["rank 1 passed another global batch to train_step than rank 0 at step 0",
                    "seed the data loader alike"]),
])
def test_a_user_error_on_the_ranks_is_one_message_and_exit_2(dp2_plan, case, words):
    r = partita_run(dp2_plan, WORKERS / "launch_script.py", case)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    for w in words:
        assert out.count(w) == 1, (w, out[-3000:])
    assert "Traceback" not in out and "ChildFailedError" not in out, out[-3000:]
    assert "step done" not in out


def partita_run(*args):
    return partita_cli("run", *args, check=False)


def test_a_multi_node_plan_is_not_started_on_one_host_unless_asked(tmp_path):
    plan = compile_model(script.build("tied-gpt"),
                         Options(inputs=[parse_input_spec(f"idx=int64[32,{script.SEQ}]")],
                                 cluster=load_cluster("dgx-a100", nodes=2), world_size=16, precision="fp32")).plan
    path = plan.save(tmp_path / "plan.json")
    r = partita_run(path, WORKERS / "launch_script.py", "fine")
    assert r.returncode == 2
    assert "this plan is for 2 nodes of 8 devices" in r.stderr
    assert "--nnodes 2 --node-rank R --rdzv-endpoint" in r.stderr
    assert "Traceback" not in r.stderr
def test_the_scripts_plan_and_partita_runs_plan_must_agree(dp2_plan, tmp_path):
    other = tmp_path / "other.json"
    other.write_text(Path(dp2_plan).read_text())
    code = ("import partita; from tests.workers import tied_script as s; "  # the root on PYTHONPATH (harness.ENV)
            f"partita.parallelize(s.build('tied-gpt'), plan={str(other)!r})")
    script_path = tmp_path / "s.py"
    script_path.write_text(code)
    r = partita_run(dp2_plan, script_path)
    assert r.returncode == 2 and "but `partita run` was given" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def test_a_plan_the_runtime_cannot_run_is_refused_before_any_process_starts(tmp_path):
    plan = compile_model(script.build("tied-gpt"),
                         Options(inputs=[parse_input_spec(f"idx=int64[4,{script.SEQ}]")],
                                 cluster=load_cluster("local", devices=2), world_size=2, dp=2)).plan
    import dataclasses

    bad = dataclasses.replace(plan, training=dataclasses.replace(plan.training, zero_stage=3, inference=False),
                              mesh=dataclasses.replace(plan.mesh, dp=2))
    bad = dataclasses.replace(bad, stages=tuple(dataclasses.replace(s, recompute="full") for s in bad.stages))
    path = bad.save(tmp_path / "bad.json")
    r = partita_run(path, WORKERS / "launch_script.py", "fine")
    assert r.returncode == 2 and "with training.zero_stage = 3" in r.stderr and r.stderr.count("error") == 1, r.stderr
def test_two_nodes_join_one_rendezvous_and_train_as_one_process(dp2_plan, tmp_path):
    """Two launcher agents on this machine, one rank each, meeting at a c10d rendezvous on
    localhost (as two nodes would): the losses and parameters of one process."""
    import json

    import torch

    endpoint = f"127.0.0.1:{free_port()}"
    outs = [tmp_path / "node0", tmp_path / "node1"]
    procs = []
    for node, out in enumerate(outs):
        out.mkdir()
        procs.append(subprocess.Popen([PARTITA, "run", "--nnodes", "2", "--node-rank", str(node),
                                       "--rdzv-endpoint", endpoint, str(dp2_plan),
                                       str(WORKERS / "restart_script.py"), str(out), "0"], env=ENV,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    got = [json.loads(x) for x in sum(((o / "losses.jsonl").read_text().splitlines()
                                       for o in outs if (o / "losses.jsonl").exists()), [])]
    state = torch.load(next(o / "final.pt" for o in outs if (o / "final.pt").exists()), weights_only=True)
    from tests.harness import plain_training

    def batches():
        for step in range(6):
            g = torch.Generator().manual_seed(1000 + step)
            seq = torch.randint(0, script.VOCAB, (4, script.SEQ + 1), generator=g)
            yield seq[:, :-1], seq[:, 1:]

    model = script.build("tied-gpt")
    want, _ = plain_training(model, script.optimizer(model.parameters()), batches())
    assert [x["loss"] for x in got] == pytest.approx(want, rel=1e-5, abs=1e-6)
    for k, v in model.state_dict().items():
        if k in state:
            torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-5, msg=k)
