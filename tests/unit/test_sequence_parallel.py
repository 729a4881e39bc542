"""Sequence parallelism (passes/tp/sequence.py): which nodes are the residual stream, the layout
``--sequence-parallel`` pins, what it holds, and its refusals. The runtime runs it against one
process in the plan matrix (dp2xtp2-sp, fp32), the mixed-precision test (tp2-sp, bf16) and the
tensor-parallel runtime test (Megatron's layout with the stream split, GPT and Llama, holding less);
the planner choosing it where memory binds: tests/unit/test_search.py."""

from __future__ import annotations

import functools
import math

import pytest

from examples.models import GPT, MLP, GPTConfig
from partita.core.cluster import PRESETS
from partita.core.errors import PartitaError
from partita.core.model.capture import capture
from partita.core.model.inputs import parse_input_spec
from partita.core.model.losses import default_loss
from partita.core.pins import Pins, TrainingRequest
from partita.core.placement import shard
from partita.passes.profile import profile_model
from partita.passes.search import plan_search
from partita.passes.tp.sequence import residual_nodes, residual_shape


@functools.cache
def _profile(factory, spec: str):
    captured = capture(factory, [parse_input_spec(spec)], loss=default_loss)
    return profile_model(captured), [math.prod(shape) for shape, _ in captured.params.values()]


def _gpt():
    cfg = GPTConfig(vocab_size=50304, block_size=1024, n_layer=4, n_head=16, n_embd=1024, dropout=0.1)
    return _profile(lambda: GPT(cfg), "idx=int64[1,1024]")


def test_the_residual_stream_is_each_layers_norms_dropouts_and_adds():
    profile, _ = _gpt()
    G = profile.graph
    assert residual_shape(G) == (1, 1024, 1024)
    ops = sorted(G.nodes[n]["op"].split(".")[1] for n in residual_nodes(G) if G.nodes[n]["layer"] == "transformer.h.1")
    assert ops == ["add", "add", "dropout", "dropout", "layer_norm", "layer_norm"]
    assert all(G.nodes[n].get("layer") for n in residual_nodes(G))  # the embeddings and the head keep theirs
    assert not residual_nodes(_profile(MLP, "x=float32[4,64]")[0].graph)


def test_pinned_sequence_parallelism_splits_the_residual_stream_and_holds_less():
    """At tp = 2 on one DGX A100's NVLink: the pin puts every residual node on shard(1) (the solver
    lays the rest out around it). Its reduce-scatters and all-gathers move what the all-reduces they
    replace do, and the backward's (the regather, the input gradient's reduce-scatter) run beside the
    linears' products (passes/tp/costs.py): no slower than the layout without it. It holds less: the
    norms' and dropouts' tensors and the column-parallel linears' inputs at 1/2 (4% here, where the
    captured attention's saved scores dominate; tests/unit/test_search.py has a 175B GPT where it decides)."""
    profile, numels = _gpt()
    cluster = PRESETS["dgx-a100"].with_devices(2)
    request = TrainingRequest(global_batch=8, precision="bf16-mixed")
    pinned = plan_search(profile, numels, cluster, request, Pins(tp=2, sequence_parallel=True))
    off = plan_search(profile, numels, cluster, request, Pins(tp=2, sequence_parallel=False))
    assert pinned.sequence_parallel and not off.sequence_parallel
    assert all(pinned.choice[n].out[0] == shard(1) for n in residual_nodes(profile.graph))
    assert pinned.step_s <= off.step_s * (1 + 1e-9)
    assert pinned.memory.activations < 0.97 * off.memory.activations


def test_sequence_parallelism_is_refused_where_there_is_nothing_to_split():
    with pytest.raises(PartitaError, match="no TP group"):
        Pins(tp=1, sequence_parallel=True)
    mlp = _profile(MLP, "x=float32[4,64]")
    with pytest.raises(PartitaError, match="no residual stream") as e:
        plan_search(*mlp, PRESETS["dgx-a100"].with_devices(2), TrainingRequest(global_batch=4),
                    Pins(tp=2, sequence_parallel=True))
    assert "drop --sequence-parallel" in e.value.hint


def test_the_plan_lists_a_regather_for_each_linear_that_gathers_its_input():
    """Megatron's layout with the stream split (tests/tp_choice.py) on the example GPT at tp = 2: every
    linear whose input is all-gathered from the stream (q, k, v and the first MLP linear of each
    layer, and the head after the final norm, which takes the stream's layout) gathers it again in
    backward, listed as its own TP collective; a frozen weight's linear does not (its backward never
    reads the input), nor does anything without sequence parallelism."""
    import dataclasses

    from examples.models import gpt_tiny
    from partita.core.model.capture import capture
    from partita.core.model.graph import to_networkx
    from partita.core.tp.layout import REGATHER_PURPOSE, layout_decisions, tp_collectives
    from tests.tp_choice import pinned_choice

    G = to_networkx(capture(gpt_tiny, [parse_input_spec("idx=int64[2,16]")], loss=default_loss))
    nodes = layout_decisions(G, 2, pinned_choice(G, 2, sequence_parallel=True))
    gathered = [d for d in nodes if d.op == "aten.linear.default" and d.ins[0].fwd == "all_gather"]
    layers = {d.layer for d in gathered} - {""}
    assert len(layers) == 2 and len(gathered) == 4 * len(layers) + 1  # q, k, v, c_fc; lm_head

    def regathers(decisions, sp=True):
        listed = tp_collectives(decisions, sequence_parallel=sp)
        return sum(n for _, _, n, purpose in listed if purpose == REGATHER_PURPOSE)

    assert regathers(nodes) == len(gathered) and regathers(nodes, sp=False) == 0
    frozen = gathered[0]
    weight = dataclasses.replace(frozen.ins[1], grad="none", grad_need="none")
    edited = [dataclasses.replace(d, ins=(d.ins[0], weight, *d.ins[2:])) if d is frozen else d for d in nodes]
    assert regathers(edited) == len(gathered) - 1
