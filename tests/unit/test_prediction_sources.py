"""Every predicted number names where it comes from, and `partita calibrate`'s GPU path (issue 26).

A plan records each prediction's source (``Prediction.sources``: the preset's data sheet, a fit
with its data and date, or a calibration); `partita show` and the viewer print them, and on the
`local` preset as shipped they say its figures are guesses and point to `partita calibrate`. The
GPU calibration cannot run here (no CUDA): its fit and the cluster file it writes are checked on
figures made up for the purpose; the measuring runs where a GPU is (runtime/calibrate.py).
"""

from __future__ import annotations

import functools

import pytest
from rich.console import Console

from examples.models import gpt_tiny
from partita.compiler.compile import compile_model
from partita.compiler.report import CALIBRATE_HINT, plan_summary, uncalibrated
from partita.compiler.view import page_data, render_html
from partita.core.cluster import FITTED, PRESETS, load_cluster
from partita.core.options import Options
from partita.passes.calibrated import calibrated_gpu, calibrated_local, prediction_sources
from partita.runtime.calibrate import GpuCalibration, fit_gemm


@functools.cache
def _plan(cluster: str):
    return compile_model(gpt_tiny, Options(inputs=["idx=int64[8,64]"], cluster=cluster, devices=2,
                                           world_size=2)).plan


def _shown(plan) -> str:
    console = Console(width=300, record=True)
    console.print(plan_summary(plan))
    return console.export_text()


def test_an_uncalibrated_local_plan_says_so_and_points_to_calibrate():
    plan = _plan("local")
    assert uncalibrated(plan)
    text = _shown(plan)
    assert "uncalibrated" in text and "partita calibrate -o local.toml" in text
    for figure in ("compute", "communication", "optimizer", "memory"):
        assert f"source: {figure}" in text and "not measured on this machine" in plan.predicted.sources[figure]
    data = page_data(plan)
    assert data["uncalibrated"] == CALIBRATE_HINT and data["sources"] == dict(plan.predicted.sources)
    assert 'id: "uncalibrated"' in render_html(plan)  # the page draws the banner from the data


def test_a_gpu_presets_predictions_name_their_data_sheet_and_fit():
    plan = _plan("h200")
    assert not uncalibrated(plan)
    s = plan.predicted.sources
    assert f"fitted {FITTED}" in s["compute"] and "tests/data/h200_2026-12-04.json" in s["compute"]
    assert "vendor data sheet" in s["compute"]  # the peak FLOP/s
    assert "passes/activations.py" in s["memory"] and "5% of the peak" in s["memory"]  # the stated headroom
    assert "uncalibrated" not in _shown(plan)
    a100 = prediction_sources(PRESETS["dgx-a100"])
    assert "Megatron-LM's Table 1" in a100["compute"]


def test_a_calibrated_local_cluster_names_the_calibration(tmp_path):
    c = calibrated_local(nproc=2, cpu_name="a cpu", memory_bytes=2**32, matmul_flops=5e10, beta=1e9, alpha=1e-4,
                         call_seconds={}, call_bytes=4096, seconds=3.0)
    path = tmp_path / "local.toml"
    path.write_text(c.to_toml())
    back = load_cluster(str(path))
    assert back.source.startswith("partita calibrate") and "partita calibrate" in back.sources["all"]
    assert all("partita calibrate" in v for v in prediction_sources(back).values())


def test_the_gpu_calibrations_fit_and_cluster_file():
    """GEMMs timed as t = F / (989 TFLOP/s x 0.75) + 9 us are fitted back to efficiency 0.75 and 9 us
    a kernel; the cluster file carries every measured figure, says where each came from, and loads."""
    peak = 989e12
    shapes = [(8192, 8192, 8192), (8192, 768, 768), (2048, 2048, 512), (512, 512, 512), (256, 256, 256)]
    gemm = [(m, n, k, 2 * m * n * k / (peak * 0.75) + 9e-6) for m, n, k in shapes]
    efficiency, kernel_s = fit_gemm(gemm, peak)
    assert efficiency == pytest.approx(0.75, rel=1e-6) and kernel_s == pytest.approx(9e-6, rel=1e-6)
    r = GpuCalibration(device_name="NVIDIA H200", devices=8, memory_bytes=141 * 10**9, peak_flops=peak,
                       peak_fp32=67e12, peak_source="H200 data sheet (docs/references.md)", gemm=tuple(gemm),
                       efficiency=efficiency, kernel_s=kernel_s, hbm_bandwidth=4.2e12, memory_efficiency=0.45,
                       launch_s=30e-6, attention_efficiency=0.5, allreduce_alpha=6e-6, allreduce_beta=350e9,
                       call_seconds={"all_reduce": 60e-6, "send_recv": 20e-6}, seconds=42.0)
    c = calibrated_gpu(r, date="2026-12-05")
    assert (c.name, c.device, c.gpus_per_node, c.roofline) == ("gpu-calibrated", "cuda", 8, True)
    assert (c.efficiency, c.kernel_s, c.launch_s, c.hbm_bandwidth) == (efficiency, kernel_s, 30e-6, 4.2e12)
    assert c.intra_node_bandwidth == 350e9 and c.call_latency["send_recv"] >= 30e-6  # at least the launch
    assert c.sources["efficiency"] == "partita calibrate on NVIDIA H200, 2026-12-05"
    assert "(NCCL)" in c.sources["intra_node_bandwidth"]


def test_the_gpu_cluster_file_round_trips(tmp_path):
    r = GpuCalibration(device_name="NVIDIA H100 80GB HBM3", devices=1, memory_bytes=80 * 10**9, peak_flops=989e12,
                       peak_fp32=67e12, peak_source="H100 data sheet (docs/references.md)", gemm=(),
                       efficiency=0.78, kernel_s=1e-5, hbm_bandwidth=3e12, memory_efficiency=0.4, launch_s=35e-6,
                       attention_efficiency=0.5, seconds=10.0)
    c = calibrated_gpu(r, date="2026-12-05")
    assert "not measured (one GPU)" in c.sources["intra_node_bandwidth"]  # no NCCL between one GPU
    path = tmp_path / "gpu.toml"
    path.write_text(c.to_toml())
    back = load_cluster(str(path))
    for f in ("efficiency", "kernel_s", "launch_s", "memory_efficiency", "attention_efficiency", "hbm_bandwidth"):
        assert getattr(back, f) == pytest.approx(getattr(c, f), rel=1e-5), f
    assert back.sources == c.sources and back.device == "cuda"
