"""Captures kept for reuse (core/model/capture_memo.py): a capture is reused only for an equal model
structure, inputs and loss, never carries values of another instance, and is off unless turned on."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from partita.core.model.capture import capture
from partita.core.model.capture_memo import memoize_captures, memoizing
from partita.core.model.inputs import parse_input_spec
from partita.core.model.losses import default_loss

X = [parse_input_spec("x=float32[4,8]")]


class Net(nn.Module):
    def __init__(self, scale: float = 2.0, width: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(8, width)
        self.out = nn.Linear(width, 3)
        self.scale = scale  # a plain attribute the forward reads: it changes the graph

    def forward(self, x):
        return self.out(torch.relu(self.fc(x)) * self.scale)


class WithConstant(Net):
    def __init__(self) -> None:
        super().__init__()
        self.shift = torch.ones(3)  # neither parameter nor buffer: export lifts it as a constant

    def forward(self, x):
        return super().forward(x) + self.shift


@pytest.fixture
def fresh():
    """A memo of this test's own (the session's is set aside and turned back on after)."""
    memoize_captures()
    yield
    memoize_captures()


def _scale_of(captured) -> list:
    return [n.args[1] for n in captured.graph_module.graph.nodes if n.op == "call_function" and "mul" in str(n.target)]


def test_an_equal_structure_is_captured_once(fresh):
    first = capture(Net(), X, loss=default_loss)
    assert capture(Net(), X, loss=default_loss) is first  # another instance, equal structure
    assert capture(Net, X, loss=default_loss) is first  # the factory's model has the same structure
    assert capture(Net(), X) is not first  # no loss: another graph
    assert capture(Net(), [parse_input_spec("x=float32[2,8]")], loss=default_loss) is not first


def test_what_changes_the_graph_changes_the_key(fresh, monkeypatch):
    plain = capture(Net(), X, loss=default_loss)
    other = capture(Net(scale=3.0), X, loss=default_loss)
    assert other is not plain and _scale_of(plain) == [2.0] and _scale_of(other) == [3.0]
    assert capture(Net(width=32), X, loss=default_loss) is not plain
    assert capture(Net().eval(), X, loss=default_loss) is not plain
    frozen = Net()
    frozen.fc.weight.requires_grad_(False)
    assert capture(frozen, X, loss=default_loss) is not plain
    monkeypatch.setattr(Net, "forward", lambda self, x: self.out(torch.tanh(self.fc(x))))
    patched = capture(Net(), X, loss=default_loss)
    assert patched is not plain and any("tanh" in str(n.target) for n in patched.graph_module.graph.nodes)


def test_a_capture_holding_an_instances_values_is_never_reused(fresh):
    first = capture(WithConstant(), X, loss=default_loss)
    assert first.constants  # the lifted tensor belongs to that instance
    assert capture(WithConstant(), X, loss=default_loss) is not first


def test_off_unless_turned_on():
    memoize_captures(False)
    try:
        assert not memoizing()
        assert capture(Net(), X, loss=default_loss) is not capture(Net(), X, loss=default_loss)
    finally:
        memoize_captures()
    assert memoizing()
