"""Any global batch: the TP search weighs only strategies valid at the micro-batch it runs, and a
model whose graph changes with the batch is laid out on its own micro-batch capture (issue 12)."""

from __future__ import annotations

import pytest

from examples.models import gpt_tiny
from partita.compiler.compile import compile_model
from partita.core.cluster import load_cluster
from partita.core.model.capture import capture
from partita.core.model.graph import annotate_batch_shapes, shape_at, to_networkx
from partita.core.model.inputs import parse_input_spec
from partita.core.model.losses import resolve_loss
from partita.core.options import Options
from partita.core.pins import TrainingRequest
from partita.core.placement import shard_dim
from partita.core.tp.strategies import node_strategies
from partita.passes.flops import annotate_flops
from partita.passes.profile import profile_model
from partita.passes.tp.layout_costs import tp_choice
from tests.oracles import strategies_at


def _profile(batch: int):
    return profile_model(capture(gpt_tiny, [parse_input_spec(f"idx=int64[{batch},64]")]))


def test_shapes_at_a_micro_batch_come_from_two_captures() -> None:
    p = _profile(16)
    assert annotate_batch_shapes(p.graph, to_networkx(capture(gpt_tiny, [parse_input_spec("idx=int64[32,64]")])))
    five = to_networkx(capture(gpt_tiny, [parse_input_spec("idx=int64[5,64]")]))
    for n in p.graph.nodes:  # the linear fit of 16 and 32 predicts the capture at 5, node for node
        for i, shape in enumerate(five.nodes[n]["shapes"]):
            assert shape_at(p.graph, n, i, 5) == tuple(shape), n


def test_a_batch_shard_valid_at_the_captured_batch_is_not_offered_where_it_does_not_divide() -> None:
    p = _profile(16)
    annotate_batch_shapes(p.graph, to_networkx(capture(gpt_tiny, [parse_input_spec("idx=int64[32,64]")])))
    names = lambda ss: {s.name for s in ss}
    assert "shard(0)" in names(node_strategies(p.graph, "embedding", 2))  # (16, 64, C): 16 splits in 2
    assert "shard(0)" not in names(strategies_at(p.graph, "embedding", 2, 5))  # (5, 64, C): 5 does not
    assert "shard(0)" in names(strategies_at(p.graph, "embedding", 2, 4))
    # the hidden dim does not grow with the batch: still split at 5
    assert "dim" in names(strategies_at(p.graph, "embedding", 2, 5))
    # every strategy the ILP picks at micro-batch 5 is one the capture at 5 offers
    five = to_networkx(capture(gpt_tiny, [parse_input_spec("idx=int64[5,64]")]))
    request = TrainingRequest(global_batch=10, precision="fp32", optimizer="adamw")
    choice = tp_choice(p, load_cluster("local", devices=2), request, 5, 2)
    for n, s in choice.items():
        assert any(o.name == s.name and o.ins == s.ins and o.out == s.out for o in node_strategies(five, n, 2)), n


def test_global_batch_other_than_the_input_plans() -> None:
    """--batch 10 with an input of 16: micro-batch 5 on tp=2 plans (was: "strategy 'shard(0)' chosen at
    the full batch is not valid at micro-batch 5")."""
    plan = compile_model(gpt_tiny, Options(inputs=[parse_input_spec("idx=int64[16,64]")],
                                           cluster=load_cluster("local", devices=4), batch=10, tp=2, pp=1)).plan
    assert (plan.mesh.dp, plan.mesh.tp, plan.training.micro_batch_size) == (2, 2, 5)
    five = to_networkx(capture(gpt_tiny, [parse_input_spec("idx=int64[5,64]")], loss=resolve_loss(None)))
    for n in plan.nodes:  # every split tensor splits evenly at the micro-batch the runtime runs
        for shape, placement in zip(five.nodes[n.name]["shapes"], n.out):
            if shard_dim(placement) is not None:
                assert shape[shard_dim(placement)] % 2 == 0, (n.name, placement, shape)


def test_a_graph_that_changes_with_the_batch_is_laid_out_on_its_micro_batch_capture() -> None:
    """HF Llama at batch 1 has a node more than at batch 4: the plan's nodes are the micro-batch's."""
    pytest.importorskip("transformers")
    from examples.models import hf_llama

    def small():
        return hf_llama(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                        vocab_size=256, max_position_embeddings=128)

    result = compile_model(small, Options(inputs=[parse_input_spec("input_ids=int64[4,64]")],
                                          cluster=load_cluster("dgx-a100", devices=4), micro_batch_size=1, tp=2, pp=2))
    plan = result.plan
    one = to_networkx(capture(small, [parse_input_spec("input_ids=int64[1,64]")], loss=resolve_loss(None)))
    assert plan.training.micro_batch_size == 1
    assert [n.name for n in plan.nodes] == list(one.nodes)
    assert any("laid out on the model captured at micro-batch 1" in n for n in plan.solver.notes)
    assert {n.stage % plan.mesh.pp for n in plan.nodes} == {0, 1}  # virtual stages, if interleaved, on 2 ranks
    assert {n.stage for n in plan.nodes} == set(range(len(plan.stages)))
    names = {n.name for n in plan.nodes}
    assert all(st.first_node in names and st.last_node in names for st in plan.stages)


def test_the_batch_shape_capture_doubles_as_the_micro_batch_graph(monkeypatch) -> None:
    """The second capture is taken at the likely micro-batch (B over dp); when the plan runs it, the
    plan's graph is that capture: two captures, not three, and the same nodes, shapes and source
    lines as a capture made for it."""
    import partita.compiler.compile as compile_module

    batches = []
    real = compile_module.capture

    def counting(model, inputs, **kwargs):
        batches.append(inputs[0].shape[0])
        return real(model, inputs, **kwargs)

    monkeypatch.setattr(compile_module, "capture", counting)
    result = compile_model(gpt_tiny, Options(inputs=[parse_input_spec("idx=int64[16,64]")],
                                             cluster=load_cluster("local", devices=4), dp=2, tp=2, pp=1))
    plan = result.plan
    assert plan.training.micro_batch_size == 8 and batches == [16, 8]
    eight = to_networkx(capture(gpt_tiny, [parse_input_spec("idx=int64[8,64]")], loss=resolve_loss(None)))
    assert [n.name for n in plan.nodes] == list(eight.nodes)
    annotate_flops(eight)  # the plan's per-node work is the micro-batch's, as a capture made for it says
    assert {n.name: n.flops_fwd for n in plan.nodes} == {n: a["flops_fwd"] for n, a in eight.nodes(data=True)}
    # the linear fit (16, 8) predicts the capture at 5, node for node
    five = to_networkx(capture(gpt_tiny, [parse_input_spec("idx=int64[5,64]")], loss=resolve_loss(None)))
    G = result.profile.graph
    for n in G.nodes:
        for i, shape in enumerate(five.nodes[n]["shapes"]):
            assert shape_at(G, n, i, 5) == tuple(shape), n


def test_the_tp_problem_is_priced_again_once_the_batch_shapes_are_known():
    """build_problem caches each (tp, micro-batch) layout per graph; learning the shapes at other
    batches (annotate_batch_shapes) changes which strategies are valid there, so it is not reused."""
    from partita.passes.tp.problem import TPSetting, build_problem

    p = _profile(16)
    cluster = load_cluster("local", devices=2)
    setting = TPSetting(2, 5, 16, "fp32")
    names = lambda problem: {s.name for s in problem.strategies_of["embedding"]}
    assert "shard(0)" in names(build_problem(p.graph, setting, cluster, repeated=p.repeated))  # shapes unknown
    annotate_batch_shapes(p.graph, to_networkx(capture(gpt_tiny, [parse_input_spec("idx=int64[32,64]")])))
    assert "shard(0)" not in names(build_problem(p.graph, setting, cluster, repeated=p.repeated))  # 5 rows
