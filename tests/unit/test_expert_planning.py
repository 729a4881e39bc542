"""Expert parallelism, planned: a tiny Mixtral's experts split over expert groups, priced by hand.

The planner's side of EP (passes/experts.py, passes/tp/mesh.py, the pipeline search): the plan's
mesh, layouts, model state and collectives of a pinned ep worked out by hand, alone, beside ZeRO
(the expert slices out of it) and beside a pipeline (each stage's all-to-alls in its slots); the
search choosing ep > 1 where the replicated experts do not fit and ep = 1 where they do on a fast
link; the pins it cannot honour refused in one message; the report and `partita view` showing
which ranks hold which experts.
"""

import dataclasses
import math

import pytest

from partita.compiler.compile import compile_model
from partita.compiler.report import expert_layout, plan_report
from partita.core.cluster import PRESETS
from partita.core.errors import PartitaError
from partita.core.mesh import Mesh, crosses_nodes
from partita.core.options import Options
from partita.core.plans.verify import plan_problems
from partita.passes.experts import expert_links

HIDDEN, INTER, EXPERTS, TOP_K, LAYERS = 32, 64, 4, 2, 2
BATCH, SEQ = 4, 8


def mixtral(hidden=HIDDEN, inter=INTER, experts=EXPERTS, layers=LAYERS):
    import transformers as tf

    return lambda: tf.MixtralForCausalLM(tf.MixtralConfig(
        vocab_size=128, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=2, num_local_experts=experts, num_experts_per_tok=TOP_K,
        use_cache=False))


def expert_numel(hidden=HIDDEN, inter=INTER, experts=EXPERTS, layers=LAYERS):
    """Mixtral's stacked experts: gate_up_proj (E, 2I, H) and down_proj (E, H, I) per layer."""
    return layers * experts * (2 * inter * hidden + hidden * inter)


@pytest.fixture(scope="module")
def ep2():
    """The tiny Mixtral on 4 local processes (fp32), dp=4 and ep=2 pinned."""
    return compile_model(mixtral(), Options(inputs=[f"input_ids=int64[{BATCH},{SEQ}]"], cluster="local",
                                            devices=4, world_size=4, dp=4, ep=2), name="mixtral").plan


def test_pinned_ep_plan_by_hand(ep2):
    plan = ep2
    assert (plan.mesh.dp, plan.mesh.tp, plan.mesh.pp, plan.mesh.ep) == (4, 1, 1, 2)
    assert plan_problems(plan) == []
    # the experts are split by expert over "ep", everything else stays replicated over dp
    experts = {p.name: p for p in plan.params if ".mlp.experts." in p.name}
    assert len(experts) == 2 * LAYERS
    assert all(p.layout == {"dp": "replicate", "ep": "shard(0)"} for p in experts.values())
    assert all("ep" not in p.layout for p in plan.params if p.name not in experts)
    assert sum(math.prod(p.shape) for p in experts.values()) == expert_numel()

    # one micro-batch of 1 sample (global 4 over dp 4): 8 tokens x top-2 = 16 rows of 32 fp32 features
    assert (plan.training.micro_batch_size, plan.training.grad_accum_steps) == (1, 1)
    rows = 1 * SEQ * TOP_K
    row_bytes = HIDDEN * 4
    a2a = {c.purpose.split(":")[0]: c for c in plan.collectives if c.axis == "ep"}
    assert {k: (c.kind, c.bytes, c.count, c.group_size) for k, c in a2a.items()} == {
        "expert counts": ("all_to_all", EXPERTS * 8, LAYERS, 2),  # an int64 per expert, forward only
        "expert dispatch": ("all_to_all", rows * row_bytes, 2 * LAYERS, 2),  # forward, and its gradient back
        "expert combine": ("all_to_all", rows * row_bytes, 2 * LAYERS, 2),
    }
    # what a rank sends: half of each buffer leaves it (the other half is its own experts')
    sent = (LAYERS * EXPERTS * 8 + 2 * 2 * LAYERS * rows * row_bytes) / 2
    assert plan.predicted.traffic_bytes["ep_all_to_all"] == sent
    assert plan.predicted.comm_s["ep_all_to_all"] == pytest.approx(sum(c.seconds for c in a2a.values()))

    # model state: the dense parameters whole, half of the experts (fp32, AdamW: 4 + 4 + 8 bytes each)
    dense = plan.model.num_params - expert_numel()
    held = dense + expert_numel() // 2
    m = plan.predicted.memory
    assert (m.params, m.grads, m.optimizer) == (4 * held, 4 * held, 8 * held)
    # gradients: the dense ones averaged over dp=4, the experts' over the 2 ranks holding the same ones
    by_axis = {axis: [c for c in plan.collectives if c.axis == axis and c.purpose.startswith(what)]
               for axis, what in (("dp", "gradient averaging"), ("edp", "expert gradient averaging"))}
    assert sum(c.bytes * c.count for c in by_axis["dp"]) == 4 * dense
    assert sum(c.bytes * c.count for c in by_axis["edp"]) == 4 * expert_numel() // 2
    assert {c.group_size for c in by_axis["edp"]} == {2}
    assert plan.predicted.traffic_bytes["edp_all_reduce"] == 4 * expert_numel() // 2  # 2 S (n - 1) / n at n = 2


def test_pinned_recomputation_reruns_the_forward_all_to_alls():
    """With whole layers recomputed (the pipeline search at p = 1 decides it), each micro-batch's
    backward reruns every MoE layer's three forward all-to-alls; the state is still a rank's share."""
    plan = compile_model(mixtral(), Options(inputs=[f"input_ids=int64[{2 * BATCH},{SEQ}]"], cluster="local",
                                            devices=4, world_size=4, dp=4, ep=2, grad_accum_steps=2,
                                            recompute="full"), name="mixtral").plan
    assert plan.mesh.ep == 2 and [s.recompute for s in plan.stages] == ["full"] and plan_problems(plan) == []
    calls = {c.purpose.split(":")[0]: c.count for c in plan.collectives if c.axis == "ep"}
    # per micro-batch (2) and layer: counts forward and again; rows there and back forward, again, and in backward
    assert calls == {"expert counts": 2 * LAYERS * 2, "expert dispatch": 2 * LAYERS * 3,
                     "expert combine": 2 * LAYERS * 3}
    held = plan.model.num_params - expert_numel() + expert_numel() // 2
    assert plan.predicted.memory.params == 4 * held
    assert plan.predicted.comm_s["ep_all_to_all"] == pytest.approx(
        sum(c.seconds for c in plan.collectives if c.axis == "ep"))


def dense_numel(hidden=HIDDEN, layers=LAYERS, vocab=128):
    """The tiny Mixtral's other parameters: the embedding and the untied head (V x H each), per layer
    q, k, v, o (H x H: 2 heads of 16, 2 KV heads), two norms (H) and the router (E x H), the last norm."""
    return 2 * vocab * hidden + layers * (4 * hidden * hidden + 2 * hidden + EXPERTS * hidden) + hidden


@pytest.mark.parametrize("zero", [1, 3])
def test_zero_beside_experts_by_hand(zero):
    """ZeRO shards the dense parameters' state over all of dp = 4; the expert slices (E/ep = 2 of each
    layer's 4 experts) stay out of ZeRO, whole on each rank with their whole optimizer state, their
    gradients all-reduced over the 2 ranks holding the same experts, as at ZeRO-0."""
    plan = compile_model(mixtral(), Options(inputs=[f"input_ids=int64[{BATCH},{SEQ}]"], cluster="local",
                                            devices=4, world_size=4, dp=4, ep=2, zero=zero), name="mixtral").plan
    assert (plan.mesh.dp, plan.mesh.ep, plan.training.zero_stage) == (4, 2, zero) and plan_problems(plan) == []
    dense, mine = dense_numel(), expert_numel() // 2
    assert (dense, mine) == (16_800, 24_576) and plan.model.num_params == dense + 2 * mine
    # fp32 AdamW: 4 + 4 + 8 bytes a parameter; the dense ones' optimizer state / 4 (ZeRO-1), all of it / 4 (ZeRO-3)
    m = plan.predicted.memory
    dense_params = 4 * dense // (4 if zero == 3 else 1)
    assert (m.params, m.grads, m.optimizer) == (dense_params + 4 * mine, dense_params + 4 * mine,
                                               8 * dense // 4 + 8 * mine)
    assert (m.params, m.grads, m.optimizer) == {1: (165_504, 165_504, 230_208), 3: (115_104, 115_104, 230_208)}[zero]
    # the optimizer steps the dense quarter and every expert element a rank holds, 16 bytes each, read and written
    hbm = PRESETS["local"].hbm_bandwidth
    assert plan.predicted.optimizer_s == pytest.approx(2 * (dense / 4 + mine) * 16 / hbm)

    listed = sorted((c.kind, c.axis, c.bytes, c.count, c.group_size) for c in plan.collectives)
    # ZeRO's collectives over the dense parameters alone: one 67,200-byte bucket at ZeRO-1 (16,800 fp32 elements,
    # a multiple of dp); at ZeRO-3 one bucket a unit: the embedding (4,096), each layer's attention, norms and
    # router (4,288), the last norm and the head (4,128), gathered twice (forward, backward) and scattered once
    zero_calls = ([("all_gather", "dp", 67_200, 1, 4), ("reduce_scatter", "dp", 67_200, 1, 4)] if zero == 1 else
                  [("all_gather", "dp", 16_384, 2, 4), ("all_gather", "dp", 16_512, 2, 4),
                   ("all_gather", "dp", 17_152, 4, 4), ("reduce_scatter", "dp", 16_384, 1, 4),
                   ("reduce_scatter", "dp", 16_512, 1, 4), ("reduce_scatter", "dp", 17_152, 2, 4)])
    rows = 1 * SEQ * TOP_K * HIDDEN * 4  # one sample's 8 tokens x top-2, 32 fp32 features
    assert listed == sorted(zero_calls + [
        ("all_reduce", "dp", 4, 1, 4),  # the loss
        ("all_reduce", "edp", 4 * mine, 1, 2),  # the expert slices' gradients, 98,304 bytes
        ("all_to_all", "ep", EXPERTS * 8, LAYERS, 2),  # counts, forward only
        ("all_to_all", "ep", rows, 2 * LAYERS, 2),  # dispatch, there and back
        ("all_to_all", "ep", rows, 2 * LAYERS, 2)])  # combine
    traffic = plan.predicted.traffic_bytes
    sent = {1: {"zero_reduce_scatter": 50_400, "zero_all_gather": 50_400},  # S (n - 1) / n of 67,200 at n = 4
            3: {"zero_reduce_scatter": 50_400, "zero_all_gather": 100_800}}[zero]
    assert {k: traffic[k] for k in sent} == sent and "dp_all_reduce" not in traffic
    assert traffic["edp_all_reduce"] == 4 * mine  # 2 S (n - 1) / n at n = 2
    assert plan.predicted.comm_s["edp_all_reduce"] == pytest.approx(
        sum(c.seconds for c in plan.collectives if c.axis == "edp"))


def test_pipeline_beside_experts_by_hand():
    """--pp 2 --dp 2 --ep 2 on 4 ranks, two micro-batches of 1 sample: each stage holds one MoE layer,
    half of its experts, and runs that layer's all-to-alls over its own expert groups in its slots;
    its tail averages its dense gradients over dp (every rank of an expert group holds other experts:
    dp / ep = 1, no edp all-reduce)."""
    def plan_at(ep):
        return compile_model(mixtral(), Options(inputs=[f"input_ids=int64[{BATCH},{SEQ}]"], cluster="local",
                                                devices=4, world_size=4, dp=2, pp=2, ep=ep, grad_accum_steps=2),
                             name="mixtral").plan

    plan, whole = plan_at(2), plan_at(1)
    assert (plan.mesh.dp, plan.mesh.pp, plan.mesh.ep, plan.training.micro_batch_size) == (2, 2, 2, 1)
    assert plan_problems(plan) == []
    layer = 4 * HIDDEN * HIDDEN + 2 * HIDDEN + EXPERTS * HIDDEN  # 4,288: attention, norms, router
    mine = expert_numel(layers=1) // 2  # 12,288: half of one layer's experts
    stages = [(s.modules, s.params, s.ranks) for s in plan.stages]
    assert stages == [(("model.embed_tokens", "model.layers.0"), 128 * HIDDEN + layer + mine, (0, 1)),
                      (("model.layers.1", "model.norm", "lm_head"), layer + HIDDEN + 128 * HIDDEN + mine, (2, 3))]
    # the most loaded stage (stage 0: 20,672 elements, the embedding's activations): fp32 AdamW, 4 + 4 + 8 bytes each
    heavy = max(plan.stages, key=lambda s: s.memory_bytes)
    m = plan.predicted.memory
    assert (heavy.index, m.params, m.grads, m.optimizer) == (0, 4 * heavy.params, 4 * heavy.params, 8 * heavy.params)

    rows = 1 * SEQ * TOP_K * HIDDEN * 4  # a micro-batch's 8 tokens x top-2, 32 fp32 features: 2,048 bytes
    listed = sorted((c.stage, c.kind, c.axis, c.bytes, c.count, c.group_size) for c in plan.collectives
                    if c.axis in ("ep", "edp", "dp"))
    assert listed == sorted(
        [(0, "all_reduce", "dp", 4 * (128 * HIDDEN + layer), 1, 2),  # each stage's dense gradients
         (1, "all_reduce", "dp", 4 * (layer + HIDDEN + 128 * HIDDEN), 1, 2), (1, "all_reduce", "dp", 4, 1, 2)]
        + [(s, "all_to_all", "ep", nbytes, calls, 2) for s in (0, 1)  # per micro-batch (2): counts once,
           for nbytes, calls in ((EXPERTS * 8, 2), (rows, 4), (rows, 4))])  # dispatch and combine there and back
    # each stage's slot is the one without experts split plus its layer's all-to-alls: three forward, two back
    per_call = {c.purpose.split(":")[0]: c.seconds / c.count for c in plan.collectives
                if c.stage == 0 and c.axis == "ep"}
    forward = per_call["expert counts"] + per_call["expert dispatch"] + per_call["expert combine"]
    for s, w in zip(plan.stages, whole.stages):
        assert s.forward_s == pytest.approx(w.forward_s + forward)
        assert s.backward_s == pytest.approx(w.backward_s + forward - per_call["expert counts"])
    assert plan.predicted.comm_s["ep_all_to_all"] == pytest.approx(2 * (2 * forward - per_call["expert counts"]))
    assert "edp_all_reduce" not in plan.predicted.comm_s

    # the report: each stage's expert groups, each rank holding half of its own stage's layer
    lay = expert_layout(plan)
    assert lay["groups"] == [[0, 1], [2, 3]] and lay["staged"]
    assert [r["experts"] for r in lay["ranks"]] == [{"model.layers.0.mlp.experts": [0, 1]},
                                                    {"model.layers.0.mlp.experts": [2, 3]},
                                                    {"model.layers.1.mlp.experts": [0, 1]},
                                                    {"model.layers.1.mlp.experts": [2, 3]}]
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(plan_report(plan))
    assert "experts 2-3 of every MoE layer on its stage" in console.export_text()


def test_the_pipeline_search_weighs_expert_parallelism_unpinned():
    """With pipeline stages pinned and ep left to the planner, the pipeline search weighs every degree
    the experts divide into (passes/experts.py ``pipeline_ep_pins``): a pp=2 x ep=2 family is among
    the alternatives, solved or left uncut by branch and bound with the reason it could not win, and
    the plan is no slower than it (Mixtral 8x7B on 4 nodes of H100s plans pp=4 x dp=8 x ep=8 so, 7.14 s
    a step against 8.18 s with experts whole)."""
    plan = compile_model(mixtral(), Options(inputs=[f"input_ids=int64[{BATCH},{SEQ}]"], cluster="local",
                                            devices=4, world_size=4, pp=2), name="mixtral").plan
    split = [a for a in plan.alternatives if a.mesh.pp == 2 and a.mesh.ep == 2]
    assert split, [(str(a.mesh), a.fits) for a in plan.alternatives]
    for a in split:
        if a.fits:
            assert plan.predicted.step_time_s <= a.step_time_s + 1e-12
        else:  # pruned: its bound, or its cap, is above the plan's step
            assert a.reason.startswith("not solved"), a.reason
            best = float(a.reason.split("best ")[1].split(" s")[0])
            assert best >= plan.predicted.step_time_s * (1 - 1e-3), a.reason


def test_pipeline_beside_experts_and_zero_by_hand():
    """--pp 2 --dp 4 --ep 2 --zero 1 on 8 ranks: each stage ZeRO-shards its dense state over its 4 dp ranks,
    keeps its expert slices whole, and all-reduces their gradients over its own 2 ranks holding the same experts."""
    plan = compile_model(mixtral(), Options(inputs=[f"input_ids=int64[{2 * BATCH},{SEQ}]"], cluster="local",
                                            devices=8, world_size=8, dp=4, pp=2, ep=2, zero=1, grad_accum_steps=2),
                         name="mixtral").plan
    assert (plan.mesh.dp, plan.mesh.pp, plan.mesh.ep, plan.training.zero_stage) == (4, 2, 2, 1)
    assert plan_problems(plan) == []
    layer, mine = 4 * HIDDEN * HIDDEN + 2 * HIDDEN + EXPERTS * HIDDEN, expert_numel(layers=1) // 2
    dense = (128 * HIDDEN + layer, layer + HIDDEN + 128 * HIDDEN)  # 8,384 and 8,416
    m = plan.predicted.memory  # the most loaded stage, 0: its dense optimizer state / 4, its experts' whole
    assert (m.params, m.grads, m.optimizer) == (4 * (dense[0] + mine), 4 * (dense[0] + mine), 8 * dense[0] // 4
                                                + 8 * mine) == (82_688, 82_688, 115_072)
    listed = sorted((c.stage, c.kind, c.axis, c.bytes, c.count, c.group_size) for c in plan.collectives
                    if c.axis in ("edp", "dp") and c.bytes > 4)
    assert listed == sorted([(s, kind, "dp", 4 * dense[s], 1, 4) for s in (0, 1)
                             for kind in ("reduce_scatter", "all_gather")]
                            + [(s, "all_reduce", "edp", 4 * mine, 1, 2) for s in (0, 1)])
    edp = [c for c in plan.collectives if c.axis == "edp"]
    assert plan.predicted.comm_s["edp_all_reduce"] == pytest.approx(edp[0].seconds)  # the slowest tail's
    assert plan.predicted.traffic_bytes["edp_all_reduce"] == 4 * mine  # 2 S (n - 1) / n at n = 2


@pytest.mark.parametrize("nodes, per_node", [(1, 8), (2, 4), (4, 2), (3, 4)])
def test_expert_links_are_the_mesh_groups_links(nodes, per_node):
    """The links the planner prices the all-to-alls ("ep") and the experts' gradients ("edp") on
    are those of the mesh's real groups (core/mesh.py), for every (tp, ep) of the cluster."""
    cluster = PRESETS["dgx-a100"].with_nodes(nodes).with_devices(per_node)
    world = cluster.world_size
    for tp in (t for t in range(1, per_node + 1) if per_node % t == 0):
        dp = world // tp
        for ep in (e for e in range(1, dp + 1) if dp % e == 0):
            mesh = Mesh(dp=dp, tp=tp, ep=ep)
            for axis, link in zip(("ep", "edp"), expert_links(cluster, dp=dp, tp=tp, ep=ep)):
                spans = any(crosses_nodes(g, per_node) for g in mesh.groups(axis))
                assert link == (cluster.inter_link if spans else cluster.intra_link), (mesh, axis)


def h100(memory_mb: float):
    return dataclasses.replace(PRESETS["dgx-h100"], memory_bytes=int(memory_mb * 1e6), memory_reserve=0.0
                               ).with_devices(4)


BIG = dict(hidden=256, inter=1024, experts=8)  # 12.6M expert parameters, 0.6M dense


@pytest.mark.parametrize("memory_mb, split", [(80_000, False), (150, True)])
def test_the_planner_splits_experts_where_memory_binds(memory_mb, split):
    """On NVLink the all-to-alls cost more than the gradient traffic EP saves, so the experts stay
    whole where they fit; where the replicated experts' state (16 bytes each under bf16-mixed AdamW:
    200 MB) does not fit, the planner splits them."""
    plan = compile_model(mixtral(**BIG), Options(inputs=[f"input_ids=int64[{BATCH},{SEQ}]"], cluster=h100(memory_mb),
                                                 world_size=4, dp=4), name="mixtral").plan
    assert plan.predicted.memory.fits
    if not split:
        assert plan.mesh.ep == 1 and "ep_all_to_all" not in plan.predicted.comm_s
        weighed = [a for a in plan.alternatives if a.mesh.ep > 1]
        # solved and slower for its all-to-alls, or left uncut by branch and bound (a bound above the plan's)
        assert any(a.fits and "expert all-to-alls" in a.reason for a in weighed), weighed
        assert all(a.fits and "expert all-to-alls" in a.reason or a.reason.startswith("not solved")
                   for a in weighed), weighed
        return
    assert plan.mesh.ep > 1 and plan.training.zero_stage == 0
    whole = [a for a in plan.alternatives if a.mesh.ep == 1 and a.zero_stage == 0]
    assert whole and not any(a.fits for a in whole)
    state = plan.predicted.memory.params + plan.predicted.memory.grads + plan.predicted.memory.optimizer
    dense = plan.model.num_params - expert_numel(**BIG)
    assert state == 16 * (dense + expert_numel(**BIG) // plan.mesh.ep)


def test_pins_it_cannot_honour_are_refused(cli, tmp_path):
    models = tmp_path / "moe.py"
    models.write_text("from tests.unit.test_expert_planning import mixtral\nmixtral_tiny = mixtral()\n")
    gpt = "examples/models.py:gpt_tiny"
    for args, words in (
            ([gpt, "--input", "idx=int64[4,16]", "--ep", "2"], "has no mixture-of-experts layer"),
            ([f"{models}:mixtral_tiny", "--input", "input_ids=int64[4,8]", "--ep", "3"],
             "--ep 3 does not divide the 4 experts"),
            ([f"{models}:mixtral_tiny", "--input", "input_ids=int64[4,8]", "--ep", "2", "--offload", "optimizer"],
             "--ep 2 with --offload"),
            ([f"{models}:mixtral_tiny", "--input", "input_ids=int64[4,8]", "--ep", "2", "--tp", "2"],
             "--ep 2 with --tp 2")):
        code, out, err = cli("compile", *args, "--devices", "4", "-o", tmp_path / "p.json")
        assert code == 2 and words in err and "Traceback" not in err, (args, err)
    with pytest.raises(PartitaError, match="--ep 2 does not divide dp=3"):
        compile_model(mixtral(), Options(inputs=["input_ids=int64[3,8]"], cluster="local", devices=3, ep=2))
