"""Routing as it falls (issue 43): the slowest rank of an expert group sets the step.

core/experts.py's load (the slowest of ep ranks' rows over the mean) worked by hand; a pinned
``--expert-load`` and a router profile priced in both searches (the experts' matmuls and the ops
between, and the dispatch/combine all-to-alls, at the slowest rank's rows); ``partita calibrate
--router`` measuring a tiny Mixtral's routing, balanced and skewed, into a profile compile reads;
bad loads and profiles refused in one message.
"""

import json

import pytest
import torch

from partita.compiler.compile import compile_model
from partita.core.errors import PartitaError
from partita.core.experts import ExpertLoad, expert_load, rank_load, router_profile
from partita.core.options import Options
from partita.passes.experts import COMBINE, COUNTS, DISPATCH, all_to_alls, expert_rows, model_experts
from partita.passes.pipeline.costs import node_costs
from tests.unit.test_expert_planning import BATCH, LAYERS, SEQ, TOP_K, mixtral

INPUT = f"input_ids=int64[{BATCH},{SEQ}]"


def skewed_mixtral():
    """The tiny Mixtral with every router's gate zeroed: all logits tie, so each token goes to the same two
    experts, both held by one rank of an expert group of 2 (a load of 2, the most there is at ep = 2)."""
    build = mixtral()

    def make():
        torch.manual_seed(0)
        m = build()
        with torch.no_grad():
            for layer in m.model.layers:
                layer.mlp.gate.weight.zero_()
        return m
    return make


def test_the_slowest_ranks_rows_over_the_mean_by_hand():
    # experts 0-1 on rank 0, 2-3 on rank 1 (core/mesh.py held_experts)
    assert rank_load([10, 0, 0, 0], 2) == 2.0
    assert rank_load([3, 1, 1, 1], 2) == pytest.approx(4 / 3)  # rank 0 has 4 of 6 rows, the mean is 3
    assert rank_load([3, 1, 1, 1], 4) == pytest.approx(2.0)  # expert 0's 3 rows, the mean 1.5
    assert rank_load([5, 5, 5, 5], 4) == 1.0
    assert rank_load([9, 0, 0, 0], 1) == 1.0  # ep = 1: every rank runs every expert on its own rows
    assert rank_load([0, 0, 0, 0], 2) == 1.0


def test_a_pinned_load_holds_at_every_ep_up_to_ep():
    load = expert_load("1.5")
    assert load.loads([4, 4], 2) == (1.5, 1.5)
    assert expert_load("3").loads([8], 2) == (2.0,)  # at most every row on one of 2 ranks
    assert load.loads([4, 4], 1) == (1.0, 1.0)
    assert ExpertLoad().loads([4], 4) == (1.0,)
    measured = ExpertLoad(counts=((6, 2, 0, 0), (2, 2, 2, 2)))
    assert measured.loads([4, 4], 2) == (2.0, 1.0)
    with pytest.raises(PartitaError, match=r"router profile has 2 MoE layer\(s\) of 4/4 experts, the model 3"):
        measured.loads([4, 4, 4], 2)


@pytest.mark.parametrize("value, words", [
    ("0.5", "--expert-load 0.5 must be a number >= 1"),
    ("nan", "must be a number >= 1"),
    ("missing.json", "cannot read router profile missing.json"),
])
def test_bad_loads_are_refused(value, words):
    with pytest.raises(PartitaError, match=words):
        expert_load(value)


def test_a_file_that_is_no_router_profile_is_refused(tmp_path):
    for text in ("{", json.dumps({"kind": "something else", "layers": []}),
                 json.dumps({"kind": "partita router profile", "layers": [{"counts": [1, -2]}]})):
        path = tmp_path / "r.json"
        path.write_text(text)
        with pytest.raises(PartitaError, match="is not a router profile"):
            expert_load(str(path))


def test_the_all_to_alls_carry_the_slowest_ranks_rows():
    """Dispatch and combine at the load times the mean rows; the counts (one int64 per expert) as they are."""
    plan_model = compile_model(mixtral(), Options(inputs=[INPUT], cluster="local", devices=4, dp=4, ep=2),
                               name="mixtral")
    regions = model_experts(plan_model.profile.graph)
    even = {c.purpose: c.nbytes for c in all_to_alls(regions[:1], 1, BATCH, 1.0)}
    slow = {c.purpose: c.nbytes for c in all_to_alls(regions[:1], 1, BATCH, 1.0, loads=[2.0])}
    assert slow[DISPATCH] == 2 * even[DISPATCH] and slow[COMBINE] == 2 * even[COMBINE]
    assert slow[COUNTS] == even[COUNTS] == 4 * 8
    # the rows of one sample (SEQ tokens, TOP_K experts each) at fp32, hidden 32
    assert even[DISPATCH] == SEQ * TOP_K * 32 * 4


@pytest.fixture(scope="module")
def mesh_plans():
    """dp=4, ep=2 on 4 local processes: balanced, and with the slowest expert rank at 2x the mean rows."""
    options = dict(inputs=[INPUT], cluster="local", devices=4, dp=4, ep=2)
    return tuple(compile_model(mixtral(), Options(**options, expert_load=x), name="mixtral")
                 for x in (None, "2"))


def test_a_skewed_router_is_priced_slower_by_its_experts_work(mesh_plans):
    even, skewed = mesh_plans
    assert (even.plan.mesh, even.plan.training.micro_batch_size) == (skewed.plan.mesh, 1)
    assert even.plan.training.expert_load == 1.0 and skewed.plan.training.expert_load == 2.0
    assert skewed.plan.predicted.step_time_s > even.plan.predicted.step_time_s
    assert skewed.plan.predicted.comm_s["ep_all_to_all"] > even.plan.predicted.comm_s["ep_all_to_all"]
    # the compute grows by what the experts' rows cost once more on the slowest rank: the per-node costs
    # of each layer's grouped matmuls and the ops between them (forward and backward), summed here
    profile = even.profile
    cluster = Options(cluster="local", devices=4).cluster_spec()
    costs = node_costs(profile, cluster, even.request, 1, tp=1)
    rows = set().union(*(expert_rows(r) for r in model_experts(profile.graph)))
    once = sum(f + b for n, f, b in zip(costs.order, costs.forward_s, costs.backward_s) if n in rows)
    assert once > 0
    extra = skewed.plan.predicted.compute_s - even.plan.predicted.compute_s
    assert extra == pytest.approx(even.plan.training.grad_accum_steps * once, rel=1e-9)
    # and the slowest rank saves those nodes' activations for twice the rows
    saved = sum(s for n, s in zip(costs.order, costs.saved_bytes) if n in rows)
    assert saved > 0
    assert skewed.plan.predicted.memory.activations - even.plan.predicted.memory.activations == saved
    sources = skewed.plan.predicted.sources["expert routing"]
    assert sources.startswith("pinned: --expert-load 2") and "at 2x the mean rows at ep = 2" in sources
    assert even.plan.predicted.sources["expert routing"].startswith("assumed balanced")


def test_a_skewed_router_slows_a_pipelines_slots():
    options = dict(inputs=[INPUT], cluster="local", devices=4, pp=2, ep=2)
    even, skewed = (compile_model(mixtral(), Options(**options, expert_load=x), name="mixtral").plan
                    for x in (None, "2"))
    assert (even.mesh.pp, skewed.mesh.pp, skewed.training.expert_load) == (2, 2, 2.0)
    assert max(s.forward_s + s.backward_s for s in skewed.stages) > max(s.forward_s + s.backward_s
                                                                       for s in even.stages)
    assert max(s.memory_bytes for s in skewed.stages) > max(s.memory_bytes for s in even.stages)
    assert skewed.predicted.step_time_s > even.predicted.step_time_s


def test_ep1_prices_no_imbalance():
    plan = compile_model(mixtral(), Options(inputs=[INPUT], cluster="local", devices=2, dp=2, ep=1,
                                            expert_load="1"), name="mixtral").plan
    assert plan.training.expert_load == 1.0
    assert "at ep = 1 every rank runs every expert" in plan.predicted.sources["expert routing"]


def test_the_router_is_measured_on_a_batch():
    from partita.runtime.experts import measure_routing

    x = torch.randint(0, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    counts = measure_routing(mixtral()(), (x,))
    assert len(counts) == LAYERS and all(len(c) == 4 and sum(c) == BATCH * SEQ * TOP_K for c in counts)
    skewed = measure_routing(skewed_mixtral()(), (x,))
    assert [rank_load(c, 2) for c in skewed] == [2.0] * LAYERS
    assert all(sorted(c) == [0, 0, BATCH * SEQ, BATCH * SEQ] for c in skewed)


def test_calibrate_router_writes_a_profile_compile_prices(cli, tmp_path):
    models = tmp_path / "moe.py"
    models.write_text("from tests.unit.test_expert_load import skewed_mixtral\nskewed = skewed_mixtral()\n")
    batch = tmp_path / "batch.pt"
    torch.save(torch.randint(0, 128, (BATCH, SEQ)), batch)
    profile = tmp_path / "router.json"
    code, out, err = cli("calibrate", "--router", f"{models}:skewed", "--batch", batch, "-o", profile)
    assert code == 0, err
    assert "load at ep=2" in out and "2.00x" in out
    data = json.loads(profile.read_text())
    assert data["tokens"] == BATCH * SEQ and len(data["layers"]) == LAYERS
    plan_path = tmp_path / "p.json"
    code, out, err = cli("compile", f"{models}:skewed", "--input", INPUT, "--devices", "4", "--dp", "4", "--ep", "2",
                         "--expert-load", profile, "-o", plan_path)
    assert code == 0, err
    assert "source: expert routing" in out and "measured: router.json" in out
    plan = json.loads(plan_path.read_text())
    assert plan["training"]["expert_load"] == 2.0


def test_router_and_load_mistakes_are_one_message(cli, tmp_path):
    models = tmp_path / "moe.py"
    models.write_text("from tests.unit.test_expert_planning import mixtral\nmoe = mixtral()\n"
                      "from examples.models import gpt_tiny\n")
    other = tmp_path / "other.json"
    other.write_text(json.dumps(router_profile([[1, 1, 1, 1]] * 3, tokens=4, model="x", layers=["a", "b", "c"])))
    for args, words in (
            (["calibrate", "--batch", "b.pt"], "--input, --batch and --weights describe the model --router measures"),
            (["calibrate", "--router", f"{models}:moe"], "needs a batch to route"),
            (["calibrate", "--router", f"{models}:moe", "--input", "input_ids=int64[4]"], "failed on the batch"),
            (["calibrate", "--router", f"{models}:gpt_tiny", "--input", "idx=int64[2,8]"], "routed no rows to experts"),
            (["compile", f"{models}:moe", "--input", INPUT, "--devices", "4", "--ep", "2", "--expert-load", "0.9"],
             "must be a number >= 1"),
            (["compile", f"{models}:moe", "--input", INPUT, "--devices", "4", "--ep", "2", "--expert-load", "3"],
             "--expert-load 3.0 with --ep 2"),
            (["compile", f"{models}:moe", "--input", INPUT, "--devices", "4", "--ep", "2", "--expert-load", other],
             "it was measured on another model"),
            (["compile", f"{models}:gpt_tiny", "--input", "idx=int64[4,16]", "--devices", "2", "--expert-load", "2"],
             "has no mixture-of-experts layer whose routing")):
        code, out, err = cli(*args, "-o", tmp_path / "out.json")
        assert code == 2 and words in err and "Traceback" not in err, (args, err)


def test_a_grouped_matmul_counts_as_a_matmul_by_hand():
    """Each row meets its expert's (K, N) weight: 2 R K N FLOPs forward, twice that backward (the rows'
    gradient and the weights'), two backward kernels (passes/flops.py). Mixtral's gate_up (K = hidden 32,
    N = 2 x 64) and down (K = 64, N = 32) projections over R = 4 x 8 tokens x 2 experts each."""
    result = compile_model(mixtral(), Options(inputs=[INPUT], cluster="local", devices=2, dp=2), name="mixtral")
    G = result.profile.graph
    rows = BATCH * SEQ * TOP_K
    seen = []
    for r in model_experts(G):
        for n in r.matmuls:
            a = G.nodes[n]
            k, out = a["in_shapes"][0][-1], a["shapes"][0][-1]
            seen.append((k, out))
            assert a["flops_fwd"] == 2 * rows * k * out, (n, a["flops_fwd"])
            assert a["flops_bwd"] == 2 * a["flops_fwd"] and a["kernels_bwd"] == 2, n
    assert sorted(set(seen)) == [(32, 128), (64, 32)]
