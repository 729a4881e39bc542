"""TP honesty: a "tp" group whose ops all split the batch is called data parallelism with sharded weights,
in the plan header (`partita show`), and in `partita view` (issue 12)."""

from __future__ import annotations

import dataclasses

from rich.console import Console

from examples.models import gpt_tiny
from partita.compiler.compile import compile_model
from partita.compiler.report import plan_summary, tp_split
from partita.compiler.view import page_data
from partita.core.cluster import load_cluster
from partita.core.model.inputs import parse_input_spec
from partita.core.options import (
    Options,
)


def _text(renderable) -> str:
    console = Console(width=400, record=True)
    console.print(renderable)
    return console.export_text()


def _plan():
    return compile_model(gpt_tiny, Options(inputs=[parse_input_spec("idx=int64[16,64]")],
                                           cluster=load_cluster("local", devices=4), tp=2, pp=1)).plan


def test_megatron_style_tp_is_called_tp() -> None:
    plan = _plan()
    assert any(n.strategy in ("col", "row", "heads", "vocab") for n in plan.nodes)
    assert tp_split(plan) is None
    assert "data parallelism" not in _text(plan_summary(plan))


def test_a_tp_group_that_only_splits_the_batch_is_called_data_parallelism() -> None:
    plan = _plan()
    calls = lambda n: n.op not in ("placeholder", "get_attr", "output")
    batch_only = dataclasses.replace(
        plan,
        nodes=tuple(dataclasses.replace(n, strategy="shard(0)", out=("shard(0)",) * len(n.out))
                    if calls(n) and any(o != "replicate" for o in n.out) else n for n in plan.nodes),
        params=tuple(dataclasses.replace(p, layout={**p.layout, "tp": "shard(0)"}) if len(p.shape) == 2 else p
                     for p in plan.params))
    honest = tp_split(batch_only)
    assert honest is not None
    text = _text(plan_summary(batch_only))
    assert "data parallelism over 4 = dp 2 x tp 2" in text and "shard(0) on every op" in text
    assert f"ZeRO-{plan.training.zero_stage} over dp 2" in text and "ZeRO-3's parameter sharding" in text
    assert page_data(batch_only)["tp_split"] == honest
    # without sharded weights it is plain data parallelism inside the group
    replicated = dataclasses.replace(batch_only, params=tuple(
        dataclasses.replace(p, layout={**p.layout, "tp": "replicate"}) for p in plan.params))
    assert "weights replicated over tp 2" in tp_split(replicated)["zero"]
