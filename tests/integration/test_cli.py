"""The CLI end to end: what starts processes (gloo
ranks, launchers, the console script, a browser); tests/unit/test_cli.py has the one-process checks."""

from __future__ import annotations

import json
import subprocess

import pytest

from partita.core.plans.plan import SCHEMA_VERSION
from partita.core.plans.verify import load_plan
from tests.unit.test_cli import BAD_MODEL, GPT, PARTITA


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("plans") / "gpt.plan.json"
    # The installed console script, as a user runs it.
    r = subprocess.run([PARTITA, "compile", GPT, "--input", "idx=int64[16,64]", "--cluster", "local",
                        "--devices", "4", "-o", str(path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "dp=4 x tp=1 x pp=1" in r.stdout and "plan written to" in r.stdout
    return path


def test_compile_writes_a_valid_plan(plan_path):
    plan = load_plan(plan_path)
    data = json.loads(plan_path.read_text())
    assert data["version"] == SCHEMA_VERSION and data["world_size"] == 4
    assert plan.mesh.dp == 4 and plan.training.global_batch == 16
    assert plan.model.capture_method == "torch.export"
    assert plan.model.num_params == 137_216 or plan.model.num_params > 100_000
    assert plan.collectives and plan.collectives[0].kind == "all_reduce"
    assert any(a.chosen for a in plan.alternatives)
    assert plan.predicted.memory.fits and plan.predicted.step_time_s > 0
    assert {"capture", "analysis", "solve"} <= set(plan.analysis_seconds)


def test_show_prints_the_plan(cli, plan_path):
    code, out, _ = cli("show", plan_path)
    assert code == 0
    for text in ("dp=4 x tp=1 x pp=1", "all_reduce", "alternatives weighed", "transformer.h x2", "lm_head"):
        assert text in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["compile", "{bad}:LayerDrop", "--input", "x=float32[4,8]"], "data-dependent"),
        (["compile", GPT, "--input", "idx=int64[16,64]", "--cluster", "dgx-z900"], "unknown cluster 'dgx-z900'"),
        (["compile", GPT, "--input", "idx=int64[16,64"], "malformed input 'idx=int64[16,64'"),
        (["compile", GPT, "--input", "idx=int64[16,64]", "--dp", "4", "--batch", "10"],
         "--dp 4 does not divide the global batch of 10"),
        (["compile", GPT, "--input", "idx=int64[16,64]", "--tp", "3"], "--tp 3 does not divide"),
        (["compile", GPT, "--input", "idx=int64[12,64]", "--dp", "3"], "--dp 3 does not divide the world size 4"),
        (["compile", "{bad}:Nope", "--input", "x=float32[4,8]"], "has no 'Nope'"),
        (["show", "{corrupt}"], "not a valid plan file"),
        (["show", "{old}"], "plan format version 0"),
        (["show", "{missing}"], "cannot read plan file"),
        (["estimate", "--params", "lots"], "not a parameter count"),
        (["compile", GPT, "--input", "idx=int64[16,64]", "--pp", "1", "--schedule", "gpipe"],
         "--schedule gpipe schedules pipeline stages, but --pp 1 has none"),
        (["compile", GPT, "--input", "idx=int64[16,64]", "--recompute", "full", "--zero", "3"],
         "--recompute full with --zero 3"),
    ],
)
def test_bad_input_gets_one_clear_message_and_exit_2(cli, tmp_path, plan_path, args, message):
    bad = tmp_path / "bad_model.py"
    bad.write_text(BAD_MODEL)
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text(plan_path.read_text()[: 500])
    old = tmp_path / "old.json"
    data = json.loads(plan_path.read_text())
    data["version"] = 0
    old.write_text(json.dumps(data))
    subs = {"{bad}": str(bad), "{corrupt}": str(corrupt), "{old}": str(old), "{missing}": str(tmp_path / "no.json")}
    args = [next((a.replace(k, v) for k, v in subs.items() if k in a), a) for a in args]
    code, out, err = cli(*args)
    assert code == 2, (out, err)
    assert message in " ".join(err.split())
    assert "Traceback" not in err and "Traceback" not in out
    assert [line for line in err.splitlines() if line.startswith("error:")].__len__() == 1


def test_console_script_exit_code_for_a_user_error(tmp_path):
    r = subprocess.run([PARTITA, "show", str(tmp_path / "none.json")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and "cannot read plan file" in r.stderr


# `partita calibrate` measures this machine on gloo processes of its own
def test_calibrate_writes_a_cluster_file_the_planner_reads(cli, tmp_path):
    from partita.core.cluster import load_cluster

    out = tmp_path / "local.toml"
    code, stdout, err = cli("calibrate", "--nproc", "2", "-o", out)
    assert code == 0, err
    assert "GFLOP/s" in stdout and "all-reduce bandwidth" in stdout
    c = load_cluster(str(out))
    assert c.gpus_per_node == 2 and c.device == "cpu"
    assert 1e8 < c.peak_flops("fp32") < 1e13  # a CPU core does 0.1 - 10,000 GFLOP/s
    assert 1e6 < c.intra_node_bandwidth < 1e12 and 0 < c.intra_node_latency < 0.1
    assert "per-kernel cost (host)" in stdout and 1e-7 < c.kernel_s < 1e-3  # a tiny op: 0.1 us - 1 ms here
    code, stdout, err = cli("compile", GPT, "--input", "idx=int64[8,64]", "--cluster", out,
                                "-o", tmp_path / "p.json")
    assert code == 0, err
    assert load_plan(tmp_path / "p.json").cluster["name"] == "local-calibrated"
