"""The pipeline planner rediscovers known answers: even layer splits, a head-heavy last
stage, no pipeline when data parallelism is cheaper, a pipeline when memory forces one,
the (p - 1)/m bubble, and the DP's cuts equal an exhaustive search's."""

import dataclasses
import itertools
import random

import pytest
import torch.nn as nn

from examples.models import GPT, GPTConfig, gpt_tiny
from partita.core.cluster import GB, PRESETS, load_cluster
from partita.core.errors import InfeasibleError, PartitaError
from partita.core.model.capture import capture
from partita.core.model.inputs import parse_input_spec
from partita.core.model.losses import default_loss
from partita.core.pins import Pins, TrainingRequest
from partita.core.schedule import bubble_fraction
from partita.passes.cost_model import collective_time, state_bytes_per_param
from partita.passes.pipeline.costs import NodeCosts, SharedParam, node_costs, pipeline_order
from partita.passes.pipeline.cuts import INF, Partition, StageSetup, solve_cuts
from partita.passes.pipeline.stages import choose_pipeline, stage_links, stage_of_nodes
from partita.passes.profile import profile_model

FP32 = TrainingRequest(global_batch=8)


def _profile(factory, spec="idx=int64[8,128]"):
    return profile_model(capture(factory, [parse_input_spec(spec)], loss=default_loss))


def _gpt(**kw):
    cfg = dict(vocab_size=256, block_size=128, n_layer=8, n_head=4, n_embd=64)
    cfg.update(kw)
    return lambda: GPT(GPTConfig(**cfg))


def _layers_per_stage(profile, decision):
    stage = stage_of_nodes(profile, decision.best.cuts)
    layers = [set() for _ in decision.stages]
    for n, s in stage.items():
        if profile.graph.nodes[n].get("layer"):
            layers[s].add(profile.graph.nodes[n]["layer"])
    return [len(x) for x in layers]


# A stage per rank: the cut's own tests (on `local`, whose per-op cost makes fewer, bigger
# micro-batches and so interleaved virtual stages the faster plan for these small GPTs)
ONE_STAGE_EACH = ("1f1b",)


def _choose(profile, cluster, request=FP32, pins=Pins(), **kw):
    return choose_pipeline(profile, cluster, request, pins, **kw)


@pytest.fixture(scope="module")
def gpt8():
    return _profile(_gpt())


@pytest.fixture(scope="module")
def gpt_big_vocab():
    return _profile(_gpt(n_layer=12, vocab_size=2048))


def test_uniform_gpt_gets_equal_layers_per_stage(gpt8):
    d = _choose(gpt8, load_cluster("local", devices=4), pins=Pins(pp=4), schedules=ONE_STAGE_EACH)
    assert _layers_per_stage(gpt8, d) == [2, 2, 2, 2]
    assert d.stages[0].modules[:2] == ("transformer.wte", "transformer.wpe")
    assert d.stages[-1].modules[-2:] == ("transformer.ln_f", "lm_head")
    # the search space is the layer boundaries: 8 layers, 9 places
    assert len(d.boundaries) == 9


def test_big_vocabulary_gives_the_last_stage_fewer_layers(gpt_big_vocab):
    d = _choose(gpt_big_vocab, load_cluster("local", devices=4), pins=Pins(pp=4), schedules=ONE_STAGE_EACH)
    layers = _layers_per_stage(gpt_big_vocab, d)
    assert sum(layers) == 12
    assert layers[-1] < min(layers[1:-1]), layers  # lm_head (2 b s h V) outweighs layers
    # and it is balanced: no other split has a faster slowest stage (see the exhaustive test too)
    slots = [s.slot_s for s in d.stages]
    assert max(slots) < 1.5 * min(slots)


def test_no_pipeline_when_the_model_fits_and_data_parallel_is_cheaper():
    d = _choose(_profile(gpt_tiny, "idx=int64[8,64]"), load_cluster("local", devices=4))
    assert d.best.pp == 1 and d.best.dp == 4 and d.best.schedule == "none"
    piped = [c for c in d.candidates if c.pp > 1 and c.fits]
    assert piped and all("bubble" in d.reasons[c.key] for c in piped)


def _local_24gb(devices=4):
    return dataclasses.replace(PRESETS["local"], memory_bytes=int(24 * GB), gpus_per_node=devices)


def test_pipeline_when_no_device_holds_the_model():
    prof = _profile(_gpt(n_layer=16, n_embd=2560, n_head=20, vocab_size=50304))  # 1.5B params, fp32 Adam 24 GB
    cluster = _local_24gb()
    assert prof.num_params * 16 > cluster.usable_memory
    d = _choose(prof, cluster, pins=Pins(zero_stage=0))
    assert d.best.pp > 1 and d.best.fits
    assert all(s.memory.fits for s in d.stages)
    flat = [c for c in d.candidates if c.pp == 1]
    assert flat and not any(c.fits for c in flat)
    assert all(d.reasons[c.key].startswith("does not fit") for c in flat)
    # With ZeRO free, sharding the state over the 4 replicas is the other way to fit: the
    # unsharded flat candidates still say why they lost, at the cuts that fit ZeRO
    z = _choose(prof, cluster)
    assert z.best.fits and (z.best.zero_stage > 0 or z.best.pp > 1)
    flat0 = [c for c in z.candidates if c.pp == 1 and c.zero_stage == 0]
    assert flat0 and all(z.reasons[c.key].startswith("does not fit") for c in flat0)


def test_a_13b_gpt_in_fp32_adam_on_four_24gb_devices_is_refused_naming_the_stage():
    # 12.9B parameters x 16 bytes = 206 GB: even four stages need 52 GB each
    prof = _profile(_gpt(n_layer=40, n_embd=5120, n_head=40, vocab_size=32000), "idx=int64[1,128]")
    with pytest.raises(InfeasibleError, match=r"stage \d needs .* budget 18.00 GB") as e:
        choose_pipeline(prof, _local_24gb(), TrainingRequest(global_batch=4))
    assert "ZeRO" in str(e.value)


def test_bubble_shrinks_with_more_micro_batches():
    wide = _profile(_gpt(n_embd=1024, n_head=16))  # wide enough that compute, not p2p latency, sets the slot
    # no per-micro-batch overhead: without the per-kernel and per-call costs (each micro-batch's kernels and
    # sends pay their launch, which at this size would outweigh the bubble they shrink)
    cluster = dataclasses.replace(PRESETS["dgx-a100"].with_devices(4), kernel_s=0.0, launch_s=0.0, call_latency={})
    req = TrainingRequest(global_batch=32, precision="bf16-mixed")
    steps, bubbles = [], []
    for m in (1, 2, 4, 8, 16, 32):
        best = _choose(wide, cluster, req, Pins(pp=4, grad_accum_steps=m)).best
        c = best.cost
        assert c.bubble_s / (c.compute_s + c.p2p_s) == pytest.approx(bubble_fraction(4, m, best.chunks))
        # interleaving halves the bubble where its chunks run (m a multiple of p), at twice the sends: at few
        # micro-batches the bubble is the larger
        if m < 4:
            assert (best.schedule, best.chunks) == ("1f1b", 1), m
        elif m == 4:
            assert (best.schedule, best.chunks) == ("interleaved-1f1b", 2), m
        steps.append(best.step_s)
        bubbles.append(c.bubble_s)
    assert bubbles == sorted(bubbles, reverse=True) and steps == sorted(steps, reverse=True)
    # the free choice takes the most micro-batches
    assert _choose(wide, cluster, req, Pins(pp=4)).best.micro_batches == 32


def test_1f1b_holds_fewer_micro_batches_than_gpipe(gpt8):
    cluster = load_cluster("local", devices=4)
    d = _choose(gpt8, cluster, pins=Pins(pp=4, grad_accum_steps=8))
    one = next(c for c in d.candidates if c.schedule == "1f1b")
    gp = next(c for c in d.candidates if c.schedule == "gpipe")
    assert [s.in_flight for s in one.stages] == [4, 3, 2, 1]
    assert [s.in_flight for s in gp.stages] == [8, 8, 8, 8]
    assert one.step_s == gp.step_s and one.memory.total < gp.memory.total
    assert d.best.schedule == "1f1b" and "GPipe holds all m" in d.reasons[gp.key]
    assert _choose(gpt8, cluster, pins=Pins(pp=4), schedules=("gpipe",)).best.schedule == "gpipe"


def test_cut_sends_b_s_h_per_micro_batch_on_the_stage_link(gpt8):
    d = _choose(gpt8, load_cluster("local", devices=4), pins=Pins(pp=2, micro_batch_size=2))
    assert d.stages[0].send_bytes == 2 * 128 * 64 * 4  # b s h fp32 elements
    a100 = PRESETS["dgx-a100"].with_nodes(4)
    assert stage_links(a100, 4, 8, 1) == (a100.inter_link,) * 3  # a stage per node
    two = PRESETS["dgx-a100"].with_nodes(2)  # 4 stages of 4 ranks: two stages per node
    assert stage_links(two, 4, 4, 1) == (two.intra_link, two.inter_link, two.intra_link)


def test_stage_of_nodes_is_a_contiguous_topological_split(gpt8):
    d = _choose(gpt8, load_cluster("local", devices=4), pins=Pins(pp=4), schedules=ONE_STAGE_EACH)
    stage = stage_of_nodes(gpt8, d.best.cuts)
    G = gpt8.graph
    assert set(stage) == set(G.nodes) and set(stage.values()) == {0, 1, 2, 3}
    assert all(stage[u] <= stage[v] for u, v in G.edges)
    for n, a in G.nodes(data=True):
        if a["kind"] == "param":  # each parameter lives with its users
            assert {stage[u] for u in G.successors(n)} == {stage[n]}
    sizes = [sum(1 for s in stage.values() if s == i) for i in range(4)]
    assert sizes == [s.stop - s.start for s in d.stages]
    with pytest.raises(ValueError, match="not in the graph"):
        stage_of_nodes(gpt8, ["no_such_node"])
    with pytest.raises(ValueError, match="increasing"):
        stage_of_nodes(gpt8, list(reversed(d.best.cuts)))


class TiedGPT(GPT):
    """GPT-2's tying: the head's weight is the token embedding's."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.lm_head.weight = self.transformer.wte.weight


def test_tied_embeddings_are_held_by_both_stages_and_all_reduced():
    cfg = GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=64)
    prof = _profile(lambda: TiedGPT(cfg))
    cluster = load_cluster("local", devices=2)
    d = _choose(prof, cluster, pins=Pins(pp=2))
    assert [sp.name for sp in d.shared] == ["transformer.wte.weight"]
    # every cut between the layers separates the embedding from the head: only "split" can pipeline
    assert d.best.shared_policy == "split"
    wte = 256 * 64
    assert all(s.params >= wte for s in d.stages)
    assert sum(s.params for s in d.stages) == prof.num_params + wte
    assert d.best.cost.tied_all_reduce_s == pytest.approx(collective_time("all_reduce", wte * 4, 2, cluster.intra_link))


# -- the DP against exhaustive search -----------------------------------------------


def _exhaustive(part: Partition) -> float:
    p, n = part.setup.stages, part.n
    best = INF
    for cuts in itertools.combinations(part.boundaries, p - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(part.time_cost(j, k, s) for s, (j, k) in enumerate(zip(bounds, bounds[1:]))))
    return best


def _check_against_exhaustive(costs, cluster, capacity):
    state = state_bytes_per_param("fp32", "adamw")
    for p in (1, 2, 3):
        for schedule in (("none",) if p == 1 else ("1f1b", "gpipe")):
            for m in (1, 2, 4):
                links = stage_links(cluster, p, 1, 1)
                part = Partition(costs, StageSetup(p, m, schedule, links, capacity, state), cluster)
                value, bounds = solve_cuts(part)
                assert value == _exhaustive(part)
                if value < INF:
                    segs = list(zip(bounds, bounds[1:]))
                    assert max(part.time_cost(j, k, s) for s, (j, k) in enumerate(segs)) == value


def test_dp_equals_exhaustive_search_on_random_small_graphs():
    rng = random.Random(0)
    cluster = dataclasses.replace(PRESETS["local"].with_nodes(3), gpus_per_node=1)  # every stage link inter-node
    for _ in range(150):
        n = rng.randint(2, 12)
        send = [0] + [rng.choice([0, 1e5, 1e6, 1e7]) for _ in range(n - 1)] + [0]
        costs = NodeCosts(
            order=tuple(f"n{i}" for i in range(n)),
            forward_s=tuple(rng.uniform(0, 1e-2) for _ in range(n)),
            backward_s=tuple(rng.uniform(0, 2e-2) for _ in range(n)),
            saved_bytes=tuple(rng.randint(0, 10**8) for _ in range(n)),
            param_numel=tuple(rng.choice([0, 0, 10**6, 10**7]) for _ in range(n)),
            send_bytes=tuple(round(x) for x in send), grad_bytes=tuple(round(x / 2) for x in send),
            boundaries=tuple(k for k in range(1, n) if rng.random() < 0.8),
            shared=(SharedParam("tied", 10**6, (0, n - 1)),) if rng.random() < 0.3 else (),
        )
        _check_against_exhaustive(costs, cluster, capacity=rng.choice([10**8, 3 * 10**8, 10**9, 10**10]))


def test_dp_equals_exhaustive_search_on_a_captured_mlp():
    prof = _profile(lambda: nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 48), nn.Tanh(),
                                          nn.Linear(48, 10)), "x=float32[16,32]")
    assert not prof.repeated  # cuts anywhere after a call node
    cluster = load_cluster("local", devices=3)
    costs = node_costs(prof, cluster, FP32, 4)
    assert len(costs.boundaries) == 5  # after each Linear and activation but the last Linear
    order = pipeline_order(prof.graph)
    for i, n in enumerate(order):  # placeholders sit just before their first user
        if prof.graph.nodes[n]["kind"] in ("param", "input"):
            first = min(order.index(u) for u in prof.graph.successors(n))
            assert all(prof.graph.nodes[x]["kind"] in ("param", "input") for x in order[i:first])
    for capacity in (10**4, 10**5, 10**9):
        _check_against_exhaustive(costs, cluster, capacity)


def test_pins_are_honoured_or_refused(gpt8):
    cluster = load_cluster("local", devices=4)
    with pytest.raises(PartitaError, match="--pp 3 does not divide 4"):
        choose_pipeline(gpt8, cluster, FP32, Pins(pp=3))
    d = _choose(gpt8, cluster, pins=Pins(pp=2, micro_batch_size=2))
    assert all(c.pp == 2 and c.micro_batch_size == 2 for c in d.candidates)
    assert d.best.dp == 2 and d.best.micro_batches == 2


def test_pipeline_step_by_hand():
    from partita.core.schedule import in_flight as activations_in_flight
    from partita.passes.cost_model import pipeline_step

    cluster = dataclasses.replace(PRESETS["local"], step_overhead_s=0.001)
    c = pipeline_step(compute_s=[0.010, 0.012, 0.009], p2p_s=[0.001, 0.002, 0.001], micro_batches=4,
                      dp_all_reduce_s=[0.0, 0.0, 0.0], optimizer_s=[0.003, 0.005, 0.004], tied_all_reduce_s=0.002,
                      cluster=cluster)
    slot = 0.012 + 0.001 + 0.002  # the slowest stage sets the pace
    assert c.slowest_stage == 1
    assert c.compute_s == pytest.approx(4 * 0.013) and c.p2p_s == pytest.approx(4 * 0.002)
    assert c.bubble_s == pytest.approx(2 * slot)
    assert c.step_s == pytest.approx((4 + 3 - 1) * slot + 0.005 + 0.002)
    assert [activations_in_flight("1f1b", s, 4, 2) for s in range(4)] == [2, 2, 2, 1]
    assert bubble_fraction(4, 8) == 3 / 8


def test_recompute_costs_keep_each_layers_inputs_and_rerun_its_forward():
    """Hand-worked: an embedding, then two layers of two nodes (a parameter of h.1 placed before
    its first user). Each layer keeps what crosses its first boundary; its backward adds its
    forward; one layer's saved bytes are held again while it is recomputed."""
    from partita.passes.pipeline.costs import NodeCosts, recompute_costs

    c = NodeCosts(
        order=("emb", "a0", "b0", "w1", "a1", "b1"),
        forward_s=(1.0, 2.0, 3.0, 0.0, 2.0, 3.0), backward_s=(2.0, 4.0, 6.0, 0.0, 4.0, 6.0),
        saved_bytes=(10, 100, 200, 0, 100, 250), param_numel=(5, 0, 0, 7, 0, 0),
        send_bytes=(0, 8, 30, 8, 8, 30, 0), grad_bytes=(0, 8, 30, 8, 8, 30, 0), boundaries=(1, 3),
        modules=("", "h.0", "h.0", "h.1.attn", "h.1", "h.1"), layers=frozenset({"h.0", "h.1"}),
    )
    rc = recompute_costs(c, pin="full").options[0]
    # each layer keeps the bytes crossing the boundary before its first node (8 each)
    assert rc.costs.saved_bytes == (10, 8, 0, 0, 8, 0)
    assert rc.costs.backward_s == (2.0, 6.0, 9.0, 0.0, 6.0, 9.0)
    assert rc.costs.forward_s == c.forward_s
    assert rc.transient_bytes == 350  # h.1: 100 + 250
    assert recompute_costs(dataclasses.replace(c, layers=frozenset())) is None  # no layers, no attention cores


def test_a_cpu_process_pays_for_each_kernel_so_a_host_bound_model_takes_fewer_micro_batches():
    """On `local` every kernel costs ``kernel_s`` beyond its work (a CPU process runs what it
    issues): hand-worked, a node of 3 kernels and no work is 15 us; the preset's figure is within
    4x of what this machine measures (runtime/calibrate.py ``op_seconds``); and a GPT of many tiny
    ops (12 x 64 at [4 x 16], benchmarks/host_overhead.py's) pipelined over 2 ranks is planned as one
    micro-batch of 4, where two of 2 would run the stages' ops twice for little less bubble (measured
    there: 22.6 ms a step against 28.3 ms, docs/cost-model.md)."""
    from partita.passes.cost_model import op_time
    from partita.runtime.calibrate import op_seconds

    local = PRESETS["local"]
    assert local.kernel_s == 5e-6
    assert op_time(0, 0, 3, local, "fp32") == pytest.approx(15e-6)
    # the machine's own speed: the best of 20 single chains, so that a loaded machine (a load of 4 on
    # 2 cores preempts a median run) still measures what one uncontended kernel costs
    assert local.kernel_s / 4 < min(op_seconds(200, 1) for _ in range(20)) < 4 * local.kernel_s
    tiny = _profile(_gpt(n_layer=12, block_size=16), "idx=int64[4,16]")
    request = TrainingRequest(global_batch=4)
    d = _choose(tiny, load_cluster("local", devices=2), request, pins=Pins(pp=2))
    assert (d.best.pp, d.best.micro_batch_size) == (2, 4), d.best
    flat = _choose(tiny, dataclasses.replace(load_cluster("local", devices=2), kernel_s=0.0), request, pins=Pins(pp=2))
    assert flat.best.micro_batch_size < 4  # priced by FLOPs alone, the smaller micro-batches looked faster


def test_a_chunked_schedule_cuts_no_chunk_without_parameters():
    """Interleaved 1F1B gives every rank chunks of its own model parts: on a 2-layer MLP (parameters at two
    places) 2 ranks x 2 chunks cannot each hold one, so the pinned schedule is refused in one message
    naming why (issue 44: it gave two chunks no parameters); on 4 layers every chunk holds some; and a
    plan edited to an empty chunk is refused by verify."""
    import json

    from examples.models import MLP
    from partita.compiler.compile import compile_model
    from partita.core.errors import InfeasibleError
    from partita.core.options import Options
    from partita.core.plans.verify import plan_problems

    options = Options(inputs=["x=float32[32,64]"], cluster="local", devices=2, schedule="interleaved-1f1b")
    with pytest.raises(InfeasibleError, match="4 model parts, each holding parameters of its own, but the model "
                                              "holds parameters at 2 places"):
        compile_model(lambda: MLP(layers=2), options, name="mlp")
    plan = compile_model(lambda: MLP(layers=4), options, name="mlp").plan
    assert plan.training.chunks == 2 and len(plan.stages) == 4 and all(s.params for s in plan.stages)
    assert plan_problems(plan) == []
    data = json.loads(plan.to_json())
    data["stages"][1]["params"] = 0
    from partita.core.plans.plan import Plan

    assert any("stages[1].params = 0 under training.chunks = 2" in p for p in plan_problems(Plan.from_dict(data)))


def _tying_costs(rng: random.Random, sends: list[float]) -> tuple[int, NodeCosts]:
    """A random graph of 3-14 positions whose times, bytes and sends take a few values each (so that
    segments tie often), with a tenth of its boundaries left out."""
    n = rng.randint(3, 14)
    send = [0] + [rng.choice(sends) for _ in range(n - 1)] + [0]
    return n, NodeCosts(
        order=tuple(f"n{i}" for i in range(n)),
        forward_s=tuple(rng.choice([1e-3, 2e-3]) for _ in range(n)),
        backward_s=tuple(rng.choice([2e-3, 4e-3]) for _ in range(n)),
        saved_bytes=tuple(rng.choice([0, 10**7]) for _ in range(n)),
        param_numel=tuple(rng.choice([0, 10**6]) for _ in range(n)),
        send_bytes=tuple(round(x) for x in send), grad_bytes=tuple(round(x / 2) for x in send),
        boundaries=tuple(k for k in range(1, n) if rng.random() < 0.9),
    )


def test_the_seeded_scan_returns_the_unseeded_cuts_ties_included(monkeypatch):
    """solve_cuts weighs the previous end's cut first (``_time_scan``'s seed) to skip cuts that cannot
    win: the same value and the same cuts as the plain scan from the top, on graphs whose times tie
    often (a few values each), so that which of two equal cuts is kept is checked too."""
    from partita.passes.pipeline import cuts

    rng = random.Random(1)
    cluster = dataclasses.replace(PRESETS["local"].with_nodes(3), gpus_per_node=1)
    state = state_bytes_per_param("fp32", "adamw")
    plain = cuts._time_scan
    compared = 0
    for _ in range(200):
        n, costs = _tying_costs(rng, [0, 1e6])
        for p in (2, 3, 4):
            for m in (1, 4):
                links = stage_links(cluster, p, 1, 1)
                setup = StageSetup(p, m, "1f1b", links, rng.choice([10**8, 10**9]), state)
                seeded = solve_cuts(Partition(costs, setup, cluster))
                monkeypatch.setattr(cuts, "_time_scan", lambda *a: plain(*a[:5]))
                unseeded = solve_cuts(Partition(costs, setup, cluster))
                monkeypatch.setattr(cuts, "_time_scan", plain)
                assert seeded == unseeded, (n, p, m)
                compared += seeded[0] < INF
    assert compared > 300


def test_a_capped_solve_within_its_windows_returns_the_uncapped_cuts_below_the_cap():
    """Branch and bound cuts with a cap (a slot the search has no use for, ``PipelineBound.slot_cap``)
    and only where ``cut_windows`` says each stage may end: below the cap the value and the cuts are
    the full DP's, ties included; at or above it the capped solve gives inf, and the windows are None
    only where the full DP's value reaches the cap. Graphs with sends that tie often, and the runtime's
    buffers in memory, so that the windows' relaxation (sends left out) is exercised."""
    from partita.passes.peak_memory import step_buffers
    from partita.passes.pipeline.bounds import cut_windows

    rng = random.Random(2)
    cluster = dataclasses.replace(PRESETS["local"].with_nodes(3), gpus_per_node=1)
    state = state_bytes_per_param("fp32", "adamw")
    compared = capped = 0
    for _ in range(150):
        n, costs = _tying_costs(rng, [0, 1e6, 3e7])
        for p in (2, 3, 4):
            for m, schedule in ((1, "gpipe"), (4, "1f1b")):
                buffers = (lambda numel, m=m: step_buffers(precision="fp32", reduce_dtype="fp32", zero_stage=0, dp=1,
                                                      numel=numel, largest=min(10**6, numel), unit_numel=10**6,
                                                      bucket_bytes=25 * 2**20, tensors=0, accumulates=m > 1))
                setup = StageSetup(p, m, schedule, stage_links(cluster, p, 1, 1),
                                   rng.choice([10**8, 2 * 10**8, 10**9]), state, buffers=buffers)
                full = solve_cuts(Partition(costs, setup, cluster))
                for cap in ({full[0], full[0] * (1 + 1e-9), full[0] * 1.1, full[0] * 0.97, rng.uniform(0, 0.05)}
                            - {INF}):
                    part = Partition(costs, setup, cluster)
                    windows = cut_windows(part, cap)
                    got = solve_cuts(part, cap=cap, windows=windows) if windows is not None else (INF, ())
                    if full[0] < cap:
                        assert windows is not None and got == full, (n, p, m, cap)
                        compared += 1
                    else:
                        assert got == (INF, ()), (n, p, m, cap)
                        capped += windows is None
    assert compared > 300 and capped > 100, (compared, capped)


def test_more_chunks_per_rank_where_the_bubble_outweighs_the_sends(monkeypatch):
    """At few micro-batches the interleaved schedule's bubble, (p - 1) / (v m) of the compute, shrinks with
    every chunk a rank runs: the chosen group is cut again at 3, 4, ... chunks (``more_chunks``) and the
    most that the model's layers allow wins where sends cost nothing; with chunks capped at 2 the plan is
    the slower one, so the search weighed them and did not merely relabel."""
    import partita.core.schedule as schedule

    deep = _profile(_gpt(n_layer=16, n_embd=1024, n_head=16))
    cluster = dataclasses.replace(PRESETS["dgx-a100"].with_devices(4), kernel_s=0.0, launch_s=0.0, call_latency={})
    req = TrainingRequest(global_batch=32, precision="bf16-mixed")
    pins = Pins(pp=4, grad_accum_steps=4, schedule="interleaved-1f1b")
    best = _choose(deep, cluster, req, pins, prune=True).best
    assert best.schedule == "interleaved-1f1b" and best.chunks > 2
    c = best.cost
    assert c.bubble_s / (c.compute_s + c.p2p_s) == pytest.approx(bubble_fraction(4, 4, best.chunks))
    assert len(best.stages) == 4 * best.chunks and all(st.params for st in best.stages)
    assert _choose(deep, cluster, req, pins, prune=False).best.step_s == pytest.approx(best.step_s)
    monkeypatch.setattr(schedule, "MAX_CHUNKS", 2)
    two = _choose(deep, cluster, req, pins, prune=True).best
    assert two.chunks == 2 and two.step_s > best.step_s
