"""Model outputs as models return them (core/model/losses.py): the loss attaches to `logits` of a
dict / ModelOutput, to a tuple's element, to a named field; the model's own loss with labels=; a
forward with optional arguments; and the CLI's --loss / --output-field / --target."""

import dataclasses
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from partita.compiler.cli import cli
from partita.core.errors import PartitaError
from partita.core.model.capture import capture
from partita.core.model.inputs import parse_input_spec
from partita.core.model.losses import default_loss, resolve_loss, select_output

SPEC = parse_input_spec("tokens=int64[4,8]")


class Net(nn.Module):
    """Returns what ``kind`` says; takes an optional second argument, as autoparallel's Llama-3 does."""

    def __init__(self, kind: str = "dict") -> None:
        super().__init__()
        self.kind = kind
        self.emb = nn.Embedding(32, 16)
        self.head = nn.Linear(16, 32)

    def forward(self, tokens, input_batch=None, labels=None):
        h = self.emb(tokens)
        logits = self.head(h)
        if self.kind == "tensor":
            return logits
        if self.kind == "tuple":
            return h, logits
        if self.kind == "dataclass":
            return Out(hidden=h, scores=logits)
        out = {"hidden": h, "logits": logits}
        if labels is not None:
            out["loss"] = default_loss(logits, labels)
        return out


@dataclasses.dataclass
class Out:
    hidden: torch.Tensor
    scores: torch.Tensor


def test_select_output_finds_the_tensor_the_loss_attaches_to():
    t = torch.ones(2, 3)
    assert select_output(t) is t
    assert select_output({"hidden": 1, "logits": t}) is t
    assert select_output((torch.zeros(1), t), 1) is t
    assert select_output(Out(torch.zeros(1), t), "scores") is t
    with pytest.raises(PartitaError, match="which one does the loss attach to"):
        select_output(Out(torch.zeros(1), t))
    with pytest.raises(PartitaError, match="has no field 'nope'"):
        select_output({"logits": t}, "nope")


@pytest.mark.parametrize("kind, output", [("dict", None), ("tuple", 1), ("dataclass", "scores"), ("tensor", None)])
def test_capture_attaches_the_loss_to_the_models_output(kind, output):
    c = capture(lambda: Net(kind), [SPEC], loss=resolve_loss(None, output))
    assert str(c.targets) == "targets=int64[4,8]"
    assert c.loss.startswith("default_loss")


def test_the_models_own_loss_is_called_with_labels():
    c = capture(lambda: Net("dict"), [SPEC], loss=resolve_loss("model"))
    assert str(c.targets) == "labels=int64[4,8]"
    placeholders = [n.name for n in c.graph_module.graph.nodes if n.op == "placeholder" and n.name not in c.param_nodes]
    assert placeholders == ["tokens", "targets"]  # the optional input_batch keeps its default


def test_the_cli_takes_loss_output_field_and_targets(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(Path(__file__).read_text().split("def test_select")[0])
    runner = CliRunner()
    for extra in (["--output-field", "scores"], ["--loss", "mse", "--output-field", "1",
                                                  "--target", "targets=float32[4,8,32]"]):
        kind = "dataclass" if "scores" in extra else "tuple"
        (tmp_path / "k.py").write_text("from m import Net  # beside it: the loader puts the file's folder on the path\n"
                                       f"def make():\n    return Net({kind!r})\n")
        r = runner.invoke(cli, ["compile", f"{tmp_path / 'k.py'}:make", "--input", "tokens=int64[4,8]",
                                "--devices", "1", "-o", str(tmp_path / "p.json"), *extra])
        assert r.exit_code == 0, r.output
    r = runner.invoke(cli, ["compile", f"{tmp_path / 'k.py'}:make", "--input", "tokens=int64[4,8]",
                            "--devices", "1", "--loss", "nope", "-o", str(tmp_path / "p.json")])
    assert r.exit_code != 0 and "unknown loss 'nope'" in str(r.exception)
