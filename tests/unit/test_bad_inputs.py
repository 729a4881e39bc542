"""Bad input never crashes: more than 100 mistakes a careless or hostile user makes, each ending in one
message that names what is wrong and what to do (exit code 2, no traceback), or, through the Python
API, in one ``PartitaError`` with a hint.

Plan files, CLI arguments, cluster files, model inputs, decorator keywords and runtime batches. The CLI
runs in this process (``main``, the console script's entry), so the matrix takes seconds.
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import pytest
import torch

from partita.compiler.cli import cli as cli_group
from partita.core.errors import PartitaError
from partita.core.plans.plan import SEAL, seal_digest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = f"{ROOT}/tests/workers/launch_script.py"  # a script for `partita run`
MLP = f"{ROOT}/examples/models.py:MLP"
X = "x=float32[8,64]"


def assert_one_message(code: int, out: str, err: str, expected: str) -> str:
    """Exit 2, one ``error:`` line naming ``expected`` and one hint line after it, no traceback."""
    assert code == 2, (code, out, err)
    assert "Traceback" not in out + err, err
    lines = err.splitlines()
    errors = [i for i, line in enumerate(lines) if line.startswith("error:")]
    assert len(errors) == 1, err
    message = lines[errors[0]]
    assert expected in message, (expected, message)
    assert errors[0] + 1 < len(lines) and lines[errors[0] + 1].startswith("  hint: "), err
    assert len(lines[errors[0] + 1]) > len("  hint: ") + 3, err
    return message


# -- plan files -------------------------------------------------------------------------------------


def sealed(data: dict) -> dict:
    """``data`` with a seal that matches: a check other than the seal's must refuse it."""
    data[SEAL] = seal_digest(data)
    return data


def _edge(data: dict, fwd: str) -> dict:
    """The first input edge whose forward collective is ``fwd``."""
    return next(e for n in data["nodes"] for e in n["ins"] if e["fwd"] == fwd)


def _node(data: dict, op_prefix: str) -> dict:
    return next(n for n in data["nodes"] if n["op"].startswith(op_prefix))


def _set(path: str, value: Any) -> Callable[[dict], None]:
    def edit(d: dict) -> None:
        *head, last = path.split(".")
        for k in head:
            d = d[int(k)] if k.isdigit() else d[k]
        d[int(last) if last.isdigit() else last] = value
    return edit


# name -> (edit of the tp2 plan's data, re-sealed after the edit?, expected words)
PLAN_EDITS: dict[str, tuple[Callable[[dict], Any], bool, str]] = {
    "forward all-reduce edited to none": (lambda d: _edge(d, "all_reduce").update(fwd="none"), True,
                                          "needs 'all_reduce'"),
    "forward all-gather edited to slice": (lambda d: _edge(d, "all_gather").update(fwd="slice"), True,
                                           "needs 'all_gather'"),
    "backward collective dropped": (lambda d: next(e for n in d["nodes"] for e in n["ins"]
                                                   if e["bwd"] == "all_reduce").update(bwd="none"), True,
                                    "backward collective 'none'"),
    "have disagrees with the producer": (lambda d: _edge(d, "all_reduce").update(have="replicate", fwd="none"),
                                         True, "puts out partial"),
    "grad_need off the convention": (lambda d: _edge(d, "all_reduce").update(grad_need="partial"), True,
                                     "gradient must arrive"),
    "unknown strategy name": (lambda d: _node(d, "aten.add").update(strategy="diagonal"), True,
                              "'diagonal' is not a tensor-parallel strategy"),
    "strategy on an op without a rule": (lambda d: _node(d, "aten.arange").update(strategy="col"), True,
                                         "has no tensor-parallel rule"),
    "edge from a node that does not exist": (lambda d: _edge(d, "all_reduce").update(src="ghost"), True,
                                             "ghost is not an earlier node"),
    "node on a stage beyond pp": (lambda d: d["nodes"][5].update(stage=3), True, "on stage 3, but pp=1"),
    "stage ranks off the mesh": (_set("stages.0.ranks", [0, 5]), True, "lists ranks [0, 5]"),
    "stage index beyond pp": (_set("stages.0.index", 2), True, "stages are numbered [2]"),
    "param layout that does not divide": (lambda d: d["params"][0]["layout"].update(tp="shard(7)"), True,
                                          "does not divide"),
    "zero with one replica": (_set("training.zero_stage", 2), True, "training.zero_stage = 2 with mesh.dp = 1"),
    "schedule without stages": (_set("training.schedule", "1f1b"), True,
                                "schedules pipeline stages, but mesh.pp = 1 has none"),
    "inference with an optimizer": (_set("training.inference", True), True, "inference=True"),
    "mesh larger than the cluster": (lambda d: (d["mesh"].update(tp=4), d.update(world_size=4)), True,
                                     "needs 4 devices"),
    "world size that is not the mesh's": (_set("world_size", 8), True, "world_size 8"),
    "batch that the mesh does not make": (_set("training.micro_batch_size", 3), True, "does not equal"),
    "cluster reserve out of range": (_set("cluster.memory_reserve", 1.5), True, "memory_reserve"),
    "negative cluster latency": (_set("cluster.intra_node_latency", -1e-6), True, "intra_node_latency"),
    "NaN step time": (_set("predicted.step_time_s", math.nan), True, "step_time_s = nan"),
    "infinite compute time": (_set("predicted.compute_s", math.inf), True, "compute_s = inf"),
    "negative stage time": (_set("stages.0.forward_s", -1.0), True, "forward_s"),
    "precision no runtime has": (_set("training.precision", "fp64"), True, "fp64"),
    "unknown field": (_set("comment", "hi"), True, "comment"),
    "version as text": (_set("version", "1"), True, "plan format version '1'"),
    "a consistent hand edit, not re-sealed": (_set("predicted.step_time_s", 1.0), False, "sha256 does not match"),
    "no seal": (lambda d: d.pop(SEAL), False, "has no seal"),
    "Rich markup in a strategy": (lambda d: _node(d, "aten.add").update(strategy="[/]"), True, "'[/]'"),
    "terminal control sequence in a strategy": (lambda d: _node(d, "aten.add").update(strategy="\x1b[2J"), True,
                                                "\\x1b[2J"),
    "markup in a node name": (lambda d: _edge(d, "all_reduce").update(src="[bold red]x[/]", fwd="none"), True,
                              "[bold red]x[/] is not an earlier node"),
}

RAW_PLANS: dict[str, tuple[bytes, str]] = {
    "not UTF-8": (b'{"version": 1, "model": "\xff\xfe"}', "is not UTF-8"),
    "nested 100,000 deep": (b"[" * 100_000 + b"]" * 100_000, "nests too deeply"),
    "empty file": (b"", "JSON error at line 1"),
    "truncated": (b'{"version": 1, "model": {"na', "JSON error"),
    "a JSON array": (b"[1, 2]", "expected a JSON object, got list"),
    "a JSON string": (b'"plan"', "expected a JSON object, got str"),
    "1e400 overflows to inf": (b'{"version": 1e400}', "plan format version inf"),
    "NaN literal": (b'{"version": NaN}', "plan format version nan"),
}


@pytest.fixture(scope="module")
def plan_files(tp2_plan_path, tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("bad_plans")
    good = json.loads(tp2_plan_path.read_text())
    files = {"good": tp2_plan_path}
    for i, (name, (edit, reseal, _)) in enumerate(PLAN_EDITS.items()):
        data = json.loads(json.dumps(good))
        edit(data)
        files[name] = folder / f"edit{i}.json"
        files[name].write_text(json.dumps(sealed(data) if reseal else data))
    for i, (name, (raw, _)) in enumerate(RAW_PLANS.items()):
        files[name] = folder / f"raw{i}.json"
        files[name].write_bytes(raw)
    return files


@pytest.mark.parametrize("name", list(PLAN_EDITS))
def test_an_edited_plan_is_refused_by_show(cli, plan_files, name):
    code, out, err = cli("show", plan_files[name])
    assert_one_message(code, out, err, PLAN_EDITS[name][2])


@pytest.mark.parametrize("name", list(RAW_PLANS))
def test_a_broken_plan_file_is_refused_by_show(cli, plan_files, name):
    code, out, err = cli("show", plan_files[name])
    assert_one_message(code, out, err, RAW_PLANS[name][1])


@pytest.mark.parametrize("command, name, expected", [
    ("view", "NaN step time", "step_time_s = nan"),
    ("view", "nested 100,000 deep", "nests too deeply"),
    ("view", "not UTF-8", "is not UTF-8"),
    ("diff", "forward all-reduce edited to none", "needs 'all_reduce'"),
    ("verify", "forward all-reduce edited to none", "needs 'all_reduce'"),
    ("verify", "Rich markup in a strategy", "'[/]'"),
    ("run", "a consistent hand edit, not re-sealed", "partita verify"),
    ("run", "forward all-reduce edited to none", "needs 'all_reduce'"),
])
def test_other_plan_readers_refuse_it_too(cli, plan_files, command, name, expected):
    before = plan_files[name].read_bytes()
    args = {"view": ["view", plan_files[name], "-o", plan_files["good"].with_suffix(".html")],
            "diff": ["diff", plan_files["good"], plan_files[name]],
            "verify": ["verify", plan_files[name]],
            "run": ["run", plan_files[name], SCRIPT]}[command]
    code, out, err = cli(*args)
    assert_one_message(code, out, err, expected)
    assert plan_files[name].read_bytes() == before  # verify writes only a plan that passes


def test_verify_seals_a_consistent_edit_and_the_plan_loads_again(cli, plan_files, tmp_path):
    edited = tmp_path / "edited.json"
    edited.write_bytes(plan_files["a consistent hand edit, not re-sealed"].read_bytes())
    code, out, err = cli("show", edited)
    message = assert_one_message(code, out, err, "sha256 does not match")
    assert "hint: check the edit, then run `partita verify" in err
    code, out, err = cli("verify", edited)
    assert code == 0 and "every check passed" in out, err
    code, out, err = cli("show", edited)
    assert code == 0, err
    assert message


@pytest.mark.parametrize("args, expected", [
    (["view", "{good}", "-o", "{tmp}/no/such/folder/x.html"], "the folder"),
    (["view", "{good}", "--against", "{nested 100,000 deep}", "-o", "{tmp}/x.html"], "nests too deeply"),
    (["view", "{good}", "--trace", "{not UTF-8}", "-o", "{tmp}/x.html"], "is not a trace file"),
    (["view", "{good}", "-o", "{tmp}"], "it is a folder"),
    (["compile", MLP, "--input", X, "-o", "{tmp}/no/such/folder/p.json"], "the folder"),
    (["verify", "{good}", "-o", "{tmp}/no/such/folder/p.json"], "the folder"),
    (["calibrate", "-o", "{tmp}/no/such/folder/c.toml"], "the folder"),
    (["show", "{tmp}"], "cannot read plan file"),
    (["show", "{tmp}/missing.json"], "cannot read plan file"),
    (["diff", "{good}", "{tmp}/missing.json"], "cannot read plan file"),
])
def test_plan_paths(cli, plan_files, tmp_path, args, expected):
    subs = {"{tmp}": str(tmp_path), **{f"{{{k}}}": str(v) for k, v in plan_files.items()}}
    args = [next((a.replace(k, v) for k, v in subs.items() if k in a), a) for a in args]
    code, out, err = cli(*args)
    assert_one_message(code, out, err, expected)


# -- CLI arguments ----------------------------------------------------------------------------------

COMPILE = ["compile", MLP, "--input", X]


@pytest.mark.parametrize("args, expected", [
    (COMPILE + ["--batch", "0"], "--batch 0 must be a positive integer"),
    (COMPILE + ["--batch", "-8"], "--batch -8 must be a positive integer"),
    # sizes bounded where they are read: 10^20 kept the solver running, 2^63-1 overflowed in C++
    (COMPILE + ["--batch", "99999999999999999999"], "--batch 99999999999999999999 is more than partita plans for"),
    (["compile", MLP, "--input", f"x=float32[{2**63 - 1},64]"], "is more than partita plans for (at most 2^48"),
    (COMPILE + ["--devices", str(10**20)], "--devices 100000000000000000000 is more than partita plans for"),
    (COMPILE + ["--nodes", str(2**49)], f"--nodes {2**49} is more than partita plans for"),
    (COMPILE + ["--dp", "0"], "--dp 0 must be a positive integer"),
    (COMPILE + ["--dp", "8"], "--dp 8 is more than the cluster's 4 devices"),
    (COMPILE + ["--tp", "0"], "--tp 0 must be a positive integer"),
    (COMPILE + ["--pp", "0"], "--pp 0 must be a positive integer"),
    (COMPILE + ["--zero", "5"], "--zero 5 must be 0, 1, 2 or 3"),
    (COMPILE + ["--micro-batch-size", "0"], "--micro-batch-size 0 must be a positive integer"),
    (COMPILE + ["--microbatches", "0"], "--microbatches 0 must be a positive integer"),
    (COMPILE + ["--microbatches", "2", "--grad-accum-steps", "4"], "disagree"),
    (COMPILE + ["--nodes", "0"], "--nodes 0 must be a positive integer"),
    (COMPILE + ["--devices", "0"], "--devices 0 must be a positive integer"),
    (COMPILE + ["--devices", "-2"], "--devices -2 must be a positive integer"),
    (COMPILE + ["--schedule", "gpipe", "--pp", "1"], "--schedule gpipe schedules pipeline stages"),
    (COMPILE + ["--recompute", "full", "--zero", "3"], "--recompute full with --zero 3"),
    (COMPILE + ["--cluster", "dgx-z900"], "unknown cluster 'dgx-z900'"),
    (COMPILE + ["--precision", "fp64"], "'fp64' is not one of"),
    (COMPILE + ["--dp", "two"], "'two' is not a valid integer"),
    (COMPILE + ["--frobnicate"], "No such option '--frobnicate'"),
    (COMPILE + ["--loss", "hinge-ish"], "hinge-ish"),
    (COMPILE + ["--loss", "{tmp}/none.py:fn"], "does not exist"),
    (COMPILE + ["--target", "y=int64[8"], "malformed input 'y=int64[8'"),
    (["compile"], "Missing argument 'TARGET'"),
    (["compile", MLP], "needs example inputs"),
    (["compile", "MLP", "--input", X], "is not FILE.py:NAME"),
    (["compile", "{tmp}/none.py:MLP", "--input", X], "does not exist"),
    (["compile", f"{ROOT}/examples/models.py:Nope", "--input", X], "has no 'Nope'"),
    (["compile", f"{ROOT}/README.md:MLP", "--input", X], "not a Python file"),
    (["compile", MLP, "--input", "x"], "missing '='"),
    (["compile", MLP, "--input", "x=float99[8,64]"], "unknown dtype 'float99'"),
    (["compile", MLP, "--input", "x=float32[8,0]"], "every dim must be a positive integer"),
    (["compile", MLP, "--input", "x=float32[8,-1]"], "malformed input"),
    (["compile", MLP, "--input", "2x=float32[8,64]"], "not an identifier"),
    (["compile", MLP, "--input", "y=float32[8,64]"], "'y' is none of its arguments"),
    (["compile", MLP, "--input", X, "--input", "z=float32[8]"], "takes 1"),
    (["compile", MLP, "--input", "x=int64[8,64]"], "cannot take these inputs (x=int64[8,64])"),
    (["compile", f"{ROOT}/examples/models.py:gpt_tiny", "--input", "idx=float32[16,64]"], "scalar type"),
    (["estimate", "--params", "1e400"], "--params '1e400' is not a finite parameter count"),
    (["estimate", "--params", "0"], "--params '0' must be at least 1"),
    (["estimate", "--params", "-5"], "is not a parameter count"),
    (["estimate", "--params", "nan"], "is not a parameter count"),
    (["estimate", "--params", ""], "is not a parameter count"),
    (["estimate", "--params", "7B", "--dp", "0"], "--dp 0 must be a positive integer"),
    (["estimate", "--params", "7B", "--dp", "-1"], "--dp -1 must be a positive integer"),
    (["estimate", "--params", "7B", "--dp", "8"], "--dp 8 is more than the cluster's 4 devices"),
    (["estimate", "--params", "7B", "--batch", "0"], "--batch 0 must be a positive integer"),
    (["estimate", "--params", "7B", MLP], "not both or neither"),
    (["estimate"], "not both or neither"),
    (["estimate", "--params", "7B", "--nodes", "0"], "--nodes 0 must be a positive integer"),
    (["calibrate", "--nproc", "1"], "at least 2 processes"),
    (["run", "{good}", "{tmp}/none.py"], "script"),
    (["run", "--checkpoint-every", "5", "{good}", SCRIPT], "--checkpoint-every needs"),
    (["run", "--watchdog", "-1", "{good}", SCRIPT], "-1"),
    (["run", "--nnodes", "3", "--standalone", "{good}", SCRIPT], "--nnodes"),
    (["run", "--keep-last", "2", "{good}", SCRIPT], "--keep-last has no use without --checkpoint-dir"),
    (["run", "--rejoin-wait", "5", "{good}", SCRIPT], "--rejoin-wait has no use without --nnodes MIN:MAX"),
    (["run", "--rejoin-wait", "5", "--nnodes", "1", "{good}", SCRIPT], "--rejoin-wait has no use without"),
    (["run", "{tmp}/missing.json", SCRIPT], "cannot read plan file"),
    (["frobnicate"], "No such command 'frobnicate'"),
])
def test_cli_arguments(cli, plan_files, tmp_path, args, expected):
    subs = {"{tmp}": str(tmp_path), "{good}": str(plan_files["good"])}
    args = [next((a.replace(k, v) for k, v in subs.items() if k in a), a) for a in args]
    code, out, err = cli(*args)
    assert_one_message(code, out, err, expected)


@pytest.mark.parametrize("name, value, words", [
    ("log_dir", "{file}", "log_dir {file} is a file, not a folder"),
    ("checkpoint_dir", "{file}/below", "checkpoint_dir {file}/below is below {file}, which is a file"),
    ("checkpoint_dir", "x" * 5000, "checkpoint_dir is too long (5,000 bytes"),
    ("log_dir", "{tmp}/" + "y" * 300, "log_dir is too long"),
    ("log_dir", "a\0b", "holds a NUL character"),
    ("trace", "{tmp}/" + "t" * 300 + ".json", "is too long"),
])
def test_a_run_folder_that_cannot_be_written_is_refused_when_the_model_is_built(tmp_path, name, value, words):
    """Each was a traceback at the first save or log (NotADirectoryError, File name too long, a NUL)."""
    import partita

    subs = {"{file}": str(tmp_path / "afile"), "{tmp}": str(tmp_path)}
    (tmp_path / "afile").write_text("a file")
    for k, v in subs.items():
        value, words = value.replace(k, v), words.replace(k, v)
    with pytest.raises(PartitaError) as e:
        partita.parallelize(inputs={"x": "float32[8,64]"}, **{name: value})
    assert words in e.value.message and "\n" not in e.value.message and e.value.hint, e.value.message
    assert [p.name for p in tmp_path.iterdir()] == ["afile"]  # nothing made


def test_estimate_and_compile_refuse_the_same_dp_in_the_same_words(cli):
    _, _, e1 = cli("estimate", "--params", "7B", "--dp", "8")
    _, _, e2 = cli(*COMPILE, "--dp", "8")
    assert [line for line in e1.splitlines() if line.startswith("error:")] == [
        line for line in e2.splitlines() if line.startswith("error:")]


def test_a_batch_of_10_to_the_14_does_not_hang(cli, tmp_path):
    from tests.harness import deadline

    with deadline(600, "compiling at --batch 10**14"):  # seconds when it works, on a loaded machine too
        code, out, err = cli(*COMPILE, "--batch", str(10**14), "-o", tmp_path / "p.json")
    assert "Traceback" not in err
    assert code in (0, 2), err


# -- cluster files ----------------------------------------------------------------------------------

BASE = {"nodes": "1", "gpus_per_node": "4", "device": '"cpu"', "memory_gb": "4", "intra_node_gb_per_s": "1",
        "inter_node_gb_per_s": "1"}


def toml(keys: dict[str, str] | None = None, tflops: str = "fp32 = 0.02", tables: str = "") -> str:
    """A cluster file: ``BASE`` with ``keys`` changed or added, a [tflops] table and more tables."""
    lines = [f"{k} = {v}" for k, v in {**BASE, **(keys or {})}.items()]
    return "\n".join(lines) + f"\n[tflops]\n{tflops}\n{tables}\n"


# name -> (cluster file text, expected words)
CLUSTERS: dict[str, tuple[str, str]] = {
    "memory as text": (toml({"memory_gb": '"80"'}), "memory_gb = '80' must be a number"),
    "infinite memory": (toml({"memory_gb": "inf"}), "memory_gb = inf must be a finite number"),
    "NaN memory": (toml({"memory_gb": "nan"}), "memory_gb = nan must be a finite number"),
    "negative memory": (toml({"memory_gb": "-80"}), "memory_bytes"),
    "reserve above 1": (toml({"memory_reserve": "1.5"}), "memory_reserve=1.5 must be in [0, 1)"),
    "reserve of 1": (toml({"memory_reserve": "1"}), "memory_reserve=1 must be in [0, 1)"),
    "negative reserve": (toml({"memory_reserve": "-0.1"}), "memory_reserve=-0.1 must be in [0, 1)"),
    "negative latency": (toml({"intra_node_latency_us": "-5"}), "intra_node_latency"),
    "infinite latency": (toml({"inter_node_latency_us": "inf"}), "inter_node_latency_us = inf must be a finite"),
    "negative step overhead": (toml({"step_overhead_ms": "-1"}), "step_overhead_s"),
    "efficiency above 1": (toml({"efficiency": "2"}), "efficiency=2"),
    "zero nodes": (toml({"nodes": "0"}), "nodes=0 must be a positive integer"),
    "fractional gpus": (toml({"gpus_per_node": "1.5"}), "gpus_per_node = 1.5 must be an integer"),
    "gpus as text": (toml({"gpus_per_node": '"8"'}), "gpus_per_node = '8' must be a number"),
    "name as a number": (toml({"name": "5"}), "name = 5 must be text"),
    "nvlink as text": (toml({"nvlink": '"yes"'}), "nvlink = 'yes' must be true or false"),
    "unknown device": (toml({"device": '"tpu"'}), "device 'tpu'"),
    "unknown key": (toml({"colour": '"blue"'}), "unknown key(s) colour"),
    "flops as text": (toml(tflops='fp32 = "fast"'), "[tflops] fp32"),
    "infinite flops": (toml(tflops="fp32 = inf"), "[tflops] fp32"),
    "flops not a table": (toml().replace("[tflops]\nfp32 = 0.02", "tflops = 5"), "needs a [tflops] table"),
    "no tflops table": (toml().replace("[tflops]\nfp32 = 0.02", ""), "needs a [tflops] table"),
    "negative call latency": (toml(tables="[call_latency_us]\nall_reduce = -1"), "[call_latency_us]"),
    "call latency of an unknown collective": (toml(tables="[call_latency_us]\nteleport = 1"), "[call_latency_us]"),
    "not TOML": ("nodes = = 2\n", "is not valid TOML"),
    "lacks keys": ("nodes = 1\n", "lacks gpus_per_node"),
}


@pytest.fixture(scope="module")
def cluster_files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("clusters")
    files = {}
    for i, (name, (text, _)) in enumerate(CLUSTERS.items()):
        files[name] = folder / f"c{i}.toml"
        files[name].write_text(text)
    files["binary"] = folder / "binary.toml"
    files["binary"].write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe")
    files["a folder"] = folder
    return files


EXTRA_CLUSTERS = {"binary": "is not a cluster file: byte", "a folder": "cannot read cluster file"}


@pytest.mark.parametrize("name", [*CLUSTERS, *EXTRA_CLUSTERS])
def test_a_bad_cluster_file(cli, cluster_files, name):
    code, out, err = cli("estimate", "--params", "1B", "--cluster", cluster_files[name])
    expected = CLUSTERS[name][1] if name in CLUSTERS else EXTRA_CLUSTERS[name]
    assert_one_message(code, out, err, expected)


def test_the_good_cluster_file_of_the_matrix_loads(tmp_path):
    from partita.core.cluster import load_cluster

    good = tmp_path / "good.toml"
    good.write_text(toml())
    assert load_cluster(str(good)).world_size == 4


# -- decorator keywords -----------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, expected", [
    (dict(dp=0), "--dp 0 must be a positive integer"),
    (dict(tp="2"), "--tp '2' must be a positive integer"),
    (dict(zero=7), "--zero 7 must be 0, 1, 2 or 3"),
    (dict(schedule="zigzag"), "--schedule 'zigzag' is not one of"),
    (dict(micro_batch_size=-1), "--micro-batch-size -1 must be a positive integer"),
    (dict(microbatches=2, grad_accum_steps=3), "disagree"),
    (dict(recompute="yes"), "recompute='yes' is not one of none, selective, full"),
    (dict(checkpoint_every=0), "checkpoint_every=0"),
    (dict(keep_last=2), "keep_last has no use without checkpoint_dir"),
    (dict(watchdog_s=-1), "watchdog_s=-1"),
    (dict(watchdog_s=float("nan")), "watchdog_s=nan"),
    (dict(inputs={"x": "float32[8,64"}), "malformed input"),
    (dict(inputs={"x": "float99[8,64]"}), "unknown dtype 'float99'"),
    (dict(inputs=["x"]), "missing '='"),
    (dict(cluster="nope"), "unknown cluster 'nope'"),
    (dict(nodes=0), "--nodes 0 must be a positive integer"),
    (dict(devices=0), "--devices 0 must be a positive integer"),
    (dict(batch=0), "--batch 0 must be a positive integer"),
    (dict(batch=2.5), "--batch 2.5 must be a positive integer"),
    (dict(batch=10**20), "--batch 100000000000000000000 is more than partita plans for"),
    (dict(inputs={"x": "float32[100000000000000000000,64]"}), "is more than partita plans for"),
    (dict(micro_batch_size=2**63 - 1), "--micro-batch-size 9223372036854775807 is more than partita plans for"),
    (dict(precision="fp64"), "--precision 'fp64' is not one of"),
    (dict(loss="hinge-ish"), "hinge-ish"),
    (dict(targets="y=int64[8"), "malformed input"),
])
def test_a_bad_decorator_keyword_is_refused_where_it_is_written(kwargs, expected):
    import partita

    with pytest.raises(PartitaError) as e:
        partita.parallelize(**{"inputs": {"x": "float32[8,64]"}, **kwargs})
    assert expected in e.value.message and "\n" not in e.value.message
    assert e.value.hint


@pytest.mark.parametrize("kwargs, expected", [
    (dict(inputs={"y": "float32[8,64]"}), "'y' is none of its arguments"),
    (dict(inputs={"x": "int64[8,64]"}), "cannot take these inputs"),
    (dict(plan="{tmp}/missing.json"), "cannot read plan file"),
    (dict(plan="{tp2}"), "this plan needs 2 processes"),
    (dict(optimizer=lambda ps: torch.optim.Adagrad(ps)), "optimizer Adagrad has no memory model"),
    (dict(), None),
])
def test_a_bad_decorator_setting_is_refused_when_the_model_is_built(kwargs, expected, tmp_path, tp2_plan_path):
    import partita
    from examples.models import MLP as Model

    kwargs = {k: (v.replace("{tmp}", str(tmp_path)).replace("{tp2}", str(tp2_plan_path)) if isinstance(v, str)
                  else v) for k, v in kwargs.items()}
    make = partita.parallelize(Model, **{"inputs": {"x": "float32[8,64]"}, "loss": "mse",
                                         "targets": "float32[8,10]", **kwargs})
    if expected is None:
        assert make().train_step(torch.randn(8, 64), targets=torch.randn(8, 10)) > 0
        return
    with pytest.raises(PartitaError) as e:
        make()
    assert expected in e.value.message and "\n" not in e.value.message
    assert e.value.hint


def test_parallelize_of_something_that_is_no_model():
    import partita

    with pytest.raises(PartitaError) as e:
        partita.parallelize(42, inputs={"x": "float32[8,64]"})
    assert "not int" in e.value.message and e.value.hint


# -- runtime batches --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mlp_model():
    import partita
    from examples.models import MLP as Model

    torch.manual_seed(0)
    return partita.parallelize(Model(), inputs={"x": "float32[8,64]"}, loss="mse", targets="float32[8,10]")


@pytest.mark.parametrize("x, y, expected", [
    (torch.randn(7, 64), torch.randn(7, 10), "batch size 7"),
    (torch.randn(8, 32), torch.randn(8, 10), "shape [8, 32]"),
    (torch.zeros(8, 64, dtype=torch.int64), torch.randn(8, 10), "dtype int64"),
    (torch.randn(8, 64), torch.randn(8, 3), "targets with shape [8, 3]"),
    (torch.randn(8, 64), torch.zeros(8, 10, dtype=torch.int64), "targets with dtype int64"),
    (torch.randn(64), torch.randn(8, 10), "batch size 64"),
    (torch.tensor(1.0), torch.randn(8, 10), "batch size None"),
])
def test_a_bad_batch_is_refused_before_it_runs(mlp_model, x, y, expected):
    with pytest.raises(PartitaError) as e:
        mlp_model.train_step(x, targets=y)
    assert expected in e.value.message and "\n" not in e.value.message
    assert e.value.hint


def test_a_wrong_number_of_inputs_is_refused(mlp_model):
    with pytest.raises(PartitaError) as e:
        mlp_model.train_step(torch.randn(8, 64), torch.randn(8, 64), targets=torch.randn(8, 10))
    assert "2 inputs" in e.value.message and e.value.hint


# -- every hint's --flag exists ---------------------------------------------------------------------


def _cli_flags() -> set[str]:
    flags = set()

    def walk(command: click.Command) -> None:
        for p in command.params:
            flags.update(o for o in [*p.opts, *p.secondary_opts] if o.startswith("--"))
        for sub in getattr(command, "commands", {}).values():
            walk(sub)

    walk(cli_group)
    return flags


TORCHRUN_FLAGS = {"--nproc-per-node", "--help"}  # torchrun's, and click's own --help


def test_every_hint_names_only_flags_that_exist():
    """Each ``hint=`` in partita's source that names a `--flag` names one of partita's CLI options
    (or torchrun's, where it says torchrun)."""
    flags, named = _cli_flags(), {}
    for folder in ("core", "compiler", "passes", "runtime"):
        for path in (ROOT / folder).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.keyword) and node.arg == "hint":
                    text = " ".join(c.value for c in ast.walk(node.value)
                                    if isinstance(c, ast.Constant) and isinstance(c.value, str))
                    for flag in re.findall(r"(?<![\w-])--[a-z][a-z-]*[a-z]", text):
                        named.setdefault(flag, f"{path.name}:{node.value.lineno}")
    assert len(named) > 10
    unknown = {f: where for f, where in named.items() if f not in flags | TORCHRUN_FLAGS}
    assert not unknown, unknown


def test_the_matrix_holds_at_least_100_bad_inputs(request):
    items = [i for i in request.session.items if i.module.__name__.endswith("test_bad_inputs")
             and "hint" not in i.name and "100" not in i.name and "good" not in i.name
             and "source" not in i.name]
    assert len(items) >= 100


def test_every_user_error_in_the_source_says_what_to_do():
    """Each user error partita raises (``PartitaError`` and its kinds) is given a ``hint=``: the
    message names what is wrong, the hint what to do."""
    kinds = {"PartitaError", "PlanError", "ClusterError", "CaptureError", "InfeasibleError", "InputSpecError",
             "ModelLoadError"}
    missing = []
    for folder in ("core", "compiler", "passes", "runtime"):
        for path in sorted((ROOT / folder).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Call) and getattr(node.func, "id", None) in kinds
                        and not any(k.arg == "hint" for k in node.keywords)):
                    missing.append(f"{folder}/{path.name}:{node.lineno}")
    assert not missing, missing
