"""Clusters from measurements, and where every predicted figure comes from.

``calibrated_local`` and ``calibrated_gpu`` turn `partita calibrate`'s measurements
(runtime/calibrate.py) into cluster files, each figure's source naming the calibration;
``prediction_sources`` says, for a plan's predicted compute, communication, optimizer step and
memory, which of a cluster's figures they are made of and where those come from (a data sheet, a
fit with its data and date, a calibration), as the plan records them (``Prediction.sources``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from partita.core.cluster import PRESETS, ClusterSpec, Link
from partita.passes.cost_model import collective_time

# The cluster figures each predicted number is made of (``prediction_sources``)
FIGURE_FIELDS = {
    "compute": ("flops", "efficiency", "attention_efficiency", "memory_efficiency", "kernel_s", "launch_s"),
    "communication": ("intra_node_bandwidth", "inter_node_bandwidth", "intra_node_latency", "inter_node_latency",
                      "call_latency"),
    "optimizer": ("hbm_bandwidth",),
    "memory": ("memory_bytes", "memory_reserve", "alloc_granularity", "fragmentation"),
}
MEASURED_BY_ANALYSIS = ("saved activations and each op's transient measured by running the captured graph "
                        "forward and backward under fake tensors (passes/activations.py)")


def prediction_sources(cluster: ClusterSpec) -> dict[str, str]:
    """Where each of a plan's predicted figures comes from, by figure: the cluster's name and the
    sources its preset or file records for the fields that figure is made of (a data sheet, a fit
    with its data and date, `partita calibrate`), else the cluster's own ``source``. The step time
    is compute, communication and the optimizer together."""
    out = {}
    for figure, fields in FIGURE_FIELDS.items():
        texts = list(dict.fromkeys(cluster.sources[f] for f in (*fields, "all") if f in cluster.sources))
        out[figure] = f"{cluster.name}: " + ("; ".join(texts) or cluster.source or "its cluster file")
    out["memory"] += "; " + MEASURED_BY_ANALYSIS
    return out


def calibrated_local(*, nproc: int, cpu_name: str, memory_bytes: int, matmul_flops: float, beta: float,
                     alpha: float, call_seconds: Mapping[str, float], call_bytes: int, seconds: float,
                     memory_bandwidth: float = 0.0, op_seconds: float = 0.0) -> ClusterSpec:
    """The `local` preset with this machine's measured figures (runtime/calibrate.py): each
    collective kind's fixed cost per call is its measured time at ``call_bytes`` less what the
    fitted alpha and beta already explain of it (``collective_time`` without call costs). With a
    measured ``memory_bandwidth`` the cluster is a roofline one: an op takes at least its bytes'
    time (``compute_time``); a measured ``op_seconds`` is each kernel's cost beyond its work
    (``kernel_s``: the host runs every op it issues)."""
    plain = Link(beta, alpha, "measured")
    return dataclasses.replace(
        PRESETS["local"], name="local-calibrated", gpus_per_node=nproc, device_name=cpu_name,
        memory_bytes=int(memory_bytes), flops={"fp32": matmul_flops, "bf16": matmul_flops / 4},
        intra_node_bandwidth=beta, inter_node_bandwidth=beta, intra_node_latency=alpha, inter_node_latency=alpha,
        call_latency={k: max(0.0, t - collective_time(k, call_bytes, nproc if k not in ("send_recv",) else 2, plain))
                      for k, t in call_seconds.items()},
        source=f"partita calibrate: {nproc} processes on {cpu_name}, {seconds:.0f} s",
        sources={"all": f"partita calibrate: measured on {nproc} processes on {cpu_name}"},
        # the device is the host: offload's copies and the host's optimizer step run at memory speed
        **({"hbm_bandwidth": memory_bandwidth, "roofline": True, "host_bandwidth": memory_bandwidth,
            "host_memory_bandwidth": memory_bandwidth} if memory_bandwidth > 0 else {}),
        **({"kernel_s": op_seconds} if op_seconds > 0 else {}),
    )


def calibrated_gpu(r: Any, *, date: str) -> ClusterSpec:
    """The cluster file's figures from a GPU calibration (runtime/calibrate.py ``GpuCalibration``):
    one node of ``r.devices`` of the measured device, every per-op figure the measured one, the NCCL
    link's alpha and beta and per-call costs where two or more GPUs were measured (else the
    `dgx-h100` preset's NVLink figures, said so), each figure's source naming the calibration."""
    measured = f"partita calibrate on {r.device_name}, {date}"
    base = PRESETS["dgx-h100"]
    link = dict(intra_node_bandwidth=r.allreduce_beta, inter_node_bandwidth=r.allreduce_beta,
                intra_node_latency=r.allreduce_alpha, inter_node_latency=r.allreduce_alpha,
                call_latency={k: max(r.launch_s, t - collective_time(k, 4096, r.devices if k != "send_recv" else 2,
                                                                     Link(r.allreduce_beta, r.allreduce_alpha, "")))
                              for k, t in (r.call_seconds or {}).items()}) if r.allreduce_beta else {}
    sources = {f: measured for f in ("efficiency", "kernel_s", "hbm_bandwidth", "memory_efficiency", "launch_s",
                                     "attention_efficiency", "memory_bytes")}
    sources["flops"] = r.peak_source
    for f in ("intra_node_bandwidth", "inter_node_bandwidth", "intra_node_latency", "inter_node_latency",
              "call_latency"):
        sources[f] = measured + " (NCCL)" if link else "not measured (one GPU): the dgx-h100 preset's"
    for f in ("alloc_granularity", "fragmentation", "memory_reserve"):
        sources[f] = base.sources.get(f, "the dgx-h100 preset's")
    return dataclasses.replace(
        base, name="gpu-calibrated", nodes=1, gpus_per_node=r.devices, device_name=r.device_name,
        memory_bytes=int(r.memory_bytes), flops={"bf16": r.peak_flops, "fp16": r.peak_flops, "fp32": r.peak_fp32},
        efficiency=r.efficiency, kernel_s=r.kernel_s, hbm_bandwidth=r.hbm_bandwidth,
        memory_efficiency=r.memory_efficiency, launch_s=r.launch_s, attention_efficiency=r.attention_efficiency,
        roofline=True, source=f"{measured}, {r.seconds:.0f} s", sources=sources, **link)
