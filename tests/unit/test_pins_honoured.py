"""Every pin honoured exactly (issue 45): each axis pinned off and on, checked in what the plan lays
out (its nodes' placements, its parameters' layouts, its stages and ranks, its step's memory), not in
the label the plan gives the axis.

Sequence parallelism is the case the issue found: with it off, the TP solver split norms, dropouts
and residual adds along the sequence anyway (on a GPT whose logits make memory bind), while the plan
said ``sequence_parallel = false``. The sequence dims are found here from sizes alone (the model's
sequence length, 1000, is no other dim's size), not from the planner's analysis
(passes/tp/sequence.py ``sequence_dims``).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

from partita.compiler.compile import compile_model
from partita.core.model.capture import capture
from partita.core.model.graph import to_networkx
from partita.core.model.inputs import parse_input_spec
from partita.core.model.losses import default_loss
from partita.core.options import Options
from partita.core.placement import NONE, REPLICATE, shard, shard_dim

SEQ = 1000  # the GPTs' sequence length: no other dim of theirs is a multiple of it
TP = 2


def _gpt(flash: bool, **kw: int) -> Any:
    from examples.models import GPT, GPTConfig

    cfg = dict(vocab_size=50304, block_size=SEQ, n_layer=2, n_head=16, n_embd=1024, dropout=0.1, flash=flash)
    return lambda: GPT(GPTConfig(**{**cfg, **kw}))


def _tiny() -> Any:
    from examples.models import gpt_tiny

    return gpt_tiny()


@functools.cache
def _plan(model: str, **options: Any) -> Any:
    """A model planned with ``options``: the plan, and for the sequence-parallel GPTs the graph its
    nodes were laid out on."""
    if model.startswith("gpt-"):  # the GPT of the sequence-parallel cases: captured at batch 1, 16 a step
        factory, batch = _gpt(flash=model == "gpt-sdpa"), 16
        spec, defaults = f"idx=int64[1,{SEQ}]", dict(cluster="dgx-h100", devices=TP, batch=batch, tp=TP,
                                                     precision="bf16-mixed")
    elif model == "mixtral":
        from tests.golden import MODELS

        factory, spec = MODELS["mixtral"]
        defaults = {}
    else:
        factory, spec, defaults = _tiny, "idx=int64[8,64]", dict(devices=2)
    result = compile_model(factory, Options(inputs=[spec], **{**defaults, **options}), name=model)
    plan = result.plan
    if not model.startswith("gpt-"):
        return plan, None
    # the graph the plan's nodes name, at the micro-batch (its own capture: its shapes there)
    at = parse_input_spec(spec.replace("[1,", f"[{plan.training.micro_batch_size},"))
    return plan, to_networkx(capture(factory, [at], loss=default_loss))


def _sequence_splits(plan: Any, G: Any) -> list[str]:
    """Every tensor a node makes or reads split along the sequence over the TP group: a shard of a
    dim of SEQ positions, or of a batch x sequence dim whose slices are not whole sequences."""
    def splits(node: str, index: int, placement: str) -> bool:
        d = shard_dim(placement)
        size = G.nodes[node]["shapes"][index][d] if d is not None else 0
        return d is not None and size % SEQ == 0 and (size // SEQ) % plan.mesh.tp != 0

    found = []
    for n in plan.nodes:
        assert n.name in G.nodes, n.name
        found += [f"{n.name} out[{i}] {p}" for i, p in enumerate(n.out) if splits(n.name, i, p)]
        found += [f"{n.name} <- {x.src} {x.need}" for x in n.ins if splits(x.src, x.index, x.need)]
    return found


def _residual_stream(plan: Any, G: Any) -> list[Any]:
    """The layers' norms, dropouts and residual adds on batch x sequence x hidden."""
    mb = plan.training.micro_batch_size
    return [n for n in plan.nodes if n.layer and n.op.split(".")[1:2] in (["add"], ["layer_norm"], ["dropout"])
            and tuple(G.nodes[n.name]["shapes"][0]) == (mb, SEQ, 1024)]


@pytest.mark.parametrize("model", ["gpt-matmul", "gpt-sdpa"])
def test_sequence_parallelism_off_splits_nothing_along_the_sequence_and_on_splits_the_stream(model):
    """At tp = 2 on a GPT with written-out attention and one with SDPA: off, no node makes or reads a
    tensor split along the sequence (plain Megatron tensor parallelism: the stream whole on both
    ranks); on, every norm, dropout and residual add of the layers holds half the sequence."""
    off, G = _plan(model, sequence_parallel=False)
    assert off.mesh.tp == TP and not off.training.sequence_parallel
    assert _sequence_splits(off, G) == []
    stream = _residual_stream(off, G)
    assert len(stream) == 12  # 2 layers x (2 norms, 2 dropouts, 2 adds)
    assert all(n.out[0] != shard(1) for n in stream)
    assert any(p.layout.get("tp", REPLICATE) != REPLICATE for p in off.params)  # still tensor parallel

    on, G = _plan(model, sequence_parallel=True)
    assert on.training.sequence_parallel
    assert [n.out[0] for n in _residual_stream(on, G)] == [shard(1)] * 12


def test_tensor_parallel_degree():
    """tp = 2: the layers' weights are split over the pair (Megatron's column then row linears), each
    stage's ranks are tp x dp; tp = 1: every node runs whole, nothing split or partial."""
    two, _ = _plan("tiny", tp=2)
    assert two.mesh.tp == 2 and all(len(s.ranks) == 2 * two.mesh.dp for s in two.stages)
    split = [p.name for p in two.params if shard_dim(p.layout.get("tp", REPLICATE)) is not None]
    assert any(name.endswith("c_fc.weight") for name in split)
    one, _ = _plan("tiny", tp=1)
    assert one.mesh.tp == 1 and one.mesh.dp == 2
    assert {p for n in one.nodes for p in (*n.out, *(x.need for x in n.ins))} <= {REPLICATE}
    assert all(p.layout.get("tp", REPLICATE) == REPLICATE for p in one.params)


def test_pipeline_degree_and_schedule():
    """pp = 2: the nodes on two stages of disjoint ranks, every parameter on its users' stage; a pinned
    schedule is the plan's, and the interleaved one puts two chunks on each rank; pp = 1: one stage."""
    two, _ = _plan("tiny", pp=2)
    assert len(two.stages) == 2 and two.training.schedule == "1f1b"
    assert {n.stage for n in two.nodes if n.op != "output"} == {0, 1}
    assert not set(two.stages[0].ranks) & set(two.stages[1].ranks)
    gpipe, _ = _plan("tiny", pp=2, schedule="gpipe")
    assert gpipe.training.schedule == "gpipe" and len(gpipe.stages) == 2
    chunks, _ = _plan("tiny", pp=2, schedule="interleaved-1f1b", devices=2, batch=8)
    assert chunks.training.schedule == "interleaved-1f1b" and chunks.training.chunks == 2
    assert [tuple(s.ranks) for s in chunks.stages] == [(0,), (1,), (0,), (1,)]
    one, _ = _plan("tiny", pp=1)
    assert len(one.stages) == 1 and {n.stage for n in one.nodes} <= {0}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stage_shards_what_it_says(stage):
    """ZeRO-z over dp = 2 holds its state as the stage says, against ZeRO-0's: the optimizer at 1/2
    from stage 1, the gradients from 2, the parameters (gathered by units) at 3."""
    plain, _ = _plan("tiny", zero=0, dp=2)
    plan, _ = _plan("tiny", zero=stage, dp=2)
    assert plan.training.zero_stage == stage and plan.mesh.dp == 2
    m, m0 = plan.predicted.memory, plain.predicted.memory
    assert m.optimizer == pytest.approx(m0.optimizer / (2 if stage >= 1 else 1), rel=0.01)
    assert m.grads == pytest.approx(m0.grads / (2 if stage >= 2 else 1), rel=0.01)
    assert m.params == pytest.approx(m0.params / (2 if stage == 3 else 1), rel=0.01)
    assert bool(plan.training.zero_units) == (stage == 3)


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_recompute_mode_on_every_stage(mode):
    plan, _ = _plan("tiny", recompute=mode, pp=2)
    assert [s.recompute for s in plan.stages] == [mode, mode]


def test_micro_batches_and_offload():
    """The pinned micro-batch size and count make the step (size x count x dp = the global batch);
    offload keeps the optimizer's state in host memory, none of it on the GPU (on a CPU cluster the
    host's memory is the device's, and the state counts against it there)."""
    plan, _ = _plan("tiny", micro_batch_size=2, dp=2)
    t = plan.training
    assert (t.micro_batch_size, t.grad_accum_steps) == (2, 2) and 2 * 2 * plan.mesh.dp == t.global_batch
    counted, _ = _plan("tiny", grad_accum_steps=4, dp=2)
    assert (counted.training.micro_batch_size, counted.training.grad_accum_steps) == (1, 4)
    off, _ = _plan("tiny", offload="optimizer", cluster="dgx-a100")
    assert off.training.offload == "optimizer"
    assert off.predicted.memory.optimizer == 0 and off.predicted.memory.host > 0
    kept, _ = _plan("tiny", offload="none", cluster="dgx-a100")
    assert kept.training.offload == "none" and kept.predicted.memory.host == 0 < kept.predicted.memory.optimizer


def test_expert_parallel_degree():
    """ep = 2 on four data-parallel ranks: each MoE layer's expert weights split over pairs of ranks
    (the plan's ep layout), the others whole; ep = 1: no expert split."""
    two, _ = _plan("mixtral", devices=4, dp=4, ep=2)
    assert two.mesh.ep == 2
    split = [p for p in two.params if p.layout.get("ep", NONE) != NONE]
    assert split and all(p.layout["ep"] == shard(0) and "experts" in p.name for p in split)
    one, _ = _plan("mixtral", devices=4, dp=4, ep=1)
    assert one.mesh.ep == 1 and not any("ep" in p.layout for p in one.params)
