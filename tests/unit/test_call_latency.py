"""Per-call cost of collectives (issue: many small collectives cost what their calls cost): the
cost model prices it, cluster files carry it, `partita calibrate`'s figures derive it, and the
tensor-parallel search then prefers fewer, larger collectives."""

import collections
import dataclasses

import pytest
import torch

from partita.core.cluster import COLLECTIVES, PRESETS, Link, load_cluster
from partita.core.errors import ClusterError
from partita.core.options import Options
from partita.passes.calibrated import calibrated_local
from partita.passes.cost_model import collective_time


def test_a_call_costs_its_kind_fixed_cost_on_top_of_alpha_beta():
    plain = Link(1e9, 10e-6, "x")
    priced = dataclasses.replace(plain, call_latency=(("all_gather", 1e-3), ("send_recv", 2e-4)))
    # hand-worked: (n - 1) alpha + S (n - 1) / n / beta = 10 us + 2048 B / 1 GB/s = 12.048 us
    assert collective_time("all_gather", 4096, 2, plain) == pytest.approx(12.048e-6)
    assert collective_time("all_gather", 4096, 2, priced) == pytest.approx(1e-3 + 12.048e-6)
    assert collective_time("send_recv", 4096, 2, priced) == pytest.approx(2e-4 + 10e-6 + 4.096e-6)
    assert collective_time("all_reduce", 4096, 2, priced) == collective_time("all_reduce", 4096, 2, plain)
    assert collective_time("all_gather", 4096, 1, priced) == 0.0  # no group, no call


def test_calibration_keeps_only_what_alpha_and_beta_do_not_explain():
    alpha, beta = 50e-6, 1e9
    ab = {k: collective_time(k, 4096, 2 if k == "send_recv" else 4, Link(beta, alpha, "m")) for k in COLLECTIVES}
    measured = {k: ab[k] + 300e-6 for k in COLLECTIVES}
    measured["broadcast"] = ab["broadcast"] / 2  # faster than the fit: no negative cost
    c = calibrated_local(nproc=4, cpu_name="cpu", memory_bytes=2**32, matmul_flops=5e10, beta=beta, alpha=alpha,
                         call_seconds=measured, call_bytes=4096, seconds=1.0)
    assert c.call_latency["all_gather"] == pytest.approx(300e-6)
    assert c.call_latency["send_recv"] == pytest.approx(300e-6)
    assert c.call_latency["broadcast"] == 0.0
    assert c.intra_link.call_s("reduce_scatter") == pytest.approx(300e-6)


def test_a_cluster_file_round_trips_its_call_costs_and_refuses_bad_ones(tmp_path):
    spec = dataclasses.replace(PRESETS["local"], call_latency={"all_reduce": 250e-6, "all_gather": 1e-3})
    path = tmp_path / "c.toml"
    path.write_text(spec.to_toml())
    assert load_cluster(str(path)).call_latency == pytest.approx(spec.call_latency)
    for bad in ('all_reduce = -1', 'gather = 5', 'all_reduce = "fast"', 'all_reduce = inf'):
        path.write_text(spec.to_toml().split("[call_latency_us]")[0] + "[call_latency_us]\n" + bad + "\n")
        with pytest.raises(ClusterError, match="call_latency_us"):
            load_cluster(str(path))


def test_when_calls_cost_the_tp_search_prefers_megatron_to_per_layer_gathers():
    """A 4-layer GPT at tp=2 on 2 CPU processes. Priced by bytes alone, sharding the batch and
    gathering each layer's weights looks cheapest (131 collectives a step); with gloo's measured
    cost per call (order 1 ms here), the column-then-row layout's few all-reduces win."""
    from examples.models import GPT, GPTConfig
    from partita.compiler.compile import compile_model
    from partita.core.model.inputs import parse_input_spec

    def model():
        torch.manual_seed(0)
        return GPT(GPTConfig(vocab_size=1024, block_size=128, n_layer=4, n_head=4, n_embd=256))

    calls = {}
    for cost in (0.0, 1e-3):
        cluster = dataclasses.replace(PRESETS["local"], gpus_per_node=2, flops={"fp32": 60e9},
                                      call_latency={k: cost for k in COLLECTIVES})
        plan = compile_model(model, Options(inputs=[parse_input_spec("idx=int64[16,128]")], cluster=cluster,
                                            world_size=2, tp=2)).plan
        count = collections.Counter()
        for c in plan.collectives:
            count[c.kind] += c.count
        linear = collections.Counter(n.strategy for n in plan.nodes if "linear" in n.op)
        calls[cost] = (sum(count.values()), linear)
    assert calls[0.0][0] > 100 and set(calls[0.0][1]) == {"shard(0)"}  # the batch split, weights gathered
    assert calls[1e-3][0] < 40 and {"col", "row"} <= set(calls[1e-3][1])  # Megatron's split


def test_a_roofline_cluster_prices_an_op_by_the_longer_of_its_flops_and_its_bytes(tmp_path):
    """An elementwise op moves bytes, not FLOPs. On a roofline cluster (``partita calibrate`` measures
    the copy bandwidth and turns it on; the GPU presets are fitted with it on) it takes its bytes' time;
    a matmul keeps its FLOPs' time."""
    from partita.passes.cost_model import compute_time

    local = dataclasses.replace(PRESETS["local"], flops={"fp32": 100e9}, efficiency=1.0, hbm_bandwidth=20e9)
    roof = dataclasses.replace(local, roofline=True)
    # hand-worked: 1e6 FLOPs at 100 GFLOP/s = 10 us; 4 MB at 20 GB/s = 200 us
    assert compute_time(1e6, local, "fp32", 4e6) == pytest.approx(10e-6)
    assert compute_time(1e6, roof, "fp32", 4e6) == pytest.approx(200e-6)
    # a matmul: 1e10 FLOPs = 100 ms beats its 4 MB
    assert compute_time(1e10, roof, "fp32", 4e6) == pytest.approx(0.1)
    assert PRESETS["dgx-a100"].roofline and PRESETS["dgx-h100"].roofline and not PRESETS["local"].roofline
    c = calibrated_local(nproc=2, cpu_name="cpu", memory_bytes=2**32, matmul_flops=5e10, beta=1e9, alpha=1e-4,
                         call_seconds={}, call_bytes=4096, seconds=1.0, memory_bandwidth=25e9, op_seconds=6e-6)
    assert c.roofline and c.hbm_bandwidth == 25e9 and c.kernel_s == 6e-6
    path = tmp_path / "c.toml"
    path.write_text(c.to_toml())
    back = load_cluster(str(path))
    assert back.roofline and back.hbm_bandwidth == pytest.approx(25e9) and back.kernel_s == pytest.approx(6e-6)
    path.write_text(c.to_toml().replace("roofline = true", 'roofline = "yes"'))
    with pytest.raises(ClusterError, match="roofline"):
        load_cluster(str(path))


def test_an_elementwise_node_is_priced_by_its_bytes_on_a_roofline_cluster():
    """The node's bytes (``annotate_flops``: inputs read + output written; backward about twice)
    reach the per-node costs the TP ILP and the pipeline cut by (passes/tp/costs.py,
    passes/pipeline/costs.py)."""
    from partita.core.model.capture import capture
    from partita.core.model.inputs import parse_input_spec
    from partita.core.pins import TrainingRequest
    from partita.passes.pipeline.costs import node_costs
    from partita.passes.profile import profile_model

    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1024))

        def forward(self, x):
            return (x * self.w).sum()

    p = profile_model(capture(Scale, [parse_input_spec("x=float32[256,1024]")]))
    mul = next(n for n, a in p.graph.nodes(data=True) if a["op"].endswith("mul.Tensor"))
    a = p.graph.nodes[mul]
    assert a["bytes_fwd"] == 256 * 1024 * 4 * 2 + 1024 * 4  # x and w read, the product written
    roof = dataclasses.replace(PRESETS["local"], flops={"fp32": 100e9}, efficiency=1.0, hbm_bandwidth=10e9,
                               roofline=True, kernel_s=0.0)  # no per-kernel cost: the bytes alone
    request = TrainingRequest(global_batch=256, precision="fp32")
    costs = node_costs(p, roof, request, 256)
    i = costs.order.index(mul)
    assert costs.forward_s[i] == pytest.approx(a["bytes_fwd"] / 10e9)  # 256K FLOPs would be 2.6 us
    assert costs.backward_s[i] == pytest.approx(2 * a["bytes_fwd"] / 10e9)
    flat = node_costs(p, dataclasses.replace(roof, roofline=False), request, 256)
    assert flat.forward_s[i] == pytest.approx(a["flops_fwd"] / 100e9)
