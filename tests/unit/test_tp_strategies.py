"""Tensor-parallel strategies and layouts on captured tiny models (no processes).

The rules' postconditions (view dim mapping, linear families, divisibility,
"none" gradients), every strategy of every node of the example GPT, an MLP,
HF GPT-2 and HF Llama internally consistent, the reshards of a Megatron hand
choice counted exactly, and an impossible reshard refused naming the node.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from examples.models import MLP, gpt_tiny
from partita.core.model.capture import capture
from partita.core.model.graph import to_networkx
from partita.core.model.inputs import InputSpec
from partita.core.placement import NONE, PARTIAL, REPLICATE, shard_dim
from partita.core.tp.layout import layout_decisions, tp_collectives
from partita.core.tp.strategies import node_strategies, unsupported_ops
from partita.core.tp.view_rules import view_dim
from tests.tp_choice import MEGATRON, pinned_choice
from tests.workers.tp_worker import MLP_PINS, hf_gpt2_tiny, hf_llama_tiny


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


_GRAPHS: dict = {}


def graph(name: str):
    if name not in _GRAPHS:
        if name == "mlp":
            c = capture(lambda: MLP(16, 32, 8, 3), [InputSpec("x", torch.float32, (4, 16))], loss=F.mse_loss,
                        targets=InputSpec("targets", torch.float32, (4, 8)))
        else:
            factory = {"gpt": gpt_tiny, "hf-gpt2": hf_gpt2_tiny, "hf-llama": hf_llama_tiny}[name]
            c = capture(factory, [InputSpec("idx" if name == "gpt" else "input_ids", torch.int64, (2, 16))],
                        loss=gpt_loss)
        _GRAPHS[name] = to_networkx(c)
    return _GRAPHS[name]


def by_name(G, node: str, t: int) -> dict:
    return {s.name: s for s in node_strategies(G, node, t)}


def test_view_maps_a_shard_to_the_leading_dim_of_its_group():
    assert view_dim((2, 16, 64), (2, 16, 4, 16), 2) == 2  # (B,T,C) -> (B,T,H,hd)
    assert view_dim((2, 16, 4, 16), (2, 16, 64), 2) == 2  # and back
    assert view_dim((2, 16, 256), (32, 256), 2) == 1  # flatten(0, -2): the vocab dim
    assert view_dim((2, 16, 256), (32, 256), 0) == 0  # the batch leads its group
    assert view_dim((2, 16, 256), (32, 256), 1) is None  # T is not the leading factor
    assert view_dim((2, 1, 16), (2, 16), 2) == 1  # unit dims join a group
    assert view_dim((2, 16, 4, 16), (2, 16, 64), 3) is None  # hd is inside C


def test_linear_families_and_divisibility():
    G = graph("gpt")
    s = by_name(G, "linear", 2)  # q_proj of layer 0: x (2, 16, 64), w (64, 64), b (64)
    assert list(s)[0] == "replicate"
    col, row = s["col"], s["row"]
    assert (col.ins, col.out, col.grads) == ((REPLICATE, "shard(0)", "shard(0)"), ("shard(2)",),
                                             (PARTIAL, "shard(0)", "shard(0)"))
    assert (row.ins, row.out, row.grads) == (("shard(2)", "shard(1)", REPLICATE), (PARTIAL,),
                                             ("shard(2)", "shard(1)", PARTIAL))
    assert s["shard(0)"].ins == ("shard(0)", REPLICATE, REPLICATE) and col.compute_fraction == 0.5
    assert set(by_name(G, "linear", 8)) == {"replicate", "col", "row", "shard(1)"}  # B=2 is too small
    assert set(by_name(G, "linear", 3)) == {"replicate"}  # 3 divides none of 2, 16, 64


def test_gradients_are_none_where_none_flows():
    G = graph("gpt")
    vocab = by_name(G, "embedding", 2)["vocab"]
    assert vocab.ins == ("shard(0)", REPLICATE) and vocab.out == (PARTIAL,) and vocab.grads == ("shard(0)", NONE)
    ce = by_name(G, "cross_entropy_loss", 2)["vocab"]
    assert ce.ins == ("shard(1)", REPLICATE) and ce.grads == ("shard(1)", NONE) and ce.out == (REPLICATE,)
    assert [k for k, _ in ce.internal] == ["all_reduce"] * 3
    M = graph("mlp")  # the model input is a float tensor but gets no gradient
    assert by_name(M, "linear", 2)["col"].grads == (NONE, "shard(0)", "shard(0)")
    # no partial integer tensors: the targets' reshape offers shards only
    assert PARTIAL not in {p for s in node_strategies(G, "reshape_1", 2) for p in s.out}


def test_partial_rules():
    G = graph("gpt")
    add = by_name(G, "add_1", 2)  # residual: dropout + dropout_1
    assert add[PARTIAL].ins == (PARTIAL, PARTIAL) and add[PARTIAL].grads == (REPLICATE, REPLICATE)
    assert PARTIAL not in by_name(G, "gelu", 2)  # no partial through a nonlinear op
    L = graph("hf-llama")
    muls = [n for n, a in L.nodes(data=True) if a["op"] == "aten.mul.Tensor" and len(a["inputs"]) == 2
            and a["module"].endswith("layers.0.input_layernorm")]
    s = by_name(L, muls[0], 2)  # RMSNorm's x * rsqrt(mean(x^2) + eps)
    assert s[PARTIAL].ins == (PARTIAL, REPLICATE) and s[PARTIAL].grads == (REPLICATE, PARTIAL)
    assert s["partial(1)"].ins == (REPLICATE, PARTIAL)
    means = [n for n, a in L.nodes(data=True) if a["op"] == "aten.mean.dim"]
    mean = by_name(L, means[0], 2)  # over the last dim, keepdim
    assert mean["shard(2)"].out == (PARTIAL,) and mean["shard(0)"].out == ("shard(0)",)


@pytest.mark.parametrize("name", ["gpt", "mlp", "hf-gpt2", "hf-llama"])
@pytest.mark.parametrize("t", [2, 4])
def test_every_strategy_is_consistent(name, t):
    G = graph(name)
    offered = 0
    for n, a in G.nodes(data=True):
        strategies = node_strategies(G, n, t)
        assert strategies[0].name == "replicate" and set(strategies[0].ins) <= {REPLICATE}
        assert len({s.name for s in strategies}) == len(strategies), n
        in_shapes = [G.nodes[src]["shapes"][0] if G.nodes[src]["shapes"] else () for src in a["inputs"]]
        if a["op"].endswith("getitem"):
            in_shapes = [G.nodes[a["inputs"][0]]["shapes"][a["args"][1]]]
        for s in strategies:
            offered += 1
            assert len(s.ins) == len(a["inputs"]) == len(s.grads), (n, s)
            assert len(s.out) == (len(a["shapes"]) if a["kind"] != "output" else 0), (n, s)
            for p, shape in [*zip(s.ins, in_shapes), *zip(s.grads, in_shapes), *zip(s.out, a["shapes"])]:
                d = shard_dim(p)
                if d is not None:
                    assert d < len(shape) and shape[d] % t == 0 and shape[d] >= t, (n, s.name, p, shape)
    assert offered > 2 * G.number_of_nodes()  # sharded strategies exist, not only replicate


def test_unsupported_ops_are_listed():
    assert unsupported_ops(graph("gpt")) == {}
    llama = unsupported_ops(graph("hf-llama"))
    assert "aten.index.Tensor" in llama and "aten.cumsum.default" in llama
    assert "aten.arange.default" not in llama  # a factory: replicated by nature


def test_megatron_choice_reshards_exactly():
    G = graph("gpt")  # 2 layers, B=2, T=16, C=64, V=256
    decisions = layout_decisions(G, 2, pinned_choice(G, 2, MEGATRON))
    strategy = {d.name: d.strategy for d in decisions}
    assert [strategy[n] for n in ("linear", "linear_1", "linear_2", "linear_3", "linear_4")] == [
        "col", "col", "col", "row", "col"]  # q, k, v, c_proj, c_fc
    assert strategy["scaled_dot_product_attention"] == "heads"
    act = 2 * 16 * 64 * 4
    assert tp_collectives(decisions) == [
        ("all_reduce", 32 * 4, 3, "op-internal (vocab-parallel cross-entropy)"),  # max, sum exp, target
        ("all_reduce", 64 * 4, 4, "backward reshard"),  # row biases' gradients (added on rank 0)
        ("all_reduce", act, 5, "forward reshard"),  # 4 row-parallel outputs + the vocab embedding
        ("all_reduce", act, 9, "backward reshard"),  # 4 col linears' inputs per layer + lm_head
    ]
    M = graph("mlp")  # col, row, col: layer 0's input is the model input (no gradient)
    assert tp_collectives(layout_decisions(M, 2, pinned_choice(M, 2, MLP_PINS))) == [
        ("all_gather", 4 * 8 * 4, 1, "forward reshard"),  # layer 2's output into the replicated loss
        ("all_reduce", 32 * 4, 1, "backward reshard"),  # layer 1's bias gradient
        ("all_reduce", 4 * 32 * 4, 1, "backward reshard"),  # layer 2's input
        ("all_reduce", 4 * 32 * 4, 1, "forward reshard"),  # layer 1's partial output
    ]


def test_layout_refuses_an_impossible_reshard():
    G = graph("gpt")
    choice = pinned_choice(G, 2, {})  # everything replicated
    choice["add_1"] = by_name(G, "add_1", 2)[PARTIAL]  # replicate -> partial has no collective
    with pytest.raises(ValueError, match="node add_1 .*replicate -> partial"):
        layout_decisions(G, 2, choice)
    assert all(d.strategy == "replicate" and not d.internal for d in layout_decisions(G, 2, {}))
    assert tp_collectives(layout_decisions(G, 2, {})) == []
