"""Bad input, the general guards (issue 29): each mistake ends in one ``error:`` line and a hint,
exit 2, no traceback, within 60 s, and leaves everything the user had as it was.

- an output path that is an input of the command (``core/files.py`` ``writes``);
- a FIFO, a device or a huge file where a file is read (``read_user_file``);
- environment variables and numbers in other scripts than ASCII (``environment_option``, ``Number``);
- options a forward-only plan would drop (``Options._check_forward_only``);
- the cluster file's figures out of range (``ClusterSpec``'s bounds);
- plans edited and re-sealed with no nodes, no parameters, a float batch or an MFU above 1;
- names with markup or escape sequences on their way to the terminal.

The CLI runs in this process (``main``, as the console script does).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from partita.core.errors import PartitaError
from partita.core.plans.plan import SEAL, seal_digest
from tests.unit.test_bad_inputs import BASE, MLP, X, assert_one_message, toml

LIMIT_S = 60


@contextlib.contextmanager
def within(seconds: float = LIMIT_S) -> Iterator[None]:
    """The block must end within ``seconds``: a hang (an open() of a FIFO) fails the test instead of
    stopping the suite."""
    def alarm(*_: Any) -> None:
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    start = time.perf_counter()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert time.perf_counter() - start < seconds


def snapshot(folder: Path) -> dict[str, Any]:
    """Every entry under ``folder``: a regular file's bytes and mtime, anything else's kind and mtime."""
    out = {}
    for path in sorted(folder.rglob("*")):
        st = os.lstat(path)
        out[str(path)] = (path.read_bytes() if path.is_file() and not path.is_symlink() else None,
                          st.st_mode, st.st_mtime_ns)
    return out


def refused(cli: Callable, *args: Any, expected: str, keep: Path) -> str:
    """``cli(*args)`` ends as one user error naming ``expected``, in time, with ``keep`` untouched."""
    before = snapshot(keep)
    with within():
        code, out, err = cli(*args)
    message = assert_one_message(code, out, err, expected)
    assert snapshot(keep) == before
    return message


def api_refused(call: Callable[[], Any], expected: str) -> PartitaError:
    """``call()`` raises one ``PartitaError`` naming ``expected``, with a hint, in time."""
    with within(), pytest.raises(PartitaError) as e:
        call()
    assert expected in e.value.message and "\n" not in e.value.message, e.value.message
    assert e.value.hint and len(e.value.hint) > 3
    return e.value


MODEL_SOURCE = '''
import torch
from torch import nn


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(64, 10)

    def forward(self, x):
        return self.l(x)


def loss(out, y):
    return (out - y).pow(2).mean()
'''


@pytest.fixture
def user(tmp_path, tp2_plan_path) -> Path:
    """A user's folder: a model file with a loss in it, a cluster file, two plans, a trace, a script,
    FIFOs and links to /dev/zero."""
    (tmp_path / "model.py").write_text(MODEL_SOURCE)
    (tmp_path / "cluster.toml").write_text(toml())
    (tmp_path / "plan.json").write_bytes(tp2_plan_path.read_bytes())
    (tmp_path / "base.json").write_bytes(tp2_plan_path.read_bytes())
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": []}))
    (tmp_path / "script.py").write_text("print('hello')\n")
    os.mkfifo(tmp_path / "fifo.json")
    os.mkfifo(tmp_path / "fifo.py")
    os.mkfifo(tmp_path / "fifo.toml")
    (tmp_path / "zero.json").symlink_to("/dev/zero")
    (tmp_path / "zero.toml").symlink_to("/dev/zero")
    return tmp_path


# -- an output that is an input ---------------------------------------------------------------------

OUTPUT_OVER_INPUT = {
    "compile -o the model file": ["compile", "{u}/model.py:M", "--input", X, "-o", "{u}/model.py"],
    "compile -o the loss's file": ["compile", MLP, "--input", X, "--loss", "{u}/model.py:loss",
                                   "--target", "y=float32[8,10]", "-o", "{u}/model.py"],
    "compile -o the cluster file": ["compile", MLP, "--input", X, "--cluster", "{u}/cluster.toml",
                                    "-o", "{u}/cluster.toml"],
    "compile -o a link to the model file": ["compile", "{u}/model.py:M", "--input", X, "-o", "{u}/link.py"],
    "compile -o a hard link of the model file": ["compile", "{u}/model.py:M", "--input", X, "-o", "{u}/hard.py"],
    "compile -o the model file by another path": ["compile", "{u}/model.py:M", "--input", X,
                                                  "-o", "{u}/./sub/../model.py"],
    "view -o the plan": ["view", "{u}/plan.json", "-o", "{u}/plan.json"],
    "view -o the plan it is compared against": ["view", "{u}/plan.json", "--against", "{u}/base.json",
                                                "-o", "{u}/base.json"],
    "view -o the trace": ["view", "{u}/plan.json", "--trace", "{u}/trace.json", "-o", "{u}/trace.json"],
    "run --trace the plan": ["run", "--trace", "{u}/plan.json", "{u}/plan.json", "{u}/script.py"],
    "run --trace the script": ["run", "--trace", "{u}/script.py", "{u}/plan.json", "{u}/script.py"],
    "run --checkpoint-dir the plan": ["run", "--checkpoint-dir", "{u}/plan.json", "{u}/plan.json",
                                      "{u}/script.py"],
}


@pytest.mark.parametrize("name", list(OUTPUT_OVER_INPUT))
def test_an_output_that_is_an_input_is_refused_before_any_work(cli, user, name):
    (user / "link.py").symlink_to(user / "model.py")
    os.link(user / "model.py", user / "hard.py")
    (user / "sub").mkdir()
    args = [a.replace("{u}", str(user)) for a in OUTPUT_OVER_INPUT[name]]
    refused(cli, *args, expected="an input this reads", keep=user)


def test_verify_writes_its_plan_back_when_told_to(cli, user):
    """`partita verify PLAN -o PLAN` is what `partita verify PLAN` does: not an output over an input."""
    code, out, err = cli("verify", user / "plan.json", "-o", user / "plan.json")
    assert code == 0 and "every check passed" in out, err


@pytest.mark.parametrize("keyword", ["trace", "checkpoint_dir"])
def test_the_decorators_outputs_are_not_its_plan(user, keyword):
    import partita

    before = snapshot(user)
    api_refused(lambda: partita.parallelize(inputs={"x": "float32[8,64]"}, plan=str(user / "plan.json"),
                                            **{keyword: str(user / "plan.json")}), "an input this reads")
    assert snapshot(user) == before


# -- what is read: regular files only, capped ------------------------------------------------------

NOT_A_FILE = {
    "show a FIFO": (["show", "{u}/fifo.json"], "it is a FIFO (named pipe), not a regular file"),
    "show a link to /dev/zero": (["show", "{u}/zero.json"], "it is a character device, not a regular file"),
    "view a FIFO": (["view", "{u}/fifo.json", "-o", "{u}/p.html"], "it is a FIFO"),
    "view against /dev/zero": (["view", "{u}/plan.json", "--against", "{u}/zero.json", "-o", "{u}/p.html"],
                               "it is a character device"),
    "view a FIFO as the trace": (["view", "{u}/plan.json", "--trace", "{u}/fifo.json", "-o", "{u}/p.html"],
                                 "cannot read trace file"),
    "diff against a FIFO": (["diff", "{u}/plan.json", "{u}/fifo.json"], "it is a FIFO"),
    "verify a FIFO": (["verify", "{u}/fifo.json"], "it is a FIFO"),
    "run a FIFO": (["run", "{u}/fifo.json", "{u}/script.py"], "it is a FIFO"),
    "a FIFO as the cluster": (["estimate", "--params", "1B", "--cluster", "{u}/fifo.toml"],
                              "cannot read cluster file"),
    "/dev/zero as the cluster": (["estimate", "--params", "1B", "--cluster", "{u}/zero.toml"],
                                 "it is a character device"),
    "a FIFO as the cluster of compile": (["compile", MLP, "--input", X, "--cluster", "{u}/fifo.toml",
                                          "-o", "{u}/p.json"], "it is a FIFO"),
    "a FIFO as the model file": (["compile", "{u}/fifo.py:M", "--input", X, "-o", "{u}/p.json"],
                                 "cannot read model file"),
    "a FIFO as the loss's file": (["compile", MLP, "--input", X, "--loss", "{u}/fifo.py:loss", "-o", "{u}/p.json"],
                                  "it is a FIFO"),
    "a folder as the model file": (["compile", "{u}:M", "--input", X, "-o", "{u}/p.json"], "it is a folder"),
    "a cluster file of 2 MB": (["estimate", "--params", "1B", "--cluster", "{u}/big.toml"],
                               "larger than 1,048,576 bytes"),
}


@pytest.mark.parametrize("name", list(NOT_A_FILE))
def test_only_a_regular_file_is_read_and_no_more_than_its_cap(cli, user, name):
    (user / "big.toml").write_text(toml() + "#" * (2 << 20) + "\n")
    args, expected = NOT_A_FILE[name]
    refused(cli, *[a.replace("{u}", str(user)) for a in args], expected=expected, keep=user)


def test_the_decorator_reads_no_fifo_as_its_plan(user):
    import torch

    import partita

    make = partita.parallelize(lambda: torch.nn.Linear(64, 10), inputs={"x": "float32[8,64]"},
                               plan=str(user / "fifo.json"))
    api_refused(make, "it is a FIFO (named pipe), not a regular file")


# -- environment variables and numbers: one validation, ASCII digits --------------------------------

ENVIRONMENT = {
    "PARTITA_SEED as text": ("PARTITA_SEED", "abc", "PARTITA_SEED='abc' is not a whole number"),
    "PARTITA_SEED in full-width digits": ("PARTITA_SEED", "４２", "is not a whole number"),
    "a negative PARTITA_SEED": ("PARTITA_SEED", "-1", "seed=-1 must be a whole number >= 0"),
    "PARTITA_NONFINITE no policy": ("PARTITA_NONFINITE", "ignore", "nonfinite='ignore' is not one of stop, skip"),
    "a negative PARTITA_CHECK_REPLICAS_EVERY": ("PARTITA_CHECK_REPLICAS_EVERY", "-3", "must be a whole number >= 0"),
    "PARTITA_LOG_EVERY in full-width digits": ("PARTITA_LOG_EVERY", "１０", "is not a whole number"),
    "PARTITA_CHECKPOINT_EVERY of 0": ("PARTITA_CHECKPOINT_EVERY", "0", "checkpoint_every=0"),
    "PARTITA_COMPILE neither on nor off": ("PARTITA_COMPILE", "maybe", "is not 1 or 0"),
    "PARTITA_TRACE into a missing folder": ("PARTITA_TRACE", "{u}/no/such/t.json", "does not exist"),
    "PARTITA_PLAN a FIFO": ("PARTITA_PLAN", "{u}/fifo.json", "it is a FIFO"),
}


@pytest.mark.parametrize("name", list(ENVIRONMENT))
def test_an_environment_variable_is_checked_as_its_keyword_is(user, monkeypatch, name):
    import torch

    import partita

    var, value, expected = ENVIRONMENT[name]
    monkeypatch.setenv(var, value.replace("{u}", str(user)))
    before = snapshot(user)
    error = api_refused(lambda: partita.parallelize(torch.nn.Linear(64, 10), inputs={"x": "float32[8,64]"},
                                                    loss="mse", targets="float32[8,10]"), expected)
    assert var in error.message + error.hint or var == "PARTITA_PLAN"  # the plan is read where plan= is
    assert snapshot(user) == before


@pytest.mark.parametrize("value, expected", [("abc", "PARTITA_WATCHDOG_S='abc' is not a number"),
                                             ("nan", "watchdog_s=nan"), ("-5", "watchdog_s=-5.0"),
                                             ("３００", "is not a number")])
def test_the_watchdogs_variable_is_read_as_its_keyword(monkeypatch, value, expected):
    """The watchdog reads PARTITA_WATCHDOG_S itself, when the process group starts (runtime/processes/watchdog.py)."""
    from partita.runtime.processes.watchdog import timeout_from_env

    monkeypatch.setenv("PARTITA_WATCHDOG_S", value)
    api_refused(timeout_from_env, expected)


COMPILE = ["compile", MLP, "--input", X]


@pytest.mark.parametrize("args, expected", [
    (COMPILE + ["--dp", "２"], "'２' is not a valid integer"),
    (COMPILE + ["--batch", "８"], "'８' is not a valid integer"),
    (COMPILE + ["--max-grad-norm", "１.０"], "'１.０' is not a valid float"),
    (COMPILE + ["--microbatches", "２"], "'２' is not a valid integer"),
    (["run", "--node-rank", "３", "{u}/plan.json", "{u}/script.py"], "'３' is not a valid integer"),
    (["run", "--seed", "-1", "{u}/plan.json", "{u}/script.py"], "--seed -1 must be a whole number >= 0"),
    (["calibrate", "--nproc", "٤", "-o", "{u}/c.toml"], "'٤' is not a valid integer"),
])
def test_a_number_is_written_in_ascii_digits(cli, user, args, expected):
    refused(cli, *[a.replace("{u}", str(user)) for a in args], expected=expected, keep=user)


# -- a forward-only plan drops nothing silently ---------------------------------------------------------

INFERENCE = COMPILE + ["--inference", "-o", "{u}/p.json"]


@pytest.mark.parametrize("args, expected", [
    (INFERENCE + ["--recompute", "full"], "recomputation has no use in a forward-only plan"),
    (INFERENCE + ["--max-grad-norm", "1"], "--max-grad-norm 1.0 has no use in a forward-only plan"),
    (INFERENCE + ["--loss", "mse"], "--loss 'mse' has no use in a forward-only plan"),
    (INFERENCE + ["--target", "y=float32[8,10]"], "--target"),
    (INFERENCE + ["--optimizer", "sgd"], "--optimizer 'sgd' has no use in a forward-only plan"),
    (INFERENCE + ["--generate", "-3"], "--generate -3 must be a whole number of tokens >= 0"),
    (["estimate", "--params", "1B", "--generate", "5"], "--generate needs --inference"),
])
def test_a_training_option_with_inference_is_refused_not_dropped(cli, user, args, expected):
    refused(cli, *[a.replace("{u}", str(user)) for a in args], expected=expected, keep=user)


# -- the cluster file's figures ------------------------------------------------------------------

CLUSTER_BOUNDS = {
    "a memory of one byte": (toml({"memory_gb": "1e-9"}), "memory_bytes=1 is outside the range"),
    "a memory of an exabyte": (toml({"memory_gb": "1e9"}), "memory_bytes=1e+18 is outside the range"),
    "100,000 devices per node": (toml({"gpus_per_node": "100000"}), "partita plans for up to 65,536 devices"),
    "100,000 nodes": (toml({"nodes": "100000"}), "= 400,000 devices"),
    "no device key": ("\n".join(f"{k} = {v}" for k, v in BASE.items() if k != "device") + "\n[tflops]\nfp32 = 1\n",
                      "lacks device"),
    "flops of an unknown dtype": (toml(tflops="fp33 = 5"), "flops for 'fp33'"),
    "flops of a picoflop": (toml(tflops="fp32 = 1e-12"), "flops[fp32]=1 is outside the range"),
    "a bandwidth of a byte a second": (toml({"intra_node_gb_per_s": "1e-9"}), "intra_node_bandwidth=1 is outside"),
    "a latency of 17 minutes": (toml({"inter_node_latency_us": "1e9"}), "inter_node_latency=1000 is outside"),
    "a step overhead of a day": (toml({"step_overhead_ms": "1e8"}), "step_overhead_s=100000 is outside"),
    "an escape sequence in the name": (toml({"name": '"\\u001b[2Jcluster"'}), "holds control characters"),
}


@pytest.mark.parametrize("name", list(CLUSTER_BOUNDS))
def test_a_cluster_figure_out_of_range_is_refused(cli, user, name):
    text, expected = CLUSTER_BOUNDS[name]
    (user / "bad.toml").write_text(text)
    refused(cli, "estimate", "--params", "1B", "--cluster", user / "bad.toml", expected=expected, keep=user)


@pytest.mark.parametrize("args", [["--nodes", "100000"], ["--devices", "2000"]])
def test_a_cluster_scaled_past_the_search_is_refused_at_once(cli, user, args):
    message = refused(cli, *COMPILE, "--cluster", "dgx-a100", *args, "-o", user / "p.json",
                      expected="partita plans for up to 65,536 devices", keep=user)
    assert "dgx-a100" in message


def test_the_decorator_refuses_a_cluster_that_is_no_name_path_or_spec():
    import partita

    api_refused(lambda: partita.parallelize(inputs={"x": "float32[8,64]"}, cluster={"nodes": 2}),
                "cluster={'nodes': 2} is a dict")


# -- re-sealed plans that no compile writes -------------------------------------------------------------

RESEALED = {
    "no node decisions": (lambda d: d.update(nodes=[]), "it lists no node decisions"),
    "no parameters": (lambda d: d.update(params=[]), "a training plan that lists no parameters"),
    "a float batch": (lambda d: d["training"].update(global_batch=16.0), "16.0 is not of type 'integer'"),
    "a float micro-batch count": (lambda d: d["training"].update(grad_accum_steps=1.0),
                                  "1.0 is not of type 'integer'"),
    "an MFU of 1e308": (lambda d: d["predicted"].update(mfu=1e308), "predicted.mfu = 1e+308: above 1"),
}


@pytest.mark.parametrize("name", list(RESEALED))
def test_a_resealed_plan_no_compile_writes_is_refused(cli, user, name):
    edit, expected = RESEALED[name]
    data = json.loads((user / "plan.json").read_text())
    edit(data)
    data[SEAL] = seal_digest(data)
    (user / "edited.json").write_text(json.dumps(data))
    for command in ("show", "verify"):
        refused(cli, command, user / "edited.json", expected=expected, keep=user)


# -- names on their way to the terminal ---------------------------------------------------------------

HOSTILE = "[bold red]x[/] \x1b[2J\x1b]0;t\x07"


def test_a_plans_names_reach_the_terminal_as_text(cli, user):
    """Every free-text field of a plan (model, cluster, modules, collectives' purposes, the reasons
    of alternatives, the solver's words) holds markup and escape sequences: `show` and `diff`
    print them as text, never as styles or terminal commands."""
    data = json.loads((user / "plan.json").read_text())
    data["model"]["name"] = data["cluster"]["source"] = data["solver"]["status"] = HOSTILE
    for part in ("collectives", "alternatives"):
        for item in data[part]:
            item["purpose" if part == "collectives" else "reason"] = HOSTILE
    for node in data["nodes"]:
        node["module"] = HOSTILE
    data[SEAL] = seal_digest(data)
    (user / "hostile.json").write_text(json.dumps(data))
    for args in (["show", user / "hostile.json"], ["diff", user / "plan.json", user / "hostile.json"]):
        code, out, err = cli(*args)
        assert code == 0, err
        assert "\x1b" not in out + err and "\x07" not in out + err
        assert "[bold red]x[/]" in out and "\\x1b[2J" in out


def test_a_cluster_name_with_markup_is_shown_as_written(cli, user):
    (user / "marked.toml").write_text(toml({"name": '"[bold red]mine[/]"', "device_name": '"[link=x]cpu[/]"'}))
    code, out, err = cli("estimate", "--params", "1B", "--cluster", user / "marked.toml")
    assert code == 0, err
    assert "[bold red]mine[/]" in out.replace("\n", "") and "[link=x]cpu[/]" in out.replace("\n", "")
