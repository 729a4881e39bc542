"""The golden plan set: model x cluster x pins cases whose plan files are kept in tests/data/golden/.

A refactor of the planner (issue 41: one search, axes as plug-ins) must leave every plan the same:
tests/unit/test_golden_plans.py plans each case again and compares its file with the kept one,
apart from the format fields (``FORMAT_FIELDS``: timings, the schema version, the seal).

Regenerate (only when a plan is meant to change, and say why in the commit):
``.venv/bin/python -m tests.golden [CASE-ID ...]``.

The cases cover the own GPTs, Hugging Face families (GPT-2, Llama with grouped KV heads, BERT with
tied weights, Mixtral's experts), every axis pinned and unpinned (dp, tp, pp with each schedule,
ZeRO 0-3, micro-batches, recomputation, sequence parallelism, offload, ep), the GPU presets at one
and several nodes, a published run's configuration (Narayanan et al. 2021's GPT 1.7B row: tp=1 x 32
on 32 A100s, shrunk in depth) and inference with a KV cache.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

FOLDER = Path(__file__).resolve().parent / "data" / "golden"
# what may differ between two runs of the same planner: how long each part took, the format's version
# and the seal over the whole (which covers the timings)
FORMAT_FIELDS = ("analysis_seconds", "version", "sha256")
SOLVER_FORMAT_FIELDS = ("seconds",)


@dataclass(frozen=True)
class Case:
    id: str
    model: str  # a key of MODELS
    options: Mapping[str, Any] = field(default_factory=dict)


def _gpt(**kw: int) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        from examples.models import GPT, GPTConfig

        return GPT(GPTConfig(**kw))
    return build


def _hf(name: str, **kw: Any) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        import examples.models as m

        return getattr(m, name)(**kw)
    return build


def _mixtral(hidden: int = 32, inter: int = 64, experts: int = 4) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        import transformers as tf

        from examples.models import LogitsOnly

        return LogitsOnly(tf.MixtralForCausalLM(tf.MixtralConfig(
            vocab_size=128, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, num_local_experts=experts, num_experts_per_tok=2,
            use_cache=False)))
    return build


def _mlp() -> torch.nn.Module:
    from examples.models import MLP

    return MLP()


def _cnn() -> torch.nn.Module:
    from examples.models import SmallCNN

    return SmallCNN()


MODELS: dict[str, tuple[Callable[[], torch.nn.Module], str]] = {  # name -> (factory, its input)
    "gpt-tiny": (_gpt(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64), "idx=int64[8,64]"),
    "gpt-4l": (_gpt(vocab_size=512, block_size=128, n_layer=4, n_head=4, n_embd=128), "idx=int64[16,128]"),
    "gpt-1.7b-4l": (_gpt(vocab_size=51200, block_size=2048, n_layer=4, n_head=24, n_embd=2304), "idx=int64[1,2048]"),
    "gpt-wide": (_gpt(vocab_size=50304, block_size=1024, n_layer=2, n_head=16, n_embd=2048), "idx=int64[1,1024]"),
    "mlp": (_mlp, "x=float32[32,64]"),
    "cnn": (_cnn, "x=float32[8,3,32,32]"),
    "hf-gpt2": (_hf("hf_gpt2", n_layer=2, n_embd=128, n_head=4, vocab_size=1024, n_positions=128),
                "input_ids=int64[8,128]"),
    "hf-llama-gqa": (_hf("hf_llama", num_hidden_layers=2, hidden_size=256, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=1024), "input_ids=int64[8,128]"),
    "hf-llama-1b": (_hf("hf_llama", num_hidden_layers=2, hidden_size=2048, num_attention_heads=16,
                        intermediate_size=5504, vocab_size=32000), "input_ids=int64[1,2048]"),
    "hf-bert": (_hf("hf_bert_mlm"), "input_ids=int64[8,32]"),
    "mixtral": (_mixtral(), "input_ids=int64[4,8]"),
    "mixtral-big": (_mixtral(hidden=256, inter=1024, experts=8), "input_ids=int64[4,8]"),
}

_A100, _H100 = dict(cluster="dgx-a100"), dict(cluster="dgx-h100")
_MIXED = dict(precision="bf16-mixed")

CASES: tuple[Case, ...] = (
    # own GPTs on local CPU processes (fp32): the runtime's cases
    Case("gpt-tiny-local", "gpt-tiny"),
    Case("gpt-tiny-local2", "gpt-tiny", dict(devices=2)),
    Case("gpt-tiny-local4", "gpt-tiny", dict(devices=4)),
    Case("gpt-tiny-tp2", "gpt-tiny", dict(devices=2, tp=2)),
    Case("gpt-tiny-pp2", "gpt-tiny", dict(devices=2, pp=2)),
    Case("gpt-tiny-dp2-pp2-gpipe", "gpt-tiny", dict(devices=4, pp=2, dp=2, schedule="gpipe")),
    Case("gpt-tiny-zero3", "gpt-tiny", dict(devices=2, dp=2, zero=3)),
    Case("gpt-tiny-zero2-mb2", "gpt-tiny", dict(devices=2, dp=2, zero=2, micro_batch_size=2)),
    Case("gpt-tiny-recompute-full", "gpt-tiny", dict(devices=2, recompute="full")),
    Case("gpt-tiny-offload", "gpt-tiny", dict(devices=2, offload="optimizer")),
    Case("gpt-4l-interleaved", "gpt-4l", dict(devices=4, pp=2, dp=2, schedule="interleaved-1f1b")),
    Case("gpt-4l-dp2-tp2", "gpt-4l", dict(devices=4, dp=2, tp=2)),
    Case("gpt-4l-sp", "gpt-4l", dict(devices=2, tp=2, sequence_parallel=True)),
    Case("gpt-4l-selective", "gpt-4l", dict(devices=2, recompute="selective")),
    Case("gpt-4l-inference", "gpt-4l", dict(devices=2, inference=True, generate=16)),
    Case("mlp-local2", "mlp", dict(devices=2)),
    Case("cnn-local2", "cnn", dict(devices=2)),
    # Hugging Face families
    Case("hf-gpt2-local2", "hf-gpt2", dict(devices=2)),
    Case("hf-gpt2-tp2", "hf-gpt2", dict(devices=2, tp=2)),
    Case("hf-llama-gqa-tp2", "hf-llama-gqa", dict(devices=2, tp=2)),
    Case("hf-llama-gqa-pp2", "hf-llama-gqa", dict(devices=4, pp=2)),
    Case("hf-bert-local2", "hf-bert", dict(devices=2)),
    Case("hf-bert-pp2", "hf-bert", dict(devices=2, pp=2)),
    Case("mixtral-ep2", "mixtral", dict(devices=4, dp=4, ep=2)),
    Case("mixtral-ep2-pp2", "mixtral", dict(devices=4, pp=2, ep=2)),
    Case("mixtral-big-h100-tight", "mixtral-big", dict(cluster="h100-150mb", dp=4, world_size=4)),
    # the GPU presets: the search's own choice, at one node and several
    Case("gpt-1.7b-a100x8", "gpt-1.7b-4l", dict(_A100, **_MIXED, batch=64)),
    Case("gpt-1.7b-a100x32", "gpt-1.7b-4l", dict(_A100, **_MIXED, nodes=4, batch=512)),
    Case("gpt-1.7b-published-tp1", "gpt-1.7b-4l", dict(_A100, **_MIXED, nodes=4, batch=512, tp=1, dp=32,
                                                           recompute="full")),
    Case("gpt-wide-h100x16", "gpt-wide", dict(_H100, **_MIXED, nodes=2, batch=128)),
    Case("gpt-wide-h100-zero3-pinned", "gpt-wide", dict(_H100, **_MIXED, batch=64, zero=3)),
    Case("hf-llama-1b-a100x16", "hf-llama-1b", dict(_A100, **_MIXED, nodes=2, batch=256)),
    Case("hf-llama-1b-h100-tp8", "hf-llama-1b", dict(_H100, **_MIXED, batch=64, tp=8)),
    Case("hf-llama-1b-h100-pp4-sp", "hf-llama-1b", dict(_H100, **_MIXED, batch=64, tp=2, pp=4,
                                                          sequence_parallel=True)),
    Case("hf-llama-1b-ethernet", "hf-llama-1b", dict(cluster="ethernet-10g", **_MIXED, nodes=2, batch=32)),
    Case("hf-llama-1b-inference", "hf-llama-1b", dict(_A100, **_MIXED, inference=True, generate=128, batch=16)),
)


def _cluster(name: str) -> Any:
    if name == "h100-150mb":  # an H100 node of 4 GPUs of 150 MB: the replicated experts do not fit
        import dataclasses

        from partita.core.cluster import PRESETS

        return dataclasses.replace(PRESETS["dgx-h100"], memory_bytes=150_000_000, memory_reserve=0.0
                                   ).with_devices(4)
    return name


def plan_of(case: Case) -> dict[str, Any]:
    """The case planned now, as the plan file's JSON data."""
    from partita.compiler.compile import compile_model
    from partita.core.options import Options

    factory, spec = MODELS[case.model]
    options = dict(case.options)
    options["cluster"] = _cluster(options.get("cluster", "local"))
    result = compile_model(factory, Options(inputs=[spec], **options), name=case.model)
    return json.loads(result.plan.to_json())


def comparable(data: Mapping[str, Any]) -> dict[str, Any]:
    """A plan file's data without its format fields."""
    out = {k: v for k, v in data.items() if k not in FORMAT_FIELDS}
    out["solver"] = {k: v for k, v in data["solver"].items() if k not in SOLVER_FORMAT_FIELDS}
    return out


def kept(case: Case) -> dict[str, Any]:
    return json.loads((FOLDER / f"{case.id}.json").read_text())


def write(cases: Any = CASES) -> None:
    FOLDER.mkdir(parents=True, exist_ok=True)
    for case in cases:
        data = comparable(plan_of(case))
        data["golden"] = {"torch": torch.__version__.split("+")[0]}
        (FOLDER / f"{case.id}.json").write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        print(case.id, data["mesh"], flush=True)


if __name__ == "__main__":
    wanted = set(sys.argv[1:])
    write([c for c in CASES if not wanted or c.id in wanted])
