"""A model wrapped in ``torch.compile`` is accepted (issue 10): partita captures and runs the
module the wrapper holds (``_orig_mod``), whose parameters the wrapper shares. Before, export
traced into the compiled wrapper and the process died (exit 139)."""

from __future__ import annotations

import pytest
import torch

import partita
from examples.models import gpt_tiny
from partita.core.model.capture import capture, uncompiled
from partita.core.model.inputs import parse_input_spec
from partita.core.model.losses import default_loss
from tests.harness import plain_training

BATCH, SEQ = 4, 16


def batches():
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        seq = torch.randint(0, 256, (BATCH, SEQ + 1), generator=g)
        yield seq[:, :-1], seq[:, 1:]


def test_a_compiled_model_captures_as_the_model_itself():
    torch.manual_seed(0)
    model = gpt_tiny()
    compiled = torch.compile(model)
    assert uncompiled(compiled) is model and uncompiled(model) is model
    spec = [parse_input_spec(f"idx=int64[{BATCH},{SEQ}]")]
    a = capture(compiled, spec, loss=default_loss)
    b = capture(model, spec, loss=default_loss)
    assert [n.target for n in a.graph_module.graph.nodes] == [n.target for n in b.graph_module.graph.nodes]
    assert a.params == b.params


def test_the_decorator_takes_a_compiled_model_and_trains_it_as_one_process():
    torch.manual_seed(0)
    plain = gpt_tiny()
    want, _ = plain_training(plain, torch.optim.SGD(plain.parameters(), lr=0.1), batches())
    torch.manual_seed(0)
    model = gpt_tiny()
    compiled = torch.compile(model)
    wrapped = partita.parallelize(compiled, inputs={"idx": f"int64[{BATCH},{SEQ}]"}, cluster="local",
                                  optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    got = [float(wrapped.train_step(x, targets=y)) for x, y in batches()]
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    # the wrapper holds the trained parameters (the same objects partita trained)
    trained = {k.removeprefix("_orig_mod."): v for k, v in compiled.state_dict().items()}
    for k, v in plain.state_dict().items():
        torch.testing.assert_close(trained[k], v, rtol=1e-5, atol=1e-6, msg=k)
