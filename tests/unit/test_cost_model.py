"""The cost model against hand-worked and published figures (shared/SEED_NOTES.md, REFERENCE.md)."""

import math

import pytest

from partita.core.cluster import GB, PRESETS, load_cluster
from partita.core.errors import ClusterError
from partita.passes.cost_model import (
    collective_time,
    collective_traffic,
    model_state_memory,
    state_bytes_per_param,
    zero_traffic_elements,
)
from tests.oracles import max_params_fitting


def test_mixed_precision_adam_is_16_bytes_per_param():
    s = state_bytes_per_param("bf16-mixed", "adamw")
    assert (s.params, s.grads, s.optimizer) == (2, 2, 12)
    assert s.total == 16
    assert state_bytes_per_param("fp32", "adam").total == 16  # 4 + 4 + 8 (m, v)
    assert state_bytes_per_param("fp32", "sgd").total == 8
    assert state_bytes_per_param("fp32", "sgd-momentum").total == 12
    assert state_bytes_per_param("bf16-mixed", "adamw", inference=True).total == 2


def test_seed_80gb_holds_under_40b_for_inference_and_5b_for_training():
    mem = 80 * GB
    assert max_params_fitting(mem, state_bytes_per_param("bf16-mixed", "adamw", inference=True)) == 40e9
    assert max_params_fitting(mem, state_bytes_per_param("bf16-mixed", "adamw")) == 5e9
    # 40B exactly fills the card: any activation or workspace pushes it over, hence "under 40B".
    assert model_state_memory(int(40e9), state_bytes_per_param("bf16-mixed", "adamw", inference=True)).total == 80e9


def test_zero_paper_figure_1_7_5b_on_64_gpus():
    # Rajbhandari et al. 2020, Figure 1: Psi = 7.5B, Nd = 64, K = 12.
    s = state_bytes_per_param("bf16-mixed", "adamw")
    psi, nd = int(7.5e9), 64
    gb = lambda m: m.total / 1e9
    assert gb(model_state_memory(psi, s, zero_stage=0, dp=nd)) == pytest.approx(120.0)
    assert gb(model_state_memory(psi, s, zero_stage=1, dp=nd)) == pytest.approx(31.4, abs=0.05)
    assert gb(model_state_memory(psi, s, zero_stage=2, dp=nd)) == pytest.approx(16.6, abs=0.05)
    assert gb(model_state_memory(psi, s, zero_stage=3, dp=nd)) == pytest.approx(1.875, abs=0.001)


def test_seed_zero3_traffic_65b_on_10gbe():
    psi = int(65e9)
    # ZeRO-3 moves 3x the parameters per device per step; the ring's (n-1)/n tends to 1.
    n = 10_000
    elems = zero_traffic_elements(psi, 3, n)
    assert elems == pytest.approx(195e9 * (n - 1) / n)
    assert zero_traffic_elements(psi, 2, n) / elems == pytest.approx(2 / 3)  # ZeRO-3 is 1.5x DP
    ten_gbe = 10e9 / 8  # 1.25 GB/s
    # The seed's own arithmetic counts 1 byte per element: 195 GB = 1560 Gb -> 156 s.
    assert 195e9 * 8 / 1e9 == 1560
    assert 195e9 / ten_gbe == pytest.approx(156.0)
    # With 16-bit parameters and gradients (2 bytes/element) volume and time double.
    assert elems * 2 / ten_gbe == pytest.approx(312.0, rel=1e-3)


def test_collective_formulas_hand_worked():
    link = PRESETS["dgx-a100"].intra_link  # 300 GB/s, 5 us, and a call costs the 40 us of launching an op
    call = 40e-6
    assert all(link.call_s(kind) == call for kind in ("all_reduce", "all_gather", "reduce_scatter", "send_recv"))
    s = 1e9
    # ring all-reduce on 8: 2*7*5us + 2 * 1e9 * 7/8 / 300e9
    assert collective_time("all_reduce", s, 8, link) == pytest.approx(call + 14 * 5e-6 + 1.75e9 / 300e9)
    assert collective_time("all_gather", s, 8, link) == pytest.approx(call + 7 * 5e-6 + 0.875e9 / 300e9)
    assert collective_time("reduce_scatter", s, 8, link) == collective_time("all_gather", s, 8, link)
    assert collective_time("send_recv", s, 2, link) == pytest.approx(call + 5e-6 + s / 300e9)
    assert collective_time("all_reduce", s, 1, link) == 0.0
    assert collective_traffic("all_reduce", s, 4) == pytest.approx(1.5e9)
    with pytest.raises(ValueError):
        collective_time("all_sum", s, 2, link)


def test_groups_spanning_nodes_run_at_inter_node_bandwidth():
    c = load_cluster("dgx-a100", nodes=4)
    assert c.world_size == 32
    assert c.link_for_group(8).bandwidth == 300 * GB  # one node, NVLink
    assert c.link_for_group(16).bandwidth == 25 * GB  # spans two nodes
    assert c.link_for_group(4, stride=8).bandwidth == 25 * GB  # one GPU per node
    eth = load_cluster("ethernet-10g", nodes=2)
    assert not eth.nvlink
    assert eth.link_for_group(16).bandwidth == pytest.approx(1.25e9 / 8)


def test_presets_carry_reference_figures():
    a, h, h2 = PRESETS["dgx-a100"], PRESETS["dgx-h100"], PRESETS["h200"]
    assert a.peak_flops("bf16") == 312e12 and h.peak_flops("bf16") == 989e12
    assert a.memory_bytes == 80e9 and h2.memory_bytes == 141e9
    assert {"dgx-a100", "dgx-h100", "h200", "ethernet-10g", "local"} <= set(PRESETS)


def test_unknown_cluster_and_bad_toml(tmp_path):
    with pytest.raises(ClusterError, match="unknown cluster 'dgx-z900'"):
        load_cluster("dgx-z900")
    bad = tmp_path / "c.toml"
    bad.write_text("nodes = 2\n")
    with pytest.raises(ClusterError, match="lacks"):
        load_cluster(str(bad))
    bad.write_text("nodes = 'two'\ngpus_per_node = 8\nmemory_gb = 80\nintra_node_gb_per_s = 300\n"
                   "inter_node_gb_per_s = 25\n[tflops]\nbf16 = 312\n")
    with pytest.raises(ClusterError, match="nodes"):
        load_cluster(str(bad))
    with pytest.raises(ClusterError, match="positive"):
        load_cluster("dgx-a100", nodes=0)


def test_toml_round_trip(tmp_path):
    c = load_cluster("dgx-h100", nodes=2)
    path = tmp_path / "h100.toml"
    path.write_text(c.to_toml())
    back = load_cluster(str(path))
    for f in ("nodes", "gpus_per_node", "memory_bytes", "nvlink"):
        assert getattr(back, f) == getattr(c, f)
    for f in ("intra_node_bandwidth", "inter_node_bandwidth", "intra_node_latency", "efficiency",
              "attention_efficiency", "memory_efficiency", "kernel_s", "launch_s", "fragmentation"):
        assert math.isclose(getattr(back, f), getattr(c, f), rel_tol=1e-5)
    assert back.flops["bf16"] == pytest.approx(989e12)
    # where each figure comes from travels with the file
    assert (back.source, back.sources, back.alloc_granularity, back.roofline) == (c.source, c.sources, 512, True)
    assert back.call_latency == pytest.approx(c.call_latency)


def test_zero_paper_table_1_model_state_per_device():
    """Rajbhandari et al. 2020, Table 1: every cell (7.5B/128B/1T at Nd = 1..1024, Pos, Pos+g,
    Pos+g+p) from model_state_memory, to the paper's printed precision."""

    from benchmarks.published_runs import zero_table_1

    rows = zero_table_1()
    assert len(rows) == 18
    for psi, nd, paper, ours in rows:
        for p, o in zip(paper, ours):
            # the paper prints 3-4 significant figures, some truncated (4187 for 4187.5)
            assert o == pytest.approx(p, rel=5e-3, abs=0.006), (psi, nd, paper, ours)
