"""The tensor-parallel ILP: equal to exhaustive search on small graphs, and Megatron's layouts
rediscovered from costs alone on graphs captured from examples/models.py under fake tensors."""

from __future__ import annotations

import functools

import pytest

from examples.models import GPT, MLP, GPTConfig, hf_gpt2
from partita.core.cluster import PRESETS
from partita.core.errors import InfeasibleError
from partita.core.model.capture import capture
from partita.core.model.inputs import parse_input_spec
from partita.core.model.losses import default_loss
from partita.core.options import Options
from partita.core.tp.layout import layout_decisions
from partita.passes.profile import profile_model
from partita.passes.tp.ilp import solve_tp
from partita.passes.tp.problem import TPSetting, build_problem, evaluate
from tests.oracles import exhaustive_choice

A100 = PRESETS["dgx-a100"]


@functools.cache
def _profile(kind: str, layers: int = 1, width: int = 4096, heads: int = 32, vocab: int = 50304,
             spec: str = "idx=int64[1,2048]"):
    if kind == "mlp":
        captured = capture(lambda: MLP(width, 4 * width, width, 2), [parse_input_spec(spec)],
                           loss=lambda out, y: ((out - y) ** 2).mean(), targets=parse_input_spec(
                               spec.replace("x=", "y=")))
    elif kind == "mlp4":  # four equal layers: one repeated block whose first layer reads the model input
        captured = capture(lambda: MLP(width, width, width, 4), [parse_input_spec(spec)], loss=default_loss)
    elif kind == "gpt":
        cfg = GPTConfig(vocab_size=vocab, block_size=2048, n_layer=layers, n_head=heads, n_embd=width)
        captured = capture(lambda: GPT(cfg), [parse_input_spec(spec)], loss=default_loss)
    else:
        captured = capture(lambda: hf_gpt2(n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocab,
                                           n_positions=2048), [parse_input_spec(spec)], loss=default_loss)
    return profile_model(captured)


def _problem(prof, t, mb=None, *, tie=True, **setting):
    s = TPSetting(t, mb or prof.batch_size, prof.batch_size, "bf16-mixed", **setting)
    return build_problem(prof.graph, s, A100, repeated=prof.repeated if tie else ())


def _by_module(prof, choice, op_suffix):
    return {prof.graph.nodes[n]["module"]: s.name for n, s in choice.items()
            if prof.graph.nodes[n]["op"].endswith(op_suffix)}


# -- the ILP's optimum is the exhaustive optimum ------------------------------------------------


@pytest.mark.parametrize("case", ["mlp t=2", "mlp t=4", "mlp t=4 memory-bound", "gpt 1 layer t=2",
                                  "gpt 2 layers tied t=2"])
def test_ilp_objective_equals_exhaustive_optimum(case):
    if case.startswith("mlp"):
        prof = _profile("mlp", width=1024, spec="x=float32[512,1024]")
    elif "1 layer" in case:
        prof = _profile("gpt", layers=1, width=1024, heads=16, vocab=8192, spec="idx=int64[2,256]")
    else:
        prof = _profile("gpt", layers=2, width=512, heads=8, vocab=4096, spec="idx=int64[2,128]")
    t = 4 if "t=4" in case else 2
    problem = _problem(prof, t, dp=4)
    if "memory-bound" in case:  # a budget between the smallest layout and the unconstrained optimum
        free = solve_tp(problem)
        smallest = solve_tp(problem, objective="memory")
        assert smallest.memory_bytes < free.memory_bytes
        # a quarter of the way: half-way (37.8 of 40.9 MB on the MLP at t=4) a layout as fast as the
        # unconstrained one fits (the optimum is not unique), and the budget would not bind
        budget = smallest.memory_bytes + (free.memory_bytes - smallest.memory_bytes) / 4
        problem = _problem(prof, t, dp=4, memory_budget=budget)
    ilp, exact = solve_tp(problem), exhaustive_choice(problem)
    assert ilp.report.status == "OPTIMAL"
    assert ilp.report.objective_s == pytest.approx(exact.report.objective_s, rel=1e-7)
    # the solver's objective is the cost model's value of the choice it returns
    assert evaluate(problem, ilp.class_choice).report.objective_s == pytest.approx(ilp.report.objective_s, rel=1e-7)
    if "memory-bound" in case:
        assert ilp.memory_bytes <= problem.setting.memory_budget
        assert ilp.report.objective_s > free.report.objective_s  # the budget binds


def test_tying_repeated_layers_costs_no_more_than_untied_here_and_shrinks_the_model():
    prof = _profile("gpt", layers=4, width=512, heads=8, vocab=4096, spec="idx=int64[2,128]")
    tied, untied = _problem(prof, 2), _problem(prof, 2, tie=False)
    assert len(tied.classes) < len(untied.classes) / 2
    a, b = solve_tp(tied), solve_tp(untied)
    assert a.report.objective_s >= b.report.objective_s * (1 - 1e-9)  # a restriction...
    assert a.report.objective_s == pytest.approx(b.report.objective_s, rel=1e-3)  # ...that costs nothing here


def test_deep_model_is_as_small_as_one_layer():
    two, eight = _profile("gpt", layers=2), _profile("gpt", layers=8)
    assert len(_problem(eight, 8).classes) == len(_problem(two, 8).classes)


# -- Megatron's layouts from costs alone (GPT, n_embd 4096, seq 2048, dgx-a100, t=8) -------------


def test_megatron_mlp_and_attention_by_heads():
    prof = _profile("gpt", layers=2)
    sol = solve_tp(_problem(prof, 8, 1, dp=16, memory_budget=A100.usable_memory))
    linears = _by_module(prof, sol.choice, "linear.default")
    for i in range(2):
        h = f"transformer.h.{i}"
        assert linears[f"{h}.mlp.c_fc"] == "col" and linears[f"{h}.mlp.c_proj"] == "row"
        assert {linears[f"{h}.attn.{p}_proj"] for p in "qkv"} == {"col"}
        assert linears[f"{h}.attn.c_proj"] == "row"
    assert set(_by_module(prof, sol.choice, "scaled_dot_product_attention.default").values()) == {"heads"}

    # one forward and one backward all-reduce of activations per MLP block (and one forward per attention block)
    decisions = layout_decisions(prof.graph, 8, sol.choice, elem_bytes=2)
    act = 2 * 2048 * 4096  # (1, 2048, 4096) bf16
    module = {d.name: d.module for d in decisions}
    for i in range(2):
        layer, mlp = f"transformer.h.{i}", f"transformer.h.{i}.mlp"
        # the attention's and the MLP's outputs, each reduced once: in the block or where it joins the residual
        fwd = [lay for d in decisions for lay in d.ins
               if lay.fwd == "all_reduce" and lay.bytes == act and module[lay.src].startswith(layer)]
        bwd = [lay for d in decisions for lay in d.ins  # the MLP input's gradient
               if lay.bwd == "all_reduce" and lay.bytes == act and d.module.startswith(mlp)]
        assert len(fwd) == 2 and len(bwd) == 1


def test_vocabulary_parallel_head_and_cross_entropy_and_tied_embedding():
    prof = _profile("gpt", layers=2)
    sol = solve_tp(_problem(prof, 8, 1, dp=16, memory_budget=A100.usable_memory))
    assert _by_module(prof, sol.choice, "linear.default")["lm_head"] == "col"  # vocabulary columns
    assert set(_by_module(prof, sol.choice, "cross_entropy_loss.default").values()) == {"vocab"}
    # the token table is sharded too (its hidden dim: one all-gather, cheaper than vocab's all-reduce)
    wte = next(n for n, a in prof.graph.nodes(data=True) if a.get("param_name") == "transformer.wte.weight")
    assert sol.choice[wte].name != "replicate"

    tied = _profile("hf", layers=2, spec="input_ids=int64[1,2048]")  # GPT-2 ties wte and lm_head
    sol = solve_tp(_problem(tied, 8, 1, dp=16, memory_budget=A100.usable_memory))
    emb = [s.name for n, s in sol.choice.items() if tied.graph.nodes[n]["module"].endswith("wte")
           and tied.graph.nodes[n]["op"].endswith("embedding.default")]
    assert emb == ["vocab"]


def test_small_widths_stay_replicated():
    prof = _profile("gpt", layers=1, width=64, heads=4, vocab=256, spec="idx=int64[2,16]")
    sol = solve_tp(_problem(prof, 8))
    assert {s.name for s in sol.choice.values()} == {"replicate"}


# -- failures are reported -------------------------------------------------------------------


def test_infeasible_budget_names_the_constraint_and_what_to_relax():
    prof = _profile("gpt", layers=2)
    with pytest.raises(InfeasibleError, match=r"memory: the smallest layout needs [\d.]+ GB per device.*"
                                              r"budget 1\.0 GB at tp=8") as e:
        solve_tp(_problem(prof, 8, 1, memory_budget=1e9))
    assert "raise tp, add devices, or lower the micro-batch" in str(e.value)


def test_unknown_solver_is_refused():
    prof = _profile("mlp", width=1024, spec="x=float32[512,1024]")
    with pytest.raises(ValueError, match="not one of"):
        solve_tp(_problem(prof, 2), solver="GUROBI")


# -- tying shares a layout, never a member's own inputs' needs ----------------------------------


def test_tied_layers_keep_their_own_backward_reshards():
    """An MLP's four Linear layers are one repeated class. Layer 0 reads the model input (no
    gradient flows into it); layers 1-3 read the previous layer's output, so where the plan splits
    them their input's gradient must be resharded in backward (a column-split linear's partial
    gradient reduce-scattered back to the shard(1) its producer holds). The first member's
    strategy used to be copied to all four, with its "no gradient" input: the run then failed in
    its first backward (issue 16)."""
    from partita.compiler.compile import compile_model
    from partita.core.cluster import load_cluster
    from partita.core.placement import NONE
    from partita.core.tp.strategies import node_strategies
    from partita.core.tp.vocabulary import grad_convention, reshard_kind

    result = compile_model(lambda: MLP(1024, 1024, 1024, 4),
                           Options(inputs=[parse_input_spec("x=float32[128,1024]")],
                                   cluster=load_cluster("local", devices=2), world_size=2, tp=2))
    plan, G = result.plan, result.profile.graph
    assert [(r.prefix, r.indices) for r in result.profile.repeated] == [("layers", [0, 1, 2, 3])]
    linears = {d.module: d for d in plan.nodes if d.op == "aten.linear.default"}
    assert set(linears) == {f"layers.{i}" for i in range(4)}
    assert len({d.strategy for d in linears.values()}) == 1  # tied: one layout for the four
    assert linears["layers.0"].strategy != "replicate"  # the case that failed: a split layer
    for i in range(4):
        x = linears[f"layers.{i}"].ins[0]  # the activation (then weight, bias)
        if i == 0:
            assert (x.grad, x.bwd) == (NONE, "none")
            continue
        assert x.grad != NONE and x.grad_need == grad_convention(x.have)
        assert x.bwd == reshard_kind(x.grad, x.grad_need) != "none", (i, x)
    # every node's decision is its own strategy's, input for input
    for d in plan.nodes:
        own = next(s for s in node_strategies(G, d.name, 2) if s.name == d.strategy)
        assert tuple(lay.grad for lay in d.ins) == own.grads, d.name


def test_a_member_offered_other_layouts_gets_its_own_class():
    """Tying shares a choice among members whose strategy lists agree layout for layout; a member
    offered other layouts (here: layer 2's linear without "col") is solved on its own."""
    from partita.core.tp.strategies import node_strategies

    prof = _profile("mlp4", width=256, spec="x=float32[64,256]")
    G = prof.graph
    lin2 = next(n for n, a in G.nodes(data=True) if a["module"] == "layers.2" and a["op"] == "aten.linear.default")

    def strategies(G, n, t):
        return [s for s in node_strategies(G, n, t) if n != lin2 or s.name != "col"]

    s = TPSetting(2, 64, 64, "fp32")
    tied = build_problem(G, s, A100, repeated=prof.repeated)
    other = build_problem(G, s, A100, repeated=prof.repeated, strategies=strategies)
    assert len(other.classes) == len(tied.classes) + 1 and other.class_of[lin2] == lin2
    sol = solve_tp(other)
    assert sol.choice[lin2].name != "col"
    assert all(st in strategies(G, n, 2) for n, st in sol.choice.items())
