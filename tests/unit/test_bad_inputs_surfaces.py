"""Bad input, the next round (issue 44): the surfaces added since the first matrix, each mistake
ending in one message, within 60 s, with the user's files as they were.

The surfaces: expert and sequence parallelism, recomputation and offload modes, pipeline schedules
and micro-batch counts, elastic node ranges and rendezvous, the per-rank data loader, metrics
folders, LR schedulers, checkpoint retention, hand-edited plans (every section), cluster files,
output paths, sizes, and the decorator's keywords by type.

- through the CLI (``main``, in this process): exit 2, one ``error:`` line naming what is wrong and
  a ``  hint:`` line, no traceback (``assert_one_message``); `partita run` starts no process (its
  launcher is replaced by one that fails the test);
- through the API: one ``PartitaError`` naming the wrong thing, with a hint, nothing printed as an
  error;
- the user's folder (the tests' working directory, where every output path of a case points) holds
  the same files, sizes and times after the case as before it; ``deadline`` guards each against a
  hang.
"""

from __future__ import annotations

import collections
import copy
import functools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from partita.core.errors import PartitaError
from partita.core.plans.plan import SCHEMA_VERSION, SEAL, seal_digest
from tests.harness import deadline
from tests.unit.test_bad_inputs import MLP, ROOT, X, assert_one_message, toml

LIMIT_S = 60  # a guard against a hang, not a timing: each case takes well under a second
GOLDEN = ROOT / "tests" / "data" / "golden"
FILE = "{u}/afile"  # a regular file in the user's folder, where a folder is expected
LONG = "x" * 5000


def listing(folder: Path) -> dict[str, tuple[int, int, int]]:
    """Every entry under ``folder``: its mode, size and modification time."""
    out = {}
    for path in sorted(folder.rglob("*")):
        st = os.lstat(path)
        out[str(path.relative_to(folder))] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


def _in(folder: Path, value: Any) -> Any:
    return value.replace("{u}", str(folder)) if isinstance(value, str) else value


def refused(cli: Callable, folder: Path, args: list[Any], expected: str) -> str:
    """``partita *args`` ends as one user error naming ``expected``, in time, ``folder`` unchanged."""
    args, expected = [_in(folder, a) for a in args], _in(folder, expected)
    before = listing(folder)
    with deadline(LIMIT_S, f"partita {' '.join(map(str, args))[:100]}"):
        code, out, err = cli(*args)
    message = assert_one_message(code, out, err, expected)
    assert listing(folder) == before, "the case wrote or removed files"
    return message


def api_refused(call: Callable[[], Any], expected: str, folder: Path, capsys: Any) -> PartitaError:
    """``call()`` raises one ``PartitaError`` naming ``expected``, with a hint, in time; nothing is
    printed as an error and ``folder`` is unchanged."""
    expected = _in(folder, expected)
    before = listing(folder)
    with deadline(LIMIT_S, f"the API call for {expected[:60]!r}"), pytest.raises(PartitaError) as e:
        call()
    error = e.value
    assert expected in error.message and "\n" not in error.message, error.message
    assert error.hint and len(error.hint) > 3, error
    chained = [c for c in (error.__cause__, None if error.__suppress_context__ else error.__context__)
               if isinstance(c, PartitaError)]
    assert not chained, f"two errors: {chained[0].message!r} and {error.message!r}"
    printed = capsys.readouterr()
    assert "Traceback" not in printed.err and "error:" not in printed.err, printed.err
    assert listing(folder) == before, "the case wrote or removed files"
    return error


@pytest.fixture(scope="module")
def user(tmp_path_factory) -> Path:
    """The user's folder: a file, a script, a plan `partita run` takes (the golden MLP on 2
    processes, sealed) and a cluster file without host figures."""
    folder = tmp_path_factory.mktemp("user")
    (folder / "afile").write_text("a file, not a folder\n")
    (folder / "train.py").write_text("print('never run')\n")
    (folder / "mlp.json").write_text(json.dumps(sealed(golden("mlp-local2"))))
    (folder / "nohost.toml").write_text(toml())
    return folder


@pytest.fixture
def here(user, monkeypatch) -> Path:
    """The user's folder as the working directory: a relative or empty output path lands in it."""
    monkeypatch.chdir(user)
    return user


@pytest.fixture
def no_launch(monkeypatch):
    """`partita run` fails the test instead of starting processes (a case must be refused first)."""
    def launch(*args: Any, **kwargs: Any) -> int:
        raise AssertionError("partita run launched the ranks: the bad input was accepted")

    monkeypatch.setattr("partita.runtime.processes.launch.launch", launch)


# -- the axes' flags: ep, sequence parallelism, recomputation, offload, schedules, micro-batches ------

COMPILE = ["compile", MLP, "--input", X, "-o", "{u}/plan.json"]

AXIS_FLAGS: dict[str, tuple[list[str], str]] = {
    "ep of 0": (["--ep", "0"], "--ep 0 must be a positive integer"),
    "negative ep": (["--ep", "-2"], "--ep -2 must be a positive integer"),
    "ep as a word": (["--ep", "two"], "'two' is not a valid integer"),
    "ep of 10^20": (["--ep", str(10**20)], "--ep 100000000000000000000 is more than partita plans for"),
    "ep on a dense MLP": (["--ep", "2"], "--ep 2: the model has no mixture-of-experts layer"),
    "ep that does not divide dp": (["--ep", "3", "--dp", "4"], "--ep 3 does not divide --dp 4"),
    "ep beside sequence parallelism": (["--ep", "2", "--sequence-parallel"], "--ep 2 with --sequence-parallel"),
    "sequence parallelism at tp 1": (["--sequence-parallel", "--tp", "1"], "--sequence-parallel with --tp 1"),
    "sequence parallelism without a residual stream": (["--sequence-parallel", "--tp", "2"],
                                                        "--sequence-parallel: the model has no residual stream"),
    "recompute half": (["--recompute", "half"], "'half' is not one of 'none', 'selective', 'full'"),
    "recompute in capitals": (["--recompute", "SELECTIVE"], "'SELECTIVE' is not one of"),
    "selective recomputation without attention": (["--recompute", "selective"],
                                                  "--recompute selective: the model has no attention core"),
    "full recomputation without repeated layers": (["--recompute", "full"],
                                                   "--recompute full: the model has no repeated layer"),
    "offload to disk": (["--offload", "disk"], "'disk' is not one of 'none', 'optimizer'"),
    "offload in a forward-only plan": (["--offload", "optimizer", "--inference"],
                                       "offload has no use in a forward-only plan"),
    "offload on a cluster without host figures": (["--offload", "optimizer", "--cluster", "{u}/nohost.toml"],
                                                  "--offload optimizer: the cluster gives no host bandwidth"),
    "schedule none with stages": (["--schedule", "none", "--pp", "2"], "'none' is not one of"),
    "schedule in capitals": (["--schedule", "1F1B"], "'1F1B' is not one of"),
    "interleaved with fewer parameter places than chunks": (["--schedule", "interleaved-1f1b", "--pp", "2"],
                                                            "cuts 2 pipeline ranks x 2 chunks = 4 model parts"),
    # each was "no (dp, tp) mesh ... no tensor-parallel degree divides both the devices per node and the world",
    # or "no plan matches the pins": the search's words, not the pin's
    "micro-batches that do not divide the batch": (["--microbatches", "3"],
                                                   "--grad-accum-steps 3 does not divide the global batch of 8"),
    "a micro-batch size that does not divide the batch": (["--micro-batch-size", "3"],
                                                          "--micro-batch-size 3 does not divide the global batch"),
    "a micro-batch larger than the batch": (["--micro-batch-size", "16"], "--micro-batch-size 16 does not divide"),
    "dp x micro-batches beyond the batch": (["--dp", "4", "--microbatches", "4"],
                                            "--dp 4 x --grad-accum-steps 4 = 16 does not divide the global batch"),
    "1f1b with micro-batches that do not divide the batch": (["--schedule", "1f1b", "--pp", "2",
                                                              "--microbatches", "3"], "--grad-accum-steps 3 does not"),
    "interleaved micro-batches not a multiple of pp": (["--schedule", "interleaved-1f1b", "--pp", "2", "--batch", "12",
                                                        "--microbatches", "3"],
                                                       "--schedule interleaved-1f1b runs micro-batches in groups of "
                                                       "--pp 2: --grad-accum-steps 3 is not a multiple"),
    "10^20 micro-batches": (["--microbatches", str(10**20)], "--microbatches 100000000000000000000 is more than"),
    "10^20 tokens to generate": (["--inference", "--generate", str(10**20)],
                                 "--generate 100000000000000000000 is more than partita plans for"),
    "a NaN gradient norm": (["--max-grad-norm", "nan"], "'nan' is not a finite float"),
    "a gradient norm of 1e400": (["--max-grad-norm", "1e400"], "'1e400' is not a finite float"),
}


@pytest.mark.parametrize("name", list(AXIS_FLAGS))
def test_an_axis_flag_partita_cannot_honour(cli, here, name):
    args, expected = AXIS_FLAGS[name]
    refused(cli, here, COMPILE + args, expected)


# -- partita run: elastic node ranges, node ranks, the rendezvous, run options ------------------------

RUN_FLAGS: dict[str, tuple[list[str], str]] = {
    "nnodes 0:2": (["--nnodes", "0:2"], "'0:2' is not a number of nodes (N) or a range of them"),
    "nnodes 2:1": (["--nnodes", "2:1"], "'2:1': MIN is more than MAX"),
    "nnodes a": (["--nnodes", "a"], "'a' is not a number of nodes"),
    "nnodes 1:2:3": (["--nnodes", "1:2:3"], "'1:2:3' is not a number of nodes"),
    "nnodes empty": (["--nnodes", ""], "'' is not a number of nodes"),
    "nnodes :2": (["--nnodes", ":2"], "':2' is not a number of nodes"),
    "nnodes -1": (["--nnodes", "-1"], "'-1' is not a number of nodes"),
    "nnodes in full-width digits": (["--nnodes", "２"], "'２' is not a number of nodes"),
    "nnodes 10^20": (["--nnodes", str(10**20)], "100000000000000000000 nodes do not divide the plan's 2 ranks"),
    "3 nodes for 2 ranks": (["--nnodes", "3"], "3 nodes do not divide the plan's 2 ranks"),
    "node rank -1": (["--node-rank", "-1"], "'-1' is not in the range x>=0"),
    "node rank 2 of 2": (["--nnodes", "2", "--rdzv-endpoint", "head:29500", "--node-rank", "2"],
                         "--node-rank 2 is not below --nnodes 2"),
    "node rank 1 of 1": (["--node-rank", "1"], "--node-rank 1 is not below --nnodes 1"),
    "two nodes, no node rank": (["--nnodes", "2", "--rdzv-endpoint", "head:29500"], "2 nodes: which one is this?"),
    "rejoin wait -1": (["--rejoin-wait", "-1"], "'-1' is not in the range x>=0"),
    # NaN and inf passed `low=0` (nan < 0 is False): the elastic run launched with rejoin_s=nan
    "rejoin wait NaN": (["--nnodes", "1:2", "--rdzv-endpoint", "head:29500", "--node-rank", "0", "--max-restarts",
                         "1", "--checkpoint-dir", "{u}/ck", "--checkpoint-every", "5", "--rejoin-wait", "nan"],
                        "'nan' is not a finite float"),
    "rejoin wait inf": (["--rejoin-wait", "inf"], "'inf' is not a finite float"),
    "elastic without checkpoints": (["--nnodes", "1:2", "--rdzv-endpoint", "head:29500", "--node-rank", "0"],
                                    "--nnodes 1:2 runs elastically"),
    "two nodes without a rendezvous": (["--nnodes", "2", "--node-rank", "0"],
                                       "2 nodes need a rendezvous every node can reach"),
    # each launched the ranks against a rendezvous they could never reach
    "rendezvous port 99999": (["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "head:99999"],
                              "port 99999 is not from 1 to 65535"),
    "rendezvous port 0": (["--rdzv-endpoint", "head:0"], "port 0 is not from 1 to 65535"),
    "rendezvous without a host": (["--rdzv-endpoint", ":29500"], "':29500' is not HOST:PORT"),
    "rendezvous port as a word": (["--rdzv-endpoint", "head:port"], "'head:port' is not HOST:PORT"),
    "max restarts -1": (["--max-restarts", "-1"], "'-1' is not in the range x>=0"),
    # each rank's torch.manual_seed would have overflowed after the launch
    "seed of 10^30": (["--seed", str(10**30)], f"--seed {10**30} is more than a seed holds"),
    "keep last -1": (["--checkpoint-dir", "{u}/ck", "--keep-last", "-1"], "--keep-last -1 must be a whole number"),
    "keep last x": (["--keep-last", "x"], "'x' is not a valid integer"),
    "checkpoint every 0": (["--checkpoint-dir", "{u}/ck", "--checkpoint-every", "0"],
                           "--checkpoint-every 0 must be a whole number of steps >= 1"),
    "watchdog NaN": (["--watchdog", "nan"], "'nan' is not a finite float"),
    "nonfinite ignore": (["--nonfinite", "ignore"], "'ignore' is not one of 'stop', 'skip'"),
    "log dir that is a file": (["--log-dir", FILE], f"--log-dir {FILE} is a file, not a folder"),
    "log dir with a NUL": (["--log-dir", "{u}/a\0b"], "holds a NUL character"),
    "log dir of 5,000 characters": (["--log-dir", LONG], "--log-dir is too long (5,000 bytes"),
    # an empty folder was the working directory: the ranks wrote their logs and checkpoints there
    "log dir empty": (["--log-dir", ""], "--log-dir '' is empty"),
    "checkpoint dir empty": (["--checkpoint-dir", ""], "--checkpoint-dir '' is empty"),
    "trace under a file": (["--trace", FILE + "/t.json"], f"{FILE} is a file, not a folder"),
    "trace of 5,000 characters": (["--trace", LONG], "--trace is too long (5,000 bytes"),
    # an empty project logged nothing, silently (``if wandb_project:``)
    "wandb project empty": (["--wandb-project", ""], "--wandb-project '' must name a project"),
}


@pytest.mark.parametrize("name", list(RUN_FLAGS))
def test_a_run_flag_is_refused_before_any_process_starts(cli, here, no_launch, name):
    flags, expected = RUN_FLAGS[name]
    refused(cli, here, ["run", *flags, "{u}/mlp.json", "{u}/train.py"], expected)


# -- hand-edited plans: every section, re-sealed as `partita verify` would ------------------------


def golden(name: str) -> dict[str, Any]:
    """A golden plan (tests/data/golden) as the plan file `partita compile` wrote, unsealed."""
    data = json.loads((GOLDEN / f"{name}.json").read_text())
    data.pop("golden")
    data.update(version=SCHEMA_VERSION, analysis_seconds={})
    data["solver"]["seconds"] = 0.0
    return data


def sealed(data: dict[str, Any]) -> dict[str, Any]:
    data[SEAL] = seal_digest(data)
    return data


def put(path: str, value: Any) -> Callable[[dict], None]:
    """An edit setting ``path`` (dotted; list indices as numbers) to ``value``."""
    def edit(d: dict) -> None:
        *head, last = path.split(".")
        for k in head:
            d = d[int(k)] if k.isdigit() else d[k]
        d[int(last) if last.isdigit() else last] = value
    return edit


def expert(d: dict) -> dict:
    """The first parameter split over ep."""
    return next(p for p in d["params"] if p["layout"].get("ep", "replicate") != "replicate")


MOE, PP, DP2 = "mixtral-ep2", "gpt-tiny-pp2", "gpt-tiny-local2"

# name -> (golden plan, edit, expected words)
PLAN_EDITS: dict[str, tuple[str, Callable[[dict], Any], str]] = {
    # mesh
    "ep that does not divide dp": (MOE, put("mesh.ep", 3), "ep=3 must divide dp=4"),
    "ep of 0": (MOE, put("mesh.ep", 0), "at mesh/ep: 0 is less than the minimum of 1"),
    "ep as text": (MOE, put("mesh.ep", "2"), "at mesh/ep: '2' is not of type 'integer'"),
    "ep as a float": (MOE, put("mesh.ep", 2.0), "at mesh/ep: 2.0 is not of type 'integer'"),
    "ep of 10^30": (MOE, put("mesh.ep", 10**30), f"ep={10**30} must divide dp=4"),
    "ep raised to 4, its collectives left for 2": (MOE, put("mesh.ep", 4), "but ep=4"),
    "tp of 2^80": (DP2, put("mesh.tp", 2**80), f"x tp={2**80} x pp=1 has"),
    "dp of 0": (DP2, put("mesh.dp", 0), "at mesh/dp: 0 is less than the minimum of 1"),
    "a mesh axis partita has not": (DP2, put("mesh.sp", 2), "at mesh: Additional properties are not allowed"),
    "a mesh without pp": (DP2, lambda d: d["mesh"].pop("pp"), "at mesh: 'pp' is a required property"),
    "a mesh as a list": (DP2, put("mesh", [2, 1, 1]), "at mesh: [2, 1, 1] is not of type 'object'"),
    "pp 3 on 2 devices": (PP, put("mesh.pp", 3), "world_size 2 but mesh dp=1 x tp=1 x pp=3 has 3 devices"),
    # experts
    "an expert weight split along dim 1": (MOE, lambda d: expert(d)["layout"].update(ep="shard(1)"),
                                           "ep layout shard(1) (an expert weight is split by whole experts"),
    "an expert weight partial over ep": (MOE, lambda d: expert(d)["layout"].update(ep="partial"), "ep layout partial"),
    "3 experts over ep 2": (MOE, lambda d: expert(d).update(shape=[3, 128, 32]), "[3, 128, 32]: ep layout shard(0)"),
    "an expert layout no rule writes": (MOE, lambda d: expert(d)["layout"].update(ep="shard(x)"),
                                        "'shard(x)' does not match"),
    "a layout over an axis partita has not": (MOE, lambda d: expert(d)["layout"].update(cp="shard(0)"),
                                              "'cp' is not one of ['dp', 'tp', 'pp', 'ep']"),
    "experts in a forward-only plan": (MOE, lambda d: d["training"].update(inference=True, optimizer="none"),
                                       "mesh.ep = 2 with training.inference = true"),
    # sequence parallelism, recomputation, offload
    "sequence parallelism as text": ("gpt-4l-sp", put("training.sequence_parallel", "yes"),
                                     "'yes' is not of type 'boolean'"),
    "sequence parallelism as 1": ("gpt-4l-sp", put("training.sequence_parallel", 1), "1 is not of type 'boolean'"),
    "sequence parallelism beside experts at tp 1": (MOE, put("training.sequence_parallel", True),
                                                    "training.sequence_parallel = true with mesh.tp = 1"),
    "recompute null": ("gpt-4l-selective", put("stages.0.recompute", None),
                       "None is not one of ['none', 'selective', 'full']"),
    "recompute true": ("gpt-4l-selective", put("stages.0.recompute", True), "True is not one of"),
    "selective recomputation beside ZeRO-3": ("gpt-4l-selective", put("training.zero_stage", 3),
                                              "stages[0].recompute = 'selective' with training.zero_stage = 3"),
    "offload null": ("gpt-tiny-offload", put("training.offload", None), "at training/offload: None is not one of"),
    "offload without host bandwidth": ("gpt-tiny-offload", put("cluster.host_bandwidth", 0.0),
                                       "training.offload = 'optimizer': the cluster gives no host bandwidth"),
    # pipeline
    "schedule null": (PP, put("training.schedule", None), "at training/schedule: None is not one of"),
    "pp 2 with schedule none": (PP, put("training.schedule", "none"), "mesh.pp = 2 needs a pipeline schedule"),
    "0 chunks": (PP, put("training.chunks", 0), "at training/chunks: 0 is less than the minimum of 1"),
    "3 chunks on stages cut for 2": ("gpt-4l-interleaved", put("training.chunks", 3),
                                     "the stages are numbered [0, 1, 2, 3], but pp=2 x 3 chunks needs"),
    "interleaved cut back to 1 chunk": ("gpt-4l-interleaved", put("training.chunks", 1),
                                        "the stages are numbered [0, 1, 2, 3], but pp=2 needs [0, 1]"),
    "interleaved micro-batches not a multiple of pp": (
        "gpt-4l-interleaved", lambda d: d["training"].update(grad_accum_steps=3, global_batch=12),
        "training.schedule = 'interleaved-1f1b' runs micro-batches in groups of mesh.pp = 2: "
        "training.grad_accum_steps = 3 is not a multiple"),
    "micro-batches that do not make the batch": ("gpt-4l-interleaved", put("training.grad_accum_steps", 3),
                                                 "grad_accum_steps=3 = 12 does not equal global_batch=16"),
    # stages
    "no stages": (PP, put("stages", []), "the stages are numbered [], but pp=2 needs [0, 1]"),  # loaded, silently
    "a stage dropped": (PP, lambda d: d["stages"].pop(), "the stages are numbered [0], but pp=2 needs [0, 1]"),
    "a stage listed twice": (PP, lambda d: d["stages"].append(copy.deepcopy(d["stages"][0])),
                             "the stages are numbered [0, 1, 0]"),
    "a stage on rank -1": (PP, put("stages.0.ranks", [-1]), "at stages/0/ranks/0: -1 is less than the minimum"),
    "a stage field partita has not": (PP, put("stages.0.colour", "red"), "('colour' was unexpected)"),
    "a stage's memory NaN": (PP, put("stages.0.memory_bytes", float("nan")), "nan is not of type 'integer'"),
    "a parameter on stage 5": (PP, put("params.0.stage", 5), "is on stage 5, but pp=2 has stages 0-1"),
    "stages as an object": (PP, put("stages", {"0": 1}), "at stages: {'0': 1} is not of type 'array'"),
    # training
    "global batch as text": (DP2, put("training.global_batch", "8"), "'8' is not of type 'integer'"),
    "global batch of 10^30": (DP2, put("training.global_batch", 10**30), f"does not equal global_batch={10**30}"),
    "negative global batch": (DP2, put("training.global_batch", -8), "-8 is less than the minimum of 1"),
    "reduce dtype fp8": (DP2, put("training.reduce_dtype", "fp8"), "'fp8' is not one of ['fp32', 'bf16', 'fp16']"),
    "max grad norm 0": (DP2, put("training.max_grad_norm", 0.0), "0.0 is less than or equal to the minimum of 0"),
    "max grad norm inf": (DP2, put("training.max_grad_norm", float("inf")), "training.max_grad_norm = inf"),
    # loaded, silently: no count compile writes is past 64 bits
    "gradient buckets of 10^30 bytes": (DP2, put("training.grad_bucket_bytes", 10**30),
                                        f"training.grad_bucket_bytes = {10**30} is more than a 64-bit integer holds"),
    "inference as text": (DP2, put("training.inference", "false"), "'false' is not of type 'boolean'"),
    "a training field partita has not": (DP2, put("training.lr", 0.1), "('lr' was unexpected)"),
    "training without its global batch": (DP2, lambda d: d["training"].pop("global_batch"),
                                          "'global_batch' is a required property"),
    # loaded, silently: ZeRO-3 then gathered the whole model as one unit
    "ZeRO-3 units naming no layer": ("gpt-tiny-zero3", put("training.zero_units", ["no.such.module"]),
                                     "training.zero_units names 'no.such.module', no repeated layer"),
    "ZeRO units without ZeRO-3": (DP2, put("training.zero_units", ["transformer.h.0"]),
                                  "training.zero_units = ['transformer.h.0'] with training.zero_stage = 0"),
    # model, cluster, predictions, nodes, collectives
    "no model inputs": (DP2, put("model.inputs", []), "model.inputs is empty"),  # loaded, silently
    "a model input of 2^63-1": (DP2, put("model.inputs", [f"idx=int64[{2**63 - 1},64]"]),
                                "dim 9223372036854775807 is more than partita plans for"),
    "targets with a zero dim": (DP2, put("model.targets", "targets=int64[0,64]"),
                                "every dim must be a positive integer, got [0, 64]"),
    "a cluster field partita has not": (DP2, put("cluster.colour", "blue"), "unknown key(s) colour"),  # dropped
    "a cluster without memory": (DP2, lambda d: d["cluster"].pop("memory_bytes"), "it lacks memory_bytes"),
    "a cluster of TPUs": (DP2, put("cluster.device", "tpu"), "device 'tpu' is not one of cuda, cpu"),
    "a cluster by name": (DP2, put("cluster", "local"), "at cluster: 'local' is not of type 'object'"),
    "negative predicted memory": (DP2, put("predicted.memory.params", -1), "-1 is less than the minimum of 0"),
    "NaN tokens per second": (DP2, put("predicted.tokens_per_s", float("nan")), "predicted.tokens_per_s = nan"),
    "a collective on stage 9": (DP2, put("collectives.0.stage", 9), "on stage 9, but the plan has 1 stages"),
    "a collective of a kind partita has not": (DP2, put("collectives.0.kind", "teleport"), "'teleport' is not one of"),
    "a node listed twice": (DP2, lambda d: d["nodes"].append(copy.deepcopy(d["nodes"][5])), "is listed twice"),
    "a node with no outputs": (DP2, put("nodes.5.out", []), "has 0 output(s)"),
    "world size of 10^30": (DP2, put("world_size", 10**30), f"world_size {10**30} but mesh"),
    "a negative parameter dim": (DP2, put("params.0.shape", [-1, 64]), "-1 is less than the minimum of 0"),
}


@pytest.fixture(scope="module")
def plan_files(user) -> dict[str, Path]:
    folder = user / "edited"
    folder.mkdir()
    plans = {name: golden(name) for name in {plan for plan, _, _ in PLAN_EDITS.values()}}
    files = {}
    for i, (name, (plan, edit, _)) in enumerate(PLAN_EDITS.items()):
        data = copy.deepcopy(plans[plan])
        edit(data)
        files[name] = folder / f"edit{i}.json"
        files[name].write_text(json.dumps(sealed(data)))
    return files


def test_the_unedited_plans_load(cli, here):
    for name in sorted({plan for plan, _, _ in PLAN_EDITS.values()}):
        path = here / f"{name}.json"
        path.write_text(json.dumps(sealed(golden(name))))
        code, out, err = cli("show", path)
        path.unlink()
        assert code == 0, (name, err)


@pytest.mark.parametrize("name", list(PLAN_EDITS))
def test_a_hand_edited_plan_is_refused(cli, here, plan_files, name):
    refused(cli, here, ["show", plan_files[name]], PLAN_EDITS[name][2])


# -- cluster files --------------------------------------------------------------------------------

BASE = {"nodes": "1", "gpus_per_node": "4", "device": '"cpu"', "memory_gb": "4", "intra_node_gb_per_s": "1",
        "inter_node_gb_per_s": "1"}


def without(*keys: str) -> str:
    """The matrix's good cluster file with ``keys`` left out."""
    return "\n".join(f"{k} = {v}" for k, v in BASE.items() if k not in keys) + "\n[tflops]\nfp32 = 0.02\n"


# name -> (cluster file text, expected words)
CLUSTER_FILES: dict[str, tuple[str, str]] = {
    "no memory": (without("memory_gb"), "lacks memory_gb"),
    "no bandwidths": (without("intra_node_gb_per_s", "inter_node_gb_per_s"),
                      "lacks intra_node_gb_per_s, inter_node_gb_per_s"),
    "no nodes": (without("nodes"), "lacks nodes"),
    "an empty file": ("", "lacks nodes, gpus_per_node, device, memory_gb"),
    "negative intra-node bandwidth": (toml({"intra_node_gb_per_s": "-1"}), "intra_node_bandwidth=-1000000000.0 must"),
    "negative inter-node bandwidth": (toml({"inter_node_gb_per_s": "-25"}), "inter_node_bandwidth=-25000000000.0"),
    "zero inter-node bandwidth": (toml({"inter_node_gb_per_s": "0"}), "inter_node_bandwidth=0.0 must be a positive"),
    "negative memory bandwidth": (toml({"hbm_gb_per_s": "-1"}), "hbm_bandwidth=-1000000000.0 must be a positive"),
    "negative host bandwidth": (toml({"host_gb_per_s": "-1"}), "host_bandwidth=-1000000000.0 must be a finite"),
    "negative host memory bandwidth": (toml({"host_memory_gb_per_s": "-5"}), "host_memory_bandwidth=-5000000000.0"),
    "zero memory": (toml({"memory_gb": "0"}), "memory_bytes=0 must be a positive number"),
    "memory of 1e20 GB": (toml({"memory_gb": "1e20"}), "memory_bytes=1e+29 is outside the range"),
    "memory as true": (toml({"memory_gb": "true"}), "memory_gb = True must be a number"),
    "memory as a date": (toml({"memory_gb": "1979-05-27"}), "memory_gb = datetime.date(1979, 5, 27) must be"),
    "nodes as text": (toml({"nodes": '"2"'}), "nodes = '2' must be a number"),
    "nodes as a list": (toml({"nodes": "[1]"}), "nodes = [1] must be a number"),
    "negative nodes": (toml({"nodes": "-2"}), "nodes=-2 must be a positive integer"),
    "1e20 nodes": (toml({"nodes": "1e20"}), "nodes = 1e+20 must be an integer"),
    "2^63-1 nodes": (toml({"nodes": str(2**63 - 1)}), "9,223,372,036,854,775,807 node(s) x 4 devices"),
    "no devices per node": (toml({"gpus_per_node": "0"}), "gpus_per_node=0 must be a positive integer"),
    "device as a number": (toml({"device": "5"}), "device = 5 must be text"),
    "a device name with a newline": (toml({"device_name": '"cpu\\nx"'}), "holds control characters"),
    "name as a table": (toml({"name": "{a = 1}"}), "name = {'a': 1} must be text"),
    "source as a number": (toml({"source": "5"}), "source = 5 must be text"),
    "nvlink as 1": (toml({"nvlink": "1"}), "nvlink = 1 must be true or false"),
    "roofline as yes": (toml({"roofline": '"yes"'}), "roofline = 'yes' must be true or false"),
    "efficiency as text": (toml({"efficiency": '"high"'}), "efficiency = 'high' must be a number"),
    "reserve as text": (toml({"memory_reserve": '"0.1"'}), "memory_reserve = '0.1' must be a number"),
    "flops as true": (toml(tflops="fp32 = true"), "[tflops] fp32 = True must be a positive finite number"),
    "zero bf16 flops": (toml(tflops="fp32 = 0.02\nbf16 = 0"), "[tflops] bf16 = 0 must be a positive"),
    "flops as a list": (toml().replace("[tflops]\nfp32 = 0.02", "tflops = [1, 2]"), "needs a [tflops] table"),
    "an empty flops table": (toml(tflops=""), "needs a [tflops] table"),
    "call latencies as a number": (toml({"call_latency_us": "5"}), "[call_latency_us] takes microseconds >= 0"),
    "a source as a number": (toml(tables="[sources]\nall = 5"), "[sources] takes text per figure"),
    "a table partita has not": (toml(tables="[extra]\na = 1"), "unknown key(s) extra"),
    "negative kernel time": (toml({"kernel_us": "-1"}), "kernel_s=-1e-06 must be a finite number >= 0"),
    "a launch of 17 minutes": (toml({"launch_us": "1e9"}), "launch_s=1000 is outside the range"),
    "fragmentation 0.95": (toml({"fragmentation": "0.95"}), "fragmentation=0.95 is outside the range"),
    "allocation granularity 0": (toml({"alloc_granularity": "0"}), "alloc_granularity=0 is outside the range"),
    "allocation granularity 1.5": (toml({"alloc_granularity": "1.5"}), "alloc_granularity = 1.5 must be an integer"),
    "memory efficiency 0": (toml({"memory_efficiency": "0"}), "memory_efficiency=0 is outside the range"),
    "attention efficiency 2": (toml({"attention_efficiency": "2"}), "attention_efficiency=2 is outside the range"),
}


@pytest.mark.parametrize("name", list(CLUSTER_FILES))
def test_a_bad_cluster_file_is_one_message(cli, here, name):
    text, expected = CLUSTER_FILES[name]
    path = here / "cluster.toml"
    path.write_text(text)
    try:
        refused(cli, here, ["estimate", "--params", "1B", "--cluster", path], expected)
    finally:
        path.unlink()


@pytest.mark.parametrize("cluster, expected", [
    ("DGX-A100", "unknown cluster 'DGX-A100'"),
    ("dgx-a100.toml", "cannot read cluster file dgx-a100.toml"),
    (FILE + "/c.toml", "Not a directory"),
    ("{u}", "it is a folder, not a regular file"),
])
def test_an_unknown_preset_or_a_cluster_path_that_is_no_file(cli, here, cluster, expected):
    refused(cli, here, ["estimate", "--params", "1B", "--cluster", cluster], expected)


# -- paths and sizes -------------------------------------------------------------------------------

PLAN = "{u}/mlp.json"
PATHS: dict[str, tuple[list[str], str]] = {
    "compile -o under a file": (COMPILE[:-1] + [FILE + "/p.json"], f"{FILE} is a file, not a folder"),
    "compile -o of 5,000 characters": (COMPILE[:-1] + [LONG], "the output path is too long (5,000 bytes"),
    "compile -o with a NUL": (COMPILE[:-1] + ["{u}/p\0.json"], "holds a NUL character"),
    "compile -o a folder": (COMPILE[:-1] + ["{u}"], "it is a folder"),
    "compile -o empty": (COMPILE[:-1] + [""], "the output path '' is empty"),
    # refused after the whole compile, when the plan was saved
    "compile -o into a folder no one writes": (COMPILE[:-1] + ["/proc/self/p.json"],
                                               "the folder /proc/self is not writable"),
    # wrote the page next to the plan, as if no -o had been given
    "view -o empty": (["view", PLAN, "-o", ""], "the output path '' is empty"),
    "view -o under a file": (["view", PLAN, "-o", FILE + "/v.html"], f"{FILE} is a file, not a folder"),
    "verify -o a folder": (["verify", PLAN, "-o", "{u}"], "it is a folder"),
    "verify -o under a file": (["verify", PLAN, "-o", FILE + "/p.json"], f"{FILE} is a file, not a folder"),
    "calibrate -o with a NUL": (["calibrate", "-o", "c\0.toml"], "holds a NUL character"),
    "calibrate -o under a file": (["calibrate", "-o", FILE + "/c.toml"], f"{FILE} is a file, not a folder"),
    "demo -o under a file": (["demo", "-o", FILE + "/d.json"], f"{FILE} is a file, not a folder"),
    "show a plan under a file": (["show", FILE + "/p.json"], "cannot read plan file"),
    "a model file with a NUL": (["compile", "{u}/m\0.py:M", "--input", X], "embedded null byte"),
    "a loss file with a NUL": (COMPILE + ["--loss", "{u}/l\0.py:fn"], "embedded null byte"),
    "an input name with a NUL": (["compile", MLP, "--input", "x\0=float32[8,64]"], "is not an identifier"),
}


@pytest.mark.parametrize("name", list(PATHS))
def test_a_path_that_cannot_be_used(cli, here, name):
    args, expected = PATHS[name]
    refused(cli, here, args, expected)


SIZES: dict[str, tuple[list[str], str]] = {
    "estimate --batch 10^20": (["estimate", "--params", "1B", "--batch", str(10**20)],
                               "--batch 100000000000000000000 is more than partita plans for"),
    "estimate an input dim of 2^63-1": (["estimate", MLP, "--input", f"x=float32[{2**63 - 1},64]"],
                                        "dim 9223372036854775807 is more than partita plans for"),
    "estimate a zero batch dim": (["estimate", MLP, "--input", "x=float32[0,64]"],
                                  "every dim must be a positive integer, got [0, 64]"),
    "a target with a zero dim": (COMPILE + ["--target", "y=float32[0,10]"], "every dim must be a positive integer"),
    "a target dim of 2^63-1": (COMPILE + ["--target", f"y=float32[8,{2**63 - 1}]"],
                               "dim 9223372036854775807 is more than partita plans for"),
    "an input dim just past 2^48": (["compile", MLP, "--input", f"x=float32[8,{2**48 + 1}]"],
                                    f"dim {2**48 + 1} is more than partita plans for"),
    "an empty shape": (["compile", MLP, "--input", "x=float32[]"], "empty shape"),
    "a trailing comma": (["compile", MLP, "--input", "x=float32[8,64,]"], "dims must be positive integers, got ''"),
    "a dim of 1e3": (["compile", MLP, "--input", "x=float32[1e3,64]"], "got '1e3'"),
    "a dim in hexadecimal": (["compile", MLP, "--input", "x=float32[0x10,64]"], "got '0x10'"),
}


@pytest.mark.parametrize("name", list(SIZES))
def test_a_size_past_what_partita_plans_for(cli, here, name):
    args, expected = SIZES[name]
    refused(cli, here, args, expected)


# -- the decorator's keywords, by type ------------------------------------------------------------

KEYWORDS: dict[str, tuple[dict[str, Any], str]] = {
    "ep as text": (dict(ep="2"), "--ep '2' must be a positive integer"),
    "ep as a float": (dict(ep=2.0), "--ep 2.0 must be a positive integer"),
    "ep as True": (dict(ep=True), "--ep True must be a positive integer"),
    "sequence_parallel as text": (dict(sequence_parallel="yes"), "sequence_parallel='yes' must be True or False"),
    # 1 == True and 0 == False: each passed `in (None, True, False)`
    "sequence_parallel as 1": (dict(sequence_parallel=1), "sequence_parallel=1 must be True or False"),
    "sequence_parallel as 0": (dict(sequence_parallel=0), "sequence_parallel=0 must be True or False"),
    "offload as True": (dict(offload=True), "--offload True is not one of none, optimizer"),
    "schedule as a number": (dict(schedule=1), "--schedule 1 is not one of"),
    "schedule in capitals": (dict(schedule="1F1B"), "--schedule '1F1B' is not one of"),
    "zero as a float": (dict(zero=1.0), "--zero 1.0 must be 0, 1, 2 or 3"),  # 1.0 in (0, 1, 2, 3)
    "zero as text": (dict(zero="1"), "--zero '1' must be 0, 1, 2 or 3"),
    "recompute as 1": (dict(recompute=1), "recompute=1 is not one of none, selective, full"),
    # truthy text was taken for True
    "inference as text": (dict(inference="yes"), "inference='yes' must be True or False"),
    "inference as 1": (dict(inference=1), "inference=1 must be True or False"),
    "compile as text": (dict(compile="yes"), "compile='yes' must be True or False"),
    "async_checkpoints as text": (dict(async_checkpoints="no"), "async_checkpoints='no' must be True or False"),
    "max_grad_norm as True": (dict(max_grad_norm=True), "--max-grad-norm True must be a positive number"),
    "inputs as a number": (dict(inputs=5), "inputs=5 is not a set of example inputs"),  # a TypeError
    "inputs of None": (dict(inputs={"x": None}), "malformed input 'x=None'"),
    # each reached the capture: a TypeError there, or a target the loss never saw
    "targets as a number": (dict(targets=5), "targets=5 is a int, not an input spec"),
    "targets as a dict": (dict(targets={"y": "float32[8,10]"}), "targets={'y': 'float32[8,10]'} is a dict"),
    "output as a float": (dict(output=3.5), "output=3.5 is a float, not a field name or a tuple index"),
    "output as a list": (dict(output=[1]), "output=[1] is a list"),
    "output as True": (dict(output=True), "output=True is a bool"),
    "wandb_project as a number": (dict(wandb_project=5), "wandb_project=5 must name a project"),
    "wandb_project empty": (dict(wandb_project=""), "wandb_project='' must name a project"),
    "seed of 10^30": (dict(seed=10**30), f"seed={10**30} is more than a seed holds"),
    "log_dir empty": (dict(log_dir=""), "log_dir '' is empty"),
    "checkpoint_dir empty": (dict(checkpoint_dir=""), "checkpoint_dir '' is empty"),
    "trace with a NUL": (dict(trace="t\0.json"), "holds a NUL character"),
    "log_dir as a number": (dict(log_dir=5), "log_dir=5 must be a path"),
    "keep_last -1": (dict(checkpoint_dir="{u}/ck", keep_last=-1), "keep_last=-1 must be a whole number >= 0"),
    "keep_last as text": (dict(checkpoint_dir="{u}/ck", keep_last="x"), "keep_last='x' must be a whole number"),
    "keep_last as True": (dict(checkpoint_dir="{u}/ck", keep_last=True), "keep_last=True must be a whole number"),
    "keep_last 1.5": (dict(checkpoint_dir="{u}/ck", keep_last=1.5), "keep_last=1.5 must be a whole number"),
    "keep_last 0 without checkpoint_dir": (dict(keep_last=0), "keep_last has no use without checkpoint_dir"),
    "log_every 1.5": (dict(log_every=1.5), "log_every=1.5 must be a whole number >= 0"),
    "nonfinite as a number": (dict(nonfinite=1), "nonfinite=1 is not one of stop, skip"),
    "cluster None": (dict(cluster=None), "cluster=None is a NoneType"),
    "10^20 tokens to generate": (dict(inference=True, generate=10**20), "--generate 100000000000000000000 is more"),
    "a zero batch dim": (dict(inputs={"x": "float32[0,64]"}), "every dim must be a positive integer"),
    "micro-batches that do not divide the batch": (dict(microbatches=3), "--grad-accum-steps 3 does not divide"),
}
BUILT = {"micro-batches that do not divide the batch"}  # checked against the model's batch when it is built


@pytest.mark.parametrize("name", list(KEYWORDS))
def test_a_keyword_of_the_wrong_type_is_refused(here, capsys, name):
    import partita
    from examples.models import MLP as Model

    kwargs, expected = KEYWORDS[name]
    kwargs = {k: _in(here, v) for k, v in kwargs.items()}
    if name in BUILT:
        api_refused(lambda: partita.parallelize(Model(), inputs={"x": "float32[8,64]"}, **kwargs), expected,
                    here, capsys)
    else:
        api_refused(lambda: partita.parallelize(**{"inputs": {"x": "float32[8,64]"}, **kwargs}), expected,
                    here, capsys)


@pytest.mark.parametrize("options, expected", [
    (5, "options=5 is a int, not partita.Options"),  # dataclasses.replace's TypeError
    ({"dp": 2}, "options={'dp': 2} is a dict, not partita.Options"),
])
def test_options_that_are_no_options(here, capsys, options, expected):
    import partita

    api_refused(lambda: partita.parallelize(options=options), expected, here, capsys)


@pytest.mark.parametrize("var, value, expected", [
    ("PARTITA_LOG_DIR", FILE, f"PARTITA_LOG_DIR='{FILE}': log_dir {FILE} is a file, not a folder"),
    ("PARTITA_KEEP_LAST", "-2", "PARTITA_KEEP_LAST='-2': keep_last=-2 must be a whole number >= 0"),
    ("PARTITA_WANDB_PROJECT", "   ", "PARTITA_WANDB_PROJECT='   ': wandb_project='' must name a project"),
    ("PARTITA_SEED", str(2**64), f"seed={2**64} is more than a seed holds"),
])
def test_a_run_variable_is_checked_as_its_keyword(here, capsys, monkeypatch, var, value, expected):
    import partita
    from examples.models import MLP as Model

    monkeypatch.setenv(var, _in(here, value))
    if var == "PARTITA_KEEP_LAST":
        monkeypatch.setenv("PARTITA_CHECKPOINT_DIR", str(here / "ck"))
    api_refused(lambda: partita.parallelize(Model(), inputs={"x": "float32[8,64]"}, loss="mse",
                                            targets="float32[8,10]"), expected, here, capsys)


# -- the built model: its loader, its LR scheduler, its metrics folder ------------------------------


def build(**options: Any) -> Any:
    """The MLP planned and built in this process, with ``options``."""
    import partita
    from examples.models import MLP as Model

    torch.manual_seed(0)
    return partita.parallelize(Model(), inputs={"x": "float32[8,64]"}, loss="mse", targets="float32[8,10]",
                               log_every=0, **options)


@pytest.fixture(scope="module")
def mlp():
    return build()


def first_step(model: Any, dataset: Any, **kwargs: Any) -> float:
    """The loader's first batch through a step, as a user's loop takes it."""
    x, y = next(iter(model.loader(dataset, **kwargs)))
    return model.train_step(x, targets=y, local=True)


def samples(n: int = 16, x: Callable[[], Any] = lambda: torch.zeros(64),
            y: Callable[[], Any] = lambda: torch.zeros(10)) -> list:
    return [(x(), y()) for _ in range(n)]


class Stream(torch.utils.data.IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(samples(self.n))


# name -> (a call of the built model's loader and step, expected words)
LOADER: dict[str, tuple[Callable[[Any], Any], str]] = {
    # each gave batches the user's loop could not unpack ("too many values to unpack"), or single characters
    "a string": (lambda m: first_step(m, "abcdefghijklmnopq"), "loader() got text (str of 17 characters)"),
    "bytes": (lambda m: first_step(m, b"abcdefghijklmnopq"), "loader() got text (bytes"),
    "samples of text": (lambda m: first_step(m, ["the cat sat"] * 16), "loader(): the samples hold text (str)"),
    "pairs of text": (lambda m: first_step(m, [("the cat", "sat")] * 16), "the samples hold text ((str, str))"),
    "samples of three fields": (lambda m: first_step(m, [(torch.zeros(64), torch.zeros(10), torch.zeros(1))] * 16),
                                "sample 0 is (float32[64], float32[10], float32[1]), 3 fields, but a step takes 2"),
    "samples of one field": (lambda m: first_step(m, [(torch.zeros(64),)] * 16), "(float32[64]), 1 field, but"),
    "a set": (lambda m: first_step(m, set(range(16))), "loader() got a set"),
    "a number": (lambda m: first_step(m, 42), "loader() got a int"),
    "a dict of columns": (lambda m: first_step(m, {"x": torch.zeros(16, 64), "y": torch.zeros(16, 10)}),
                          "loader() got a dict: a dataset is read by position"),
    "an OrderedDict": (lambda m: first_step(m, collections.OrderedDict(enumerate(samples()))),
                       "loader() got a OrderedDict"),
    "a DataLoader": (lambda m: first_step(m, torch.utils.data.DataLoader(samples(), batch_size=8)),
                     "loader() got a DataLoader"),
    "None as the targets' dataset": (lambda m: first_step(m, (torch.zeros(16, 64), None)), "loader() got None"),
    "three datasets for two fields": (lambda m: first_step(m, (torch.zeros(16, 64), torch.zeros(16, 10),
                                                               torch.zeros(16))), "loader() got 3 datasets"),
    "samples of None": (lambda m: first_step(m, [None] * 16), "its samples are NoneType, which torch cannot stack"),
    "integer inputs": (lambda m: first_step(m, samples(x=lambda: torch.zeros(64, dtype=torch.int64))),
                       "train_step got input 0 (x) with dtype int64"),
    "float64 inputs": (lambda m: first_step(m, samples(x=lambda: torch.zeros(64, dtype=torch.float64))),
                       "train_step got input 0 (x) with dtype float64"),
    "inputs of the wrong width": (lambda m: first_step(m, samples(x=lambda: torch.zeros(32))),
                                  "train_step got input 0 (x) with shape [8, 32]"),
    # torch's own refusals, each a traceback from DataLoader or torch.Generator
    "shuffle as text": (lambda m: first_step(m, samples(), shuffle="yes"), "loader(shuffle='yes') must be True"),
    "seed as text": (lambda m: first_step(m, samples(), seed="x"), "loader(seed='x') must be a whole number"),
    "seed of 2^70": (lambda m: first_step(m, samples(), seed=2**70), f"loader(seed={2**70}) must be a whole"),
    "num_workers -1": (lambda m: first_step(m, samples(), num_workers=-1),
                       "torch's DataLoader refuses the options given: num_workers option should be non-negative"),
    "an option DataLoader has not": (lambda m: first_step(m, samples(), frobnicate=1),
                                     "unexpected keyword argument 'frobnicate'"),
    "prefetching without workers": (lambda m: first_step(m, samples(), prefetch_factor=2), "prefetch_factor"),
    "a negative timeout": (lambda m: first_step(m, samples(), timeout=-1), "timeout option should be non-negative"),
    "a collate_fn that is no function": (lambda m: first_step(m, samples(), collate_fn=5),
                                         "loader(collate_fn=5) is not a function"),
    "drop_last": (lambda m: first_step(m, samples(), drop_last=False), "loader() sets drop_last itself"),
    "a sampler": (lambda m: first_step(m, samples(), sampler=range(16)), "loader() sets sampler itself"),
    # an empty or short stream gave no batch, silently (a for loop over it did nothing)
    "an empty stream": (lambda m: first_step(m, Stream(0)), "loader() got an IterableDataset of 0 samples"),
    "a stream shorter than a batch": (lambda m: first_step(m, Stream(5)), "an IterableDataset of 5 samples, fewer"),
    "a stream read by workers": (lambda m: first_step(m, Stream(16), num_workers=2),
                                 "loader() reads an IterableDataset in this process"),
}


@pytest.mark.parametrize("name", list(LOADER))
def test_the_loader_refuses_a_dataset_that_gives_no_step(mlp, here, capsys, name):
    call, expected = LOADER[name]
    api_refused(lambda: call(mlp), expected, here, capsys)


def test_the_loader_of_the_matrix_trains(mlp):
    assert first_step(mlp, samples()) >= 0
    assert first_step(mlp, Stream(16)) >= 0


def _another_optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)


def _boom(opt: Any) -> Any:
    raise ValueError("boom")


LR = torch.optim.lr_scheduler
SCHEDULERS: dict[str, tuple[Any, str]] = {
    "a factory returning a number": (lambda opt: 42, "scheduler= returned int, not a scheduler"),
    # the optimizer has a step() too: it was stepped twice each step, silently
    "a factory returning the optimizer": (lambda opt: opt, "scheduler= returned AdamW, not a scheduler"),
    "a scheduler built already": (LR.StepLR(_another_optimizer(), 1), "is not a factory of the optimizer"),
    # its step(metrics) raised a TypeError at the first step
    "ReduceLROnPlateau": (lambda opt: LR.ReduceLROnPlateau(opt), "ReduceLROnPlateau, whose step() needs metrics"),
    "a factory of two arguments": (lambda opt, n: LR.StepLR(opt, n), "scheduler= failed on the run's optimizer"),
    "a list of schedulers": (lambda opt: [LR.StepLR(opt, 1)], "scheduler= returned list"),
    # a ValueError from the factory was a traceback (only TypeError was caught)
    "a factory that raises": (_boom, "scheduler= failed on the run's optimizer (AdamW): ValueError: boom"),
    "a sequence over another optimizer's scheduler": (
        lambda opt: LR.SequentialLR(opt, [LR.StepLR(_another_optimizer(), 1)], milestones=[]),
        "scheduler= failed on the run's optimizer (AdamW): ValueError"),
    # the first step ran at a NaN learning rate; the message was "the loss is nan"
    "a learning rate of NaN": (lambda opt: LR.LambdaLR(opt, lambda step: float("nan")),
                               "scheduler= set the learning rate to nan"),
    "a negative learning rate": (lambda opt: LR.LambdaLR(opt, lambda step: -1.0),
                                 "scheduler= set the learning rate to -0.001"),
}


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_a_scheduler_that_would_not_schedule_this_run(here, capsys, name):
    factory, expected = SCHEDULERS[name]
    api_refused(lambda: build(scheduler=factory), expected, here, capsys)


def test_a_step_counted_scheduler_of_the_matrix_builds(here):
    model = build(scheduler=functools.partial(LR.StepLR, step_size=1))
    assert model.train_step(torch.zeros(8, 64), targets=torch.zeros(8, 10)) >= 0


@pytest.mark.parametrize("options, expected", [
    # makedirs' FileNotFoundError or PermissionError at SummaryWriter (where access() lets root through)
    (dict(log_dir="/proc/partita-logs/x"), "/proc/partita-logs/x"),
    (dict(log_dir="/proc/self/partita-logs"), "/proc/self is not writable"),
    (dict(log_dir=FILE + "/tb"), f"log_dir {FILE}/tb is below {FILE}, which is a file"),
    # a FileNotFoundError when the trace was written, after the run
    (dict(trace="/proc/self/t.json"), "the folder /proc/self is not writable"),
])
def test_a_metrics_or_trace_folder_that_cannot_be_written(here, capsys, options, expected):
    api_refused(lambda: build(**{k: _in(here, v) for k, v in options.items()}), expected, here, capsys)


def test_keep_last_reaches_the_ranks_through_the_environment():
    """`partita run --checkpoint-dir D --keep-last 2` hands each rank PARTITA_KEEP_LAST=2: it was refused
    on every rank, checked alone ("keep_last has no use without checkpoint_dir")."""
    from partita.core.options import Options

    options = Options().with_environment({"PARTITA_KEEP_LAST": "2", "PARTITA_CHECKPOINT_DIR": "ck"})
    assert (options.keep_last, options.checkpoint_dir) == (2, "ck")


def test_the_matrix_holds_over_110_new_bad_inputs(request):
    cases = [i for i in request.session.items if i.module.__name__.endswith("test_bad_inputs_surfaces")
             and "[" in i.name]
    assert len(cases) >= 110
