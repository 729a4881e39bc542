"""Three layers replayed for all (passes/layer_replay.py) give the full replay's figures, to the byte.

Each model is analysed twice: ``annotate_saved_activations`` over the whole graph, and over the
short graph of three layers whose events are written out for the rest. Every per-node figure
(saved, saved per input, transient, gradients by then) and every graph total (saved that grows
with the batch and that does not, the step's peak, its storages, the node of the largest
transient) must be equal, and the short path must have been taken, so a model it silently falls
back on cannot pass for one it handles.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from examples.models import GPT, GPTConfig, LogitsOnly, hf_bert_mlm, hf_gpt2, hf_llama
from partita.core.model.capture import capture
from partita.core.model.graph import to_networkx
from partita.core.model.inputs import parse_input_spec
from partita.passes import layer_replay
from partita.passes.activations import annotate_saved_activations
from partita.passes.flops import annotate_flops
from partita.passes.repeats import find_repeated_layers

NODE_FIGURES = ("saved_bytes", "saved_input_bytes", "transient_bytes", "grad_bytes")
GRAPH_FIGURES = ("saved_bytes_batch", "saved_bytes_fixed", "transient_node", "step_peak_bytes", "step_peak_tensors")


def _mixtral() -> nn.Module:
    import transformers as tf

    return LogitsOnly(tf.MixtralForCausalLM(tf.MixtralConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=5, num_attention_heads=2,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, use_cache=False)))


MODELS = {
    "gpt": (lambda: GPT(GPTConfig(vocab_size=512, block_size=64, n_layer=6, n_head=4, n_embd=64)), "idx=int64[2,64]"),
    "gpt-4-layers": (lambda: GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=4, n_head=2, n_embd=32)),
                     "idx=int64[4,32]"),
    "llama-gqa": (lambda: hf_llama(num_hidden_layers=6, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=128, vocab_size=256), "input_ids=int64[2,32]"),
    "hf-gpt2": (lambda: hf_gpt2(n_layer=5, n_embd=64, n_head=4, vocab_size=256, n_positions=64),
                "input_ids=int64[4,32]"),
    "bert-tied": (lambda: hf_bert_mlm(num_hidden_layers=5), "input_ids=int64[4,16]"),
    "mixtral": (_mixtral, "input_ids=int64[4,8]"),
}


def _analysed(captured, short: bool):
    G = annotate_flops(to_networkx(captured))
    blocks = find_repeated_layers(G)
    annotate_saved_activations(G, captured, blocks if short else None)
    return G, blocks


@pytest.mark.parametrize("name", sorted(MODELS))
def test_three_layers_stand_for_all_to_the_byte(name: str, monkeypatch) -> None:
    factory, spec = MODELS[name]
    captured = capture(factory, [parse_input_spec(spec)])
    expanded = []
    real_expand = layer_replay.expand

    def counting(*args, **kwargs):
        expanded.append(out := real_expand(*args, **kwargs))
        return out

    monkeypatch.setattr("partita.passes.activations.expand", counting)
    full, _ = _analysed(captured, short=False)
    assert not expanded  # without blocks, the whole graph is replayed
    short, blocks = _analysed(captured, short=True)
    assert expanded and expanded[0] is not None, f"{name}: the short replay was not taken"
    cut = layer_replay.shortcut(captured.graph_module, short, blocks)
    assert len(cut.left_out) == len(blocks[0].indices) - 3
    ran = sum(1 for n in cut.graph_module.graph.nodes if n.op == "call_function")
    assert ran < sum(1 for n in captured.graph_module.graph.nodes if n.op == "call_function")
    for n in full.nodes:
        for key in NODE_FIGURES:
            assert short.nodes[n][key] == full.nodes[n][key], (n, key)
    for key in GRAPH_FIGURES:
        assert short.graph[key] == full.graph[key], key
    assert full.graph["step_peak_bytes"] > 0 and any(full.nodes[n]["grad_bytes"] for n in full.nodes)


class _Collecting(nn.Module):
    """Layers whose every output the head reads (a sum of all hidden states): no layer stands for another."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(5))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = []
        for layer in self.layers:
            x = layer(x)
            outs.append(x)
        return self.head(torch.stack(outs).sum(0))


def test_a_model_reading_every_layer_is_replayed_whole() -> None:
    captured = capture(_Collecting, [parse_input_spec("x=float32[8,16]")])
    short, blocks = _analysed(captured, short=True)
    assert blocks and len(blocks[0].indices) == 5
    assert layer_replay.shortcut(captured.graph_module, short, blocks) is None
    full, _ = _analysed(captured, short=False)
    for key in GRAPH_FIGURES:
        assert short.graph[key] == full.graph[key], key


def test_a_short_block_is_replayed_whole() -> None:
    captured = capture(lambda: GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=16)),
                       [parse_input_spec("idx=int64[2,16]")])
    G = annotate_flops(to_networkx(captured))
    blocks = find_repeated_layers(G)
    assert len(blocks[0].indices) == 3 < layer_replay.MIN_LAYERS
    assert layer_replay.shortcut(captured.graph_module, G, blocks) is None


class _ScaledLayer(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.fc, self.scale = nn.Linear(16, 16), scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x)) * self.scale


class _Scaled(nn.Module):
    """Layers alike in ops and shapes whose constant differs by layer (a per-layer scale): not one layer for all."""

    def __init__(self, scales: tuple[float, ...] = (1.0, 0.5, 0.25, 0.125, 0.0625)) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_ScaledLayer(s) for s in scales)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_layers_whose_constants_differ_are_replayed_whole() -> None:
    captured = capture(_Scaled, [parse_input_spec("x=float32[8,16]")])
    G = annotate_flops(to_networkx(captured))
    blocks = find_repeated_layers(G)
    assert blocks and len(blocks[0].indices) == 5  # alike by the repeated-layer signature
    assert layer_replay.shortcut(captured.graph_module, G, blocks) is None
    alike = capture(lambda: _Scaled((0.5,) * 5), [parse_input_spec("x=float32[8,16]")])  # the same, one scale
    H = annotate_flops(to_networkx(alike))
    assert layer_replay.shortcut(alike.graph_module, H, find_repeated_layers(H)) is not None
