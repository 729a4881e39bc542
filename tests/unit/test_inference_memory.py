"""Inference memory: the forward's largest live set per stage and micro-batch, logits included (issue 12)."""

from __future__ import annotations

import json

import torch

from partita.compiler.cli import main
from partita.compiler.compile import compile_model
from partita.core.cluster import load_cluster
from partita.core.model.capture import capture
from partita.core.model.inputs import parse_input_spec
from partita.core.options import Options
from partita.passes.profile import profile_model


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def test_live_set_by_hand() -> None:
    """x (2, 8) fp32 = 64 B; fc1 out (2, 16) = 128 B; relu out 128 B; fc2 out (2, 4) = 32 B.
    fc1 runs with x and its output alive: 192 B; relu with fc1's output and its own: 256 B (x is
    dead); fc2 with relu's output and its own: 160 B; then the output alone: 32 B. Peak 256 B;
    at micro-batch 4 everything doubles: 512 B. The weights are model state, not counted."""
    p = profile_model(capture(MLP, [parse_input_spec("x=float32[2,8]")]))
    live = {n: a["live_batch"] + a["live_fixed"] for n, a in p.graph.nodes(data=True) if a["kind"] == "call"}
    assert sorted(live.values()) == [160, 192, 256]
    assert p.live_bytes(2) == 256
    assert p.live_bytes(4) == 512
    assert p.live_bytes(1) == 128


def test_an_inference_plan_counts_its_live_set() -> None:
    """One device, fp32: activations = the peak live set at the micro-batch (was 0)."""
    plan = compile_model(MLP, Options(inputs=[parse_input_spec("x=float32[2,8]")],
                                      cluster=load_cluster("local", devices=1), inference=True)).plan
    assert plan.predicted.memory.activations == 256 * plan.training.micro_batch_size // 2
    assert plan.predicted.memory.params == (8 * 16 + 16 + 16 * 4 + 4) * 4


def test_logits_dominate_a_language_model_inference_plan() -> None:
    """A GPT's inference plan holds at least its logits, (B, T, V) at the precision."""

    from examples.models import gpt_tiny

    plan = compile_model(gpt_tiny, Options(inputs=[parse_input_spec("idx=int64[8,64]")],
                                           cluster=load_cluster("local", devices=2), inference=True)).plan
    mb = plan.training.micro_batch_size
    assert plan.predicted.memory.activations >= mb * 64 * 256 * 4


def test_estimate_inference(tmp_path, capsys) -> None:
    model = tmp_path / "m.py"
    model.write_text("import torch\n"
                     "class MLP(torch.nn.Module):\n"
                     "    def __init__(self):\n"
                     "        super().__init__()\n"
                     "        self.fc1, self.act = torch.nn.Linear(8, 16), torch.nn.ReLU()\n"
                     "        self.fc2 = torch.nn.Linear(16, 4)\n"
                     "    def forward(self, x):\n"
                     "        return self.fc2(self.act(self.fc1(x)))\n")
    try:
        main(["estimate", f"{model}:MLP", "--input", "x=float32[2,8]", "--cluster", "local", "--devices", "1",
              "--precision", "fp32", "--inference", "--json"])
    except SystemExit as e:
        assert not e.code, capsys.readouterr()
    out = capsys.readouterr().out
    rows = json.loads(out[out.index("{"):])["strategies"]
    assert len(rows) == 1
    assert rows[0]["activations"] == 256 and rows[0]["params"] == (8 * 16 + 16 + 16 * 4 + 4) * 4
    assert rows[0]["grads"] == rows[0]["optimizer"] == 0


def test_kv_cache_by_hand() -> None:
    """Llama, 2 layers, 4 query heads sharing 2 KV heads of dim 16, fp32: the cache holds K and V of
    the KV heads (before they are repeated for the query heads): 2 x 2 layers x 2 heads x 16 x 4 B
    = 512 B per token per sequence; 2 sequences of 16 tokens: 16,384 B; one of 64: 32,768 B."""

    import pytest

    pytest.importorskip("transformers")
    from examples.models import hf_llama

    p = profile_model(capture(lambda: hf_llama(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                               num_key_value_heads=2, intermediate_size=128, vocab_size=256),
                              [parse_input_spec("input_ids=int64[2,16]")]))
    assert p.graph.graph["kv_bytes"] == 16_384
    assert p.kv_cache_bytes(1, 64) == 32_768


def test_estimate_generate_counts_the_kv_cache(capsys) -> None:
    import pytest

    pytest.importorskip("transformers")
    args = ["estimate", "examples/models.py:hf_llama", "--input", "input_ids=int64[2,16]", "--cluster", "local",
            "--devices", "1", "--precision", "fp32", "--inference", "--json"]
    rows = []
    for extra in ([], ["--generate", "48"]):
        try:
            main(args + extra)
        except SystemExit as e:
            assert not e.code, capsys.readouterr()
        out = capsys.readouterr().out
        rows.append(json.loads(out[out.index("{"):])["strategies"][0])
    # hf_llama's defaults: 2 layers, 8 heads of dim 32 (no grouping): 2 x 2 x 8 x 32 x 4 B = 4 KiB per token;
    # 2 sequences of 16 + 48 tokens
    assert rows[1]["activations"] - rows[0]["activations"] == 4096 * 2 * 64


def test_an_inference_plan_with_generation_holds_the_kv_cache() -> None:
    """One device, fp32, the Llama of test_kv_cache_by_hand at [2,16] generating 48 tokens: the plan's
    activations grow by the cache of 2 sequences of 64 tokens, 2 x 64 x 512 B = 65,536 B."""

    import pytest

    pytest.importorskip("transformers")
    from examples.models import hf_llama

    def small():
        return hf_llama(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=128, vocab_size=256)

    plans = [compile_model(small, Options(inputs=[parse_input_spec("input_ids=int64[2,16]")],
                                          cluster=load_cluster("local", devices=1), inference=True, precision="fp32",
                                          generate=n)).plan
             for n in (0, 48)]
    assert [p.training.micro_batch_size for p in plans] == [2, 2]
    assert plans[1].predicted.memory.activations - plans[0].predicted.memory.activations == 65_536
