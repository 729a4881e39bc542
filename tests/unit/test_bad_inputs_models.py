"""Bad input, the model's side (issue 29): models that cannot train, a capture that would have
fallen back without the loss, torch's own logs, a step whose loss is not finite, API misuse, and
errors on one rank of a run. Each ends in one ``error:`` line and a hint (or, through the Python
API, one ``PartitaError`` with a hint), exit 2, no traceback, within 60 s, the user's files and
parameters as they were.
"""

from __future__ import annotations

import re

import pytest
import torch

from partita.core.errors import PartitaError
from tests.unit.test_bad_inputs import X, assert_one_message
from tests.unit.test_bad_inputs_guards import api_refused, refused

MODELS = '''
import sys

import torch
from torch import nn


class Linear(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(64, 10)

    def forward(self, x):
        return self.l(x)


class NoParameters(nn.Module):
    def forward(self, x):
        return x * 2


class OnlyBuffers(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("w", torch.ones(64, 10))

    def forward(self, x):
        return x @ self.w


class Frozen(Linear):
    def __init__(self):
        super().__init__()
        self.requires_grad_(False)


class Detached(Linear):
    def forward(self, x):
        return self.l(x).detach()


class Complex(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(64, 10, dtype=torch.complex64))

    def forward(self, x):
        return (x.to(torch.complex64) @ self.w).real


class Argmax(Linear):
    def forward(self, x):
        return self.l(x).argmax(-1)


class TwoOutputs(Linear):
    def forward(self, x):
        y = self.l(x)
        return y, 2 * y


class StarArgs(Linear):
    def forward(self, *xs):
        return self.l(xs[0])


def raising_loss(out, y):
    raise ValueError("the loss is broken")


def per_sample_loss(out, y):
    return out.pow(2).mean(-1)


def integer_loss(out, y):
    return out.argmax(-1).sum()
'''


@pytest.fixture
def models(tmp_path):
    (tmp_path / "models.py").write_text(MODELS)
    (tmp_path / "exits.py").write_text("import sys\n\nsys.exit(0)\n")
    return tmp_path


# -- models that cannot train, and what capture would have dropped -------------------------------------

CANNOT_TRAIN = {
    "no parameters": (["NoParameters", "--loss", "mse", "--target", "y=float32[8,64]"], "has no parameters"),
    "only buffers": (["OnlyBuffers"], "(only 1 buffer(s), which are not trained)"),
    "every parameter frozen": (["Frozen"], "every parameter of Frozen is frozen"),
    "a detached output": (["Detached"], "does not depend on any trainable parameter"),
    "a complex parameter": (["Complex"], "parameter w is complex64"),
    "a bool input into a Linear": (["Linear", "--input", "x=bool[8,64]"], "multiplies tensors of bool, float32"),
    "a loss per sample": (["Linear", "--loss", "{m}/models.py:per_sample_loss"], "a tensor of shape [8], not one"),
    "an integer loss": (["Linear", "--loss", "{m}/models.py:integer_loss"], "is int64: an integer has no gradient"),
    "an argmax output": (["Argmax"], "the loss attaches to is int64"),
    "two tensors out and no --output-field": (["TwoOutputs"], "2-tuple holding 2 tensors (elements 0, 1)"),
}


@pytest.mark.parametrize("name", list(CANNOT_TRAIN))
def test_a_model_that_cannot_train_is_refused_at_compile(cli, models, name):
    (target, *flags), expected = CANNOT_TRAIN[name]
    flags = [f.replace("{m}", str(models)) for f in flags]
    inputs = [] if "--input" in flags else ["--input", X]
    refused(cli, "compile", f"{models}/models.py:{target}", *inputs, *flags, "-o", models / "p.json",
            expected=expected, keep=models)


FALLBACK = {
    "a raising loss": (["Linear", "--loss", "{m}/models.py:raising_loss"],
                       "torch.export of the model with its loss failed"),
    "loss=model on a model without labels=": (["Linear", "--loss", "model"], "takes no labels"),
    "targets of another batch": (["Linear", "--target", "y=int64[4]"], "have a batch of 4, but the input"),
    "forward(*xs)": (["StarArgs"], "would land in *xs of StarArgs.forward"),
    "a model file that calls sys.exit(0)": (["exits.py:M"], "called sys.exit(0)"),
}


@pytest.mark.parametrize("name", list(FALLBACK))
def test_a_capture_never_drops_the_loss_or_ends_silently(cli, models, name):
    (target, *flags), expected = FALLBACK[name]
    target = f"{models}/{target}" if target.endswith(".py:M") else f"{models}/models.py:{target}"
    flags = [f.replace("{m}", str(models)) for f in flags]
    message = refused(cli, "compile", target, "--input", X, *flags, "-o", models / "p.json",
                      expected=expected, keep=models)
    assert not (models / "p.json").exists(), message


def test_the_raising_loss_is_named_by_its_line(cli, models):
    message = refused(cli, "compile", f"{models}/models.py:Linear", "--input", X, "--loss",
                      f"{models}/models.py:raising_loss", "-o", models / "p.json", expected="the loss is broken",
                      keep=models)
    assert re.search(r"models\.py:\d+ `raise ValueError", message), message


def test_torchs_logged_traceback_stays_out_of_the_terminal(cli, models):
    """A shape that does not fit the model: torch logs a fake tensor's failed meta kernel with its
    traceback; the user sees partita's one message, and `--verbose` shows torch's log too."""
    args = ["compile", f"{models}/models.py:Linear", "--input", "x=float32[8,32]", "-o", models / "p.json"]
    message = refused(cli, *args, expected="a and b must have same reduction dim", keep=models)
    assert "module 'l (Linear)'" in message
    code, out, err = cli(*args, "--verbose")
    assert code == 2 and "failed while attempting to run meta for aten" in err


# -- the Python API: misuse and what a step is given ----------------------------------------------


@pytest.fixture(scope="module")
def linear():
    import partita

    torch.manual_seed(0)
    return partita.parallelize(torch.nn.Linear(64, 10), inputs={"x": "float32[8,64]"}, loss="mse",
                               targets="float32[8,10]", log_every=0)


def parameters(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


STEP_MISUSE = {
    "targets=None": (lambda: (torch.randn(8, 64),), None, "train_step got targets=None"),
    "inputs on the meta device": (lambda: (torch.randn(8, 64, device="meta"),), lambda: torch.randn(8, 10),
                                  "input 0 (x) on the meta device"),
    "targets on the meta device": (lambda: (torch.randn(8, 64),), lambda: torch.randn(8, 10, device="meta"),
                                   "targets on the meta device"),
    "a NaN batch": (lambda: (torch.full((8, 64), float("nan")),), lambda: torch.randn(8, 10),
                    "the loss is nan (not finite); the parameters are left as they were"),
    "infinite targets": (lambda: (torch.randn(8, 64),), lambda: torch.full((8, 10), float("inf")),
                         "the loss is inf (not finite)"),
}


@pytest.mark.parametrize("name", list(STEP_MISUSE))
def test_a_step_given_what_it_cannot_train_on_changes_nothing(linear, name):
    make_inputs, make_targets, expected = STEP_MISUSE[name]
    before, step = parameters(linear), linear.step
    api_refused(lambda: linear.train_step(*make_inputs(), targets=make_targets() if make_targets else None),
                expected)
    after = parameters(linear)
    assert all(torch.equal(before[k], after[k]) for k in before) and linear.step == step
    assert all(p.grad is None for p in linear.module.parameters())
    assert linear.train_step(torch.randn(8, 64), targets=torch.randn(8, 10)) > 0  # and it trains on after


def test_evaluate_needs_its_targets_too(linear):
    api_refused(lambda: linear.evaluate(torch.randn(8, 64), targets=None), "evaluate got targets=None")


def test_targets_left_out_are_one_message_not_a_type_error(linear):
    """``train_step(x)`` and ``evaluate(x)`` with no ``targets=`` at all: partita's message, as for
    ``targets=None`` (it was Python's TypeError for a missing keyword argument)."""
    before = parameters(linear)
    api_refused(lambda: linear.train_step(torch.randn(8, 64)), "train_step got targets=None")
    api_refused(lambda: linear.evaluate(torch.randn(8, 64)), "evaluate got targets=None")
    assert all(torch.equal(v, parameters(linear)[k]) for k, v in before.items())


def test_a_step_whose_loss_is_not_finite_is_skipped_when_asked(capsys):
    """``nonfinite="skip"``: the step changes no parameter, says so in one line, and counts."""
    import partita

    model = partita.parallelize(torch.nn.Linear(64, 10), inputs={"x": "float32[8,64]"}, loss="mse",
                                targets="float32[8,10]", nonfinite="skip", log_every=0)
    before = parameters(model)
    loss = model.train_step(torch.full((8, 64), float("nan")), targets=torch.randn(8, 10))
    out = capsys.readouterr().out
    assert loss != loss and model.nonfinite_skipped == 1 and model.step == 1
    assert all(torch.equal(before[k], v) for k, v in parameters(model).items())
    assert [line for line in out.splitlines() if "skipped" in line] == [
        "partita: step 0 skipped: the loss is nan (not finite); the parameters are unchanged "
        "(1 skipped so far, nonfinite='skip')"]


@pytest.mark.parametrize("kwargs, expected", [
    (dict(nonfinite="ignore"), "nonfinite='ignore' is not one of stop, skip"),
    (dict(seed=-1), "seed=-1 must be a whole number >= 0"),
    (dict(seed="42"), "seed='42' must be a whole number >= 0"),
    (dict(check_replicas_every=-3), "check_replicas_every=-3 must be a whole number >= 0"),
    (dict(inference=True, recompute=True), "recomputation has no use in a forward-only plan"),
    (dict(inference=True, max_grad_norm=1.0), "max_grad_norm=1.0 has no use in a forward-only plan"),
    (dict(inference=True, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1)),
     "optimizer=<lambda> has no use in a forward-only plan"),
])
def test_a_decorator_keyword_is_checked_where_it_is_written(kwargs, expected):
    import partita

    api_refused(lambda: partita.parallelize(inputs={"x": "float32[8,64]"}, **kwargs), expected)


# -- one rank's error under `partita run`: one message, no collateral tracebacks --------------------------


def test_under_plain_torchrun_the_erring_rank_says_it_once(monkeypatch, capsys):
    """Outside `partita run` the rank that raised prints the line itself (rank 0 did, whatever rank
    erred); several ranks raising one error print it once (the store counts who said it)."""
    from partita.runtime import distributed

    class Store:
        def __init__(self) -> None:
            self.counts: dict[str, int] = {}

        def add(self, key: str, n: int) -> int:
            self.counts[key] = self.counts.get(key, 0) + n
            return self.counts[key]

    store = Store()
    monkeypatch.delenv("PARTITA_ERROR_DIR", raising=False)
    monkeypatch.setattr(distributed, "_store", lambda: store)
    error = PartitaError("a bad batch", hint="pass the planned batch")
    for rank in (1, 0, 1):
        distributed._say(rank, error)
    err = capsys.readouterr().err
    assert err.splitlines() == ["error (rank 1): a bad batch", "  hint: pass the planned batch"]
    assert_one_message(2, "", err.replace("error (rank 1):", "error:"), "a bad batch")
