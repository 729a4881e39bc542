"""Capture: input specs, torch.export on fake tensors, the fx fallback, user errors, fingerprints."""

from __future__ import annotations

import dataclasses
import resource
from pathlib import Path

import pytest
import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[2]

from examples.models import MLP, SmallCNN, gpt_tiny, hf_gpt2, hf_llama, llama2_70b  # noqa: E402
from partita.core.errors import CaptureError, InputSpecError  # noqa: E402
from partita.core.model.capture import EXPORT, SYMBOLIC_TRACE, capture  # noqa: E402
from partita.core.model.graph import graph_fingerprint, to_networkx  # noqa: E402
from partita.core.model.inputs import InputSpec, parse_input_spec  # noqa: E402

# ---------------------------------------------------------------- input specs

@pytest.mark.parametrize("text, spec", [
    ("idx=int64[8,128]", InputSpec("idx", torch.int64, (8, 128))),
    ("x=float32[4, 3, 32, 32]", InputSpec("x", torch.float32, (4, 3, 32, 32))),
    (" h = bf16[2,16] ", InputSpec("h", torch.bfloat16, (2, 16))),
    ("m=bool[3]", InputSpec("m", torch.bool, (3,))),
    ("t=long[1,2]", InputSpec("t", torch.int64, (1, 2))),
])
def test_parse_input_spec_round_trips(text: str, spec: InputSpec) -> None:
    assert parse_input_spec(text) == spec
    assert parse_input_spec(str(spec)) == spec
    assert InputSpec.from_dict(spec.to_dict()) == spec


@pytest.mark.parametrize("text, says", [
    ("idx", "missing '='"),
    ("idx=int64", "square brackets"),
    ("=int64[8]", "missing the name"),
    ("idx=[8]", "missing the dtype"),
    ("idx=int65[8]", "unknown dtype 'int65'"),
    ("idx=int64[8,x]", "'x'"),
    ("idx=int64[]", "empty shape"),
    ("idx=int64[0,4]", "positive"),
    ("idx=int64(8,128)", "square brackets"),
])
def test_malformed_input_spec_says_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(InputSpecError) as info:
        parse_input_spec(text)
    assert says in info.value.message
    assert "NAME=DTYPE[SHAPE]" in str(info.value)


# ---------------------------------------------------------------- capture

def _real_numel(factory) -> int:
    torch.manual_seed(0)
    return sum(p.numel() for p in factory().parameters())


def _small_gpt2() -> nn.Module:
    return hf_gpt2(n_layer=2, n_embd=64, n_head=4, vocab_size=512)


def _small_llama() -> nn.Module:
    return hf_llama(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=172, vocab_size=512)


@pytest.mark.parametrize("factory, spec, out_shape, module_path", [
    (MLP, "x=float32[4,64]", (4, 10), "layers.1"),
    (SmallCNN, "x=float32[2,3,32,32]", (2, 10), "conv2"),
    (gpt_tiny, "idx=int64[2,16]", (2, 16, 256), "transformer.h.1.attn.v_proj"),
    (_small_gpt2, "input_ids=int64[2,16]", (2, 16, 512), "model.transformer.h.1.attn"),
    (_small_llama, "input_ids=int64[2,16]", (2, 16, 512), "model.model.layers.1.self_attn.q_proj"),
])
def test_capture_with_export(factory, spec: str, out_shape: tuple[int, ...], module_path: str) -> None:
    captured = capture(factory, [parse_input_spec(spec)])
    assert captured.method == EXPORT
    numel = sum(torch.Size(shape).numel() for shape, _ in captured.params.values())
    assert numel == _real_numel(factory)
    G = to_networkx(captured)
    assert module_path in {a["module"] for _, a in G.nodes(data=True)}
    (out,) = [n for n in captured.graph_module.graph.nodes if n.op == "output"]
    assert tuple(out.args[0][0].meta["val"].shape) == out_shape
    assert all(isinstance(a["shapes"], list) for _, a in G.nodes(data=True))


def test_capture_of_an_instance_neither_copies_nor_keeps_its_weights() -> None:
    """The capture holds no tensor of the model, so dropping the model's frees them at once
    (a tensor-parallel rank keeps a captured graph and only its own shards; issue 16)."""
    import gc
    import weakref

    torch.manual_seed(0)
    model = gpt_tiny()
    weight = weakref.ref(model.lm_head.weight)
    gc.disable()  # what only a collection would free counts as kept
    try:
        captured = capture(model, [parse_input_spec("idx=int64[2,16]")])
        assert captured.method == EXPORT and captured.name == "GPT"
        assert captured.params["lm_head.weight"] == ((256, 64), torch.float32)
        assert captured.constants == {}  # the tiny GPT lifts no tensor constants
        model.to("meta")  # what TensorParallel does once it holds its shards
        assert weight() is None
    finally:
        gc.enable()


class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.rand([]) < 0.5:  # layer drop: data-dependent control flow
            return x
        return self.proj(x)


class _LayerDrop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Inner(), _Inner()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("model", [_LayerDrop, _LayerDrop()], ids=["factory", "instance"])
def test_data_dependent_control_flow_is_one_clear_error(model, capsys) -> None:
    with pytest.raises(CaptureError) as info:
        capture(model, [parse_input_spec("x=float32[2,8]")])
    message = str(info.value)
    assert "layers.0 (_Inner)" in message
    assert f"{Path(__file__).name}:" in message and "if torch.rand([]) < 0.5" in message
    assert "remove data-dependent Python control flow or mark the module as a leaf" in message.replace(
        " (e.g. `if torch.rand([]) < p:`)", "")
    assert info.value.__cause__ is not None
    assert "def forward" not in capsys.readouterr().err  # no partial graph dump on stderr


@dataclasses.dataclass
class _Out:
    y: torch.Tensor


class _ReturnsDataclass(nn.Module):
    """torch.export refuses an unregistered output type; symbolic_trace takes it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> _Out:
        return _Out(torch.relu(self.lin(x)))


def test_symbolic_trace_fallback_propagates_fake_shapes() -> None:
    captured = capture(_ReturnsDataclass, [parse_input_spec("x=float32[3,4]")])
    assert captured.method == SYMBOLIC_TRACE and captured.constants == {}
    G = to_networkx(captured)
    relu = [a for _, a in G.nodes(data=True) if a["op"].endswith("relu")]
    assert relu and relu[0]["shapes"] == [(3, 6)]
    assert {a["param_name"] for _, a in G.nodes(data=True) if a["kind"] == "param"} == {"lin.weight", "lin.bias"}
    assert any(a["module"] == "lin" for _, a in G.nodes(data=True) if a["kind"] == "call")


def test_capture_refuses_a_non_module() -> None:
    with pytest.raises(CaptureError, match="not an nn.Module"):
        capture(lambda: 3, [parse_input_spec("x=float32[2]")])


def test_llama_70b_width_allocates_no_parameter_memory() -> None:
    """Two layers at Llama-2-70B width are 2.3e9 parameters (9 GiB in fp32) if real."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    captured = capture(lambda: llama2_70b(num_hidden_layers=2), [parse_input_spec("input_ids=int64[1,64]")])
    grown_gib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) / 2**20
    numel = sum(torch.Size(shape).numel() for shape, _ in captured.params.values())
    assert numel > 2e9
    assert grown_gib < 0.5, f"peak RSS grew by {grown_gib:.2f} GiB"


# ---------------------------------------------------------------- fingerprints

_FINGERPRINT = """
from examples.models import gpt_tiny
from partita.core.model.capture import capture
from partita.core.model.inputs import parse_input_spec
from partita.core.model.graph import graph_fingerprint, to_networkx
print(graph_fingerprint(to_networkx(capture(gpt_tiny, [parse_input_spec("idx=int64[2,16]")]))))
"""


def _fingerprint(factory, spec: str) -> str:
    return graph_fingerprint(to_networkx(capture(factory, [parse_input_spec(spec)])))


class _Renamed(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = self.layers
        del self.layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[1](torch.relu(self.blocks[0](x)))


def test_fingerprint_changes_with_a_parameter_name() -> None:
    assert _fingerprint(MLP, "x=float32[4,64]") != _fingerprint(_Renamed, "x=float32[4,64]")


class _InitReadsValues(torch.nn.Module):
    """Initialisation a fake tensor cannot run (``trunc_normal_``, as HF ViT's: it asks a tensor
    for a Python number), and a tied weight."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16)
        self.head = torch.nn.Linear(16, 32, bias=False)
        self.head.weight = self.emb.weight
        torch.nn.init.trunc_normal_(self.emb.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(idx))


def test_a_model_whose_initialisation_reads_values_is_built_on_meta_and_captured():
    from partita.core.model.capture import capture
    from partita.core.model.inputs import parse_input_spec
    from partita.core.model.losses import default_loss

    captured = capture(_InitReadsValues, [parse_input_spec("idx=int64[2,8]")], loss=default_loss)
    assert set(captured.params) == {"emb.weight"}  # still tied: one parameter
    assert captured.params["emb.weight"][0] == (32, 16)
    assert any(n.target is torch.ops.aten.embedding.default for n in captured.graph_module.graph.nodes)
