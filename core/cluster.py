"""Cluster specs: built-in presets and small TOML files.

A cluster is ``nodes`` x ``gpus_per_node`` identical devices. Bandwidths are
per device and per direction, in bytes/s, as the alpha-beta model of
docs/references.md wants them: the bandwidth one device gets when every
device in the group sends at once.

Preset figures (vendor, dense, no sparsity; docs/references.md):
- A100 SXM 80GB: 312 TFLOP/s bf16, 19.5 fp32 (no TF32), 2.0 TB/s HBM,
  NVLink 600 GB/s bidirectional = 300 GB/s per direction; DGX A100: 8 x 200 Gb/s
  HDR InfiniBand = 25 GB/s per GPU between nodes.
- H100 SXM 80GB: 989 TFLOP/s bf16, 67 fp32, 3.35 TB/s, NVLink 900 GB/s
  bidirectional = 450 per direction; 8 x 400 Gb/s NDR = 50 GB/s per GPU.
- H200 SXM 141GB: as H100, with 141 GB at 4.8 TB/s.
- ``ethernet-10g``: 8 A100 PCIe 80GB per node, no NVLink (PCIe 4.0 x16, 32 GB/s per
  direction), one 10 GbE port per node shared by 8 GPUs = 0.156 GB/s per GPU between nodes.
- Latencies are assumptions: 5 us inside a node, 10 us over InfiniBand, 50 us over TCP.
- ``local``: this machine's CPU processes; rough defaults, replaced by
  ``partita calibrate``.

Each GPU preset carries per-op figures fitted to one H200's steps and checked against Megatron-LM's
Table 1; ``sources`` says where each comes from (docs/references.md, "Fitted figures").
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from partita.core.cluster_file import (
    CLUSTER_HINT,
    COLLECTIVES,
    GB,
    TFLOPS,
    cluster_toml,
    finite_number,
    toml_values,
)
from partita.core.errors import POSITIVE_HINT, ClusterError
from partita.core.mesh import Mesh, axis_crosses_nodes, crosses_nodes, stage_pair_crosses_nodes
from partita.core.precision import DTYPES

if sys.version_info >= (3, 11):
    pass
else:  # pragma: no cover
    pass

DEVICES = ("cuda", "cpu")  # the torch device types the runtime runs on
# The figures a device or link partita plans for can have, in SI units: a value outside is a slip of
# units (memory_gb = 1e-9 is one byte) or a size the search is not built for (it weighs every mesh
# of the devices: 65,536 of them plan in about 30 s on a 2-core machine).
MAX_DEVICES = 65_536
MAX_DEVICES_PER_NODE = 1_024
RANGES = {
    "memory_bytes": (1e7, 1e14),  # 10 MB to 100 TB per device
    "hbm_bandwidth": (1e6, 1e16),  # bytes/s
    "intra_node_bandwidth": (1e6, 1e16),
    "inter_node_bandwidth": (1e3, 1e16),
    "intra_node_latency": (0.0, 10.0),  # seconds per hop
    "inter_node_latency": (0.0, 10.0),
    "step_overhead_s": (0.0, 100.0),
    "flops": (1e6, 1e18),  # FLOP/s per device, per dtype
    "call_latency": (0.0, 10.0),  # seconds per call
    "attention_efficiency": (0.0, 1.0),  # fractions of the device's peak (0: as ``efficiency``)
    "memory_efficiency": (1e-3, 1.0),
    "kernel_s": (0.0, 1.0),  # seconds per kernel
    "launch_s": (0.0, 1.0),  # seconds per op issued
    "alloc_granularity": (1, 1 << 30),  # bytes
    "fragmentation": (0.0, 0.9),  # a fraction of the step's peak
    "host_bandwidth": (0.0, 1e16),  # bytes/s (0: no offload)
    "host_memory_bandwidth": (0.0, 1e16),
}
# the `local` preset's source: its figures are guesses until `partita calibrate` measures this machine
UNCALIBRATED = "rough defaults for CPU processes on gloo; run `partita calibrate` to measure"


@dataclass(frozen=True)
class Link:
    """One class of link: per-device bandwidth (bytes/s, one direction), latency per hop, and
    the fixed cost of one call by collective kind (the library's and the framework's work around
    the transfer, which alpha-beta leaves out: many small collectives cost what their calls cost)."""

    bandwidth: float
    latency: float
    name: str
    call_latency: tuple[tuple[str, float], ...] = ()  # (collective kind, seconds per call)

    def call_s(self, kind: str) -> float:
        """Seconds one call of ``kind`` costs beyond its alpha-beta time."""
        return dict(self.call_latency).get(kind, 0.0)


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    nodes: int
    gpus_per_node: int
    device: str  # torch device type the runtime uses: "cuda" | "cpu"
    device_name: str
    memory_bytes: int  # per device
    flops: Mapping[str, float]  # peak dense FLOP/s per device by dtype: "bf16", "fp16", "fp32"
    efficiency: float  # achieved / peak for the model's matmuls
    hbm_bandwidth: float  # bytes/s per device (optimizer step is memory-bound)
    intra_node_bandwidth: float  # bytes/s per device, one direction
    inter_node_bandwidth: float  # bytes/s per device, one direction
    intra_node_latency: float  # seconds per hop
    inter_node_latency: float
    nvlink: bool
    memory_reserve: float = 0.1  # fraction of memory kept back (allocator, NCCL buffers, workspace)
    step_overhead_s: float = 0.0  # fixed cost per micro-batch (launch, Python)
    # an op takes the longer of its FLOPs' time and its bytes' time at hbm_bandwidth (a roofline):
    # on for the GPU presets (fitted with it) and where ``partita calibrate`` measured the bandwidth
    roofline: bool = False
    source: str = ""
    # seconds per call by collective kind, beyond alpha-beta (``partita calibrate`` measures it)
    call_latency: Mapping[str, float] = field(default_factory=dict)
    # The time model's per-op terms (passes/cost_model.py ``op_time``; docs/cost-model.md, "Compute time"):
    attention_efficiency: float = 0.0  # achieved / peak of the attention kernels (0: ``efficiency``)
    memory_efficiency: float = 1.0  # achieved / peak ``hbm_bandwidth`` of memory-bound ops and the optimizer
    kernel_s: float = 0.0  # device time a kernel costs beyond its work (launch latency, ramp-up, last wave)
    launch_s: float = 0.0  # host time to issue one op (dispatch, autograd, launch): no op takes less
    # The memory model's allocator terms (passes/peak_memory.py ``peak_memory``):
    alloc_granularity: int = 1  # the allocator rounds every block up to this many bytes (CUDA's caching: 512)
    fragmentation: float = 0.0  # stated headroom for the allocator's fragmentation, a fraction of the peak
    # where each figure comes from, by field: a data sheet, a fit with its data and date, or a calibration
    sources: Mapping[str, str] = field(default_factory=dict)
    # The host, for optimizer offload (passes/cost_model.py ``offload_step_time``); 0: not known, no offload
    host_bandwidth: float = 0.0  # bytes/s per device, one direction, between the device and host memory (PCIe)
    host_memory_bandwidth: float = 0.0  # bytes/s of host memory per device (its share): the host's optimizer step

    def __post_init__(self) -> None:
        """Every field checked where a cluster is made (a preset, a TOML file, a plan's copy):
        the first that is wrong is named with its value and what it must be."""
        def bad(what: str) -> ClusterError:
            return ClusterError(f"cluster {self.name!r}: {what}", hint=CLUSTER_HINT)

        for name in ("name", "device_name"):
            v = getattr(self, name)
            if not isinstance(v, str):
                raise bad(f"{name} = {v!r} must be text")
            if not v.isprintable():  # a terminal would act on an escape sequence in it
                raise bad(f"{name} = {v!r} holds control characters")
        for name in ("nodes", "gpus_per_node"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise bad(f"{name}={v!r} must be a positive integer")
        for name in ("memory_bytes", "efficiency", "hbm_bandwidth", "intra_node_bandwidth", "inter_node_bandwidth"):
            if not finite_number(getattr(self, name), low=0, low_open=True):
                raise bad(f"{name}={getattr(self, name)!r} must be a positive number")
        if self.efficiency > 1:
            raise bad(f"efficiency={self.efficiency} must be in (0, 1]")
        for name in ("attention_efficiency", "memory_efficiency", "kernel_s", "launch_s", "fragmentation",
                     "host_bandwidth", "host_memory_bandwidth"):
            if not finite_number(getattr(self, name), low=0):
                raise bad(f"{name}={getattr(self, name)!r} must be a finite number >= 0")
        if isinstance(self.alloc_granularity, bool) or not isinstance(self.alloc_granularity, int):
            raise bad(f"alloc_granularity={self.alloc_granularity!r} must be a whole number of bytes")
        if not isinstance(self.sources, Mapping) or any(
                not isinstance(k, str) or not isinstance(v, str) or not v.isprintable()
                for k, v in self.sources.items()):
            raise bad(f"sources must map a figure's name to text, got {self.sources!r}")
        if not finite_number(self.memory_reserve, low=0) or self.memory_reserve >= 1:
            raise bad(f"memory_reserve={self.memory_reserve!r} must be in [0, 1)")
        for name in ("intra_node_latency", "inter_node_latency", "step_overhead_s"):
            if not finite_number(getattr(self, name), low=0):
                raise bad(f"{name}={getattr(self, name)!r} must be a finite number >= 0")
        if self.device not in DEVICES:
            raise bad(f"device {self.device!r} is not one of {', '.join(DEVICES)}")
        if not isinstance(self.nvlink, bool):
            raise bad(f"nvlink={self.nvlink!r} must be true or false")
        if not isinstance(self.roofline, bool):
            raise bad(f"roofline={self.roofline!r} must be true or false")
        if not isinstance(self.flops, Mapping) or not self.flops or any(
                not isinstance(k, str) or not finite_number(v, low=0, low_open=True) for k, v in self.flops.items()):
            got = dict(self.flops) if isinstance(self.flops, Mapping) else self.flops
            raise bad(f"flops needs a positive finite rate per dtype, got {got!r}")
        if not isinstance(self.call_latency, Mapping) or any(
                k not in COLLECTIVES or not finite_number(v, low=0) for k, v in self.call_latency.items()):
            raise bad(f"call latency takes seconds >= 0 per collective kind ({', '.join(COLLECTIVES)}), "
                      f"got {self.call_latency!r}")
        if self.world_size > MAX_DEVICES or self.gpus_per_node > MAX_DEVICES_PER_NODE:
            raise ClusterError(f"cluster {self.name!r}: {self.nodes:,} node(s) x {self.gpus_per_node:,} devices = "
                               f"{self.world_size:,} devices; partita plans for up to {MAX_DEVICES:,} devices, "
                               f"{MAX_DEVICES_PER_NODE:,} per node", hint="plan for fewer nodes (--nodes) or devices "
                               "per node (--devices); the plan for a part of the cluster is the same per replica")
        unknown = sorted(set(self.flops) - set(DTYPES))
        if unknown:
            raise bad(f"flops for {', '.join(map(repr, unknown))}: the rates are given per dtype, "
                      f"{', '.join(DTYPES)}")
        figures = [(name, getattr(self, name)) for name in RANGES if name not in ("flops", "call_latency")]
        figures += [(f"flops[{k}]", v) for k, v in self.flops.items()]
        figures += [(f"call_latency[{k}]", v) for k, v in self.call_latency.items()]
        for name, v in figures:
            low, high = RANGES[name.split("[")[0]]
            if not low <= v <= high:
                raise bad(f"{name}={v:g} is outside the range partita plans for, {low:g} to {high:g} "
                          "(SI units: bytes, seconds, FLOP/s; a cluster file gives GB, GB/s, us, ms and TFLOP/s)")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def usable_memory(self) -> int:
        return int(self.memory_bytes * (1 - self.memory_reserve))

    @property
    def intra_link(self) -> Link:
        return Link(self.intra_node_bandwidth, self.intra_node_latency, "NVLink" if self.nvlink else "intra-node",
                    tuple(sorted(self.call_latency.items())))

    @property
    def inter_link(self) -> Link:
        return Link(self.inter_node_bandwidth, self.inter_node_latency, "inter-node",
                    tuple(sorted(self.call_latency.items())))

    def link_for_group(self, group_size: int, stride: int = 1) -> Link:
        """The slowest link a group of ``group_size`` ranks spaced ``stride`` apart spans.

        Ranks are numbered node by node, so a group stays inside a node when
        its span ``(group_size - 1) * stride + 1`` fits in one node and the node
        size is a multiple of that span.
        """
        if group_size <= 1:
            return self.intra_link
        span = (group_size - 1) * stride + 1
        if self.nodes == 1 or (span <= self.gpus_per_node and self.gpus_per_node % (group_size * stride) == 0):
            return self.intra_link
        return self.inter_link

    def link_for_ranks(self, ranks: Iterable[int]) -> Link:
        """The link a collective among exactly ``ranks`` runs on (core/mesh.py's node rule)."""
        return self.inter_link if crosses_nodes(ranks, self.gpus_per_node) else self.intra_link

    def link_for_axis(self, mesh: Mesh, axis: str) -> Link:
        """The slowest link any group along mesh axis ``axis`` spans."""
        if getattr(mesh, axis) <= 1:
            return self.intra_link
        return self.inter_link if axis_crosses_nodes(mesh, axis, self.gpus_per_node) else self.intra_link

    def stage_links(self, mesh: Mesh, chunks: int = 1) -> tuple[Link, ...]:
        """``links[s]``: the link between pipeline stage s and s + 1 (peers share dp and tp coordinates;
        inter-node when any pair spans nodes); with ``chunks`` per rank, between virtual stages, the
        last rank's link to the first inter-node when the pipeline spans nodes."""
        ranks = tuple(self.inter_link if stage_pair_crosses_nodes(mesh, s, self.gpus_per_node) else self.intra_link
                      for s in range(mesh.pp - 1))
        wrap = self.inter_link if self.inter_link in ranks else self.intra_link
        return ranks if chunks == 1 else tuple(ranks[s % mesh.pp] if s % mesh.pp < mesh.pp - 1 else wrap
                                               for s in range(mesh.pp * chunks - 1))

    def peak_flops(self, dtype: str) -> float:
        if dtype in self.flops:
            return self.flops[dtype]
        if dtype == "fp16" and "bf16" in self.flops:
            return self.flops["bf16"]
        return self.flops.get("fp32", min(self.flops.values()))

    def with_nodes(self, nodes: int) -> ClusterSpec:
        if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
            raise ClusterError(f"--nodes {nodes!r} must be a positive integer", hint=POSITIVE_HINT)
        return dataclasses.replace(self, nodes=nodes)

    def with_devices(self, gpus_per_node: int) -> ClusterSpec:
        if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node < 1:
            raise ClusterError(f"--devices {gpus_per_node!r} must be a positive integer (devices per node)",
                               hint=POSITIVE_HINT)
        return dataclasses.replace(self, gpus_per_node=gpus_per_node)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["flops"] = dict(self.flops)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ClusterSpec:
        """The cluster ``to_dict`` wrote (a plan's copy): a key it does not know, or one it lacks, is
        named, not dropped or left to a TypeError."""
        fields = dataclasses.fields(cls)
        unknown = sorted(set(d) - {f.name for f in fields})
        missing = [f.name for f in fields if f.name not in d and f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING]
        if unknown or missing:
            what = "; ".join(p for p in (unknown and f"unknown key(s) {', '.join(map(str, unknown))}",
                                         missing and f"it lacks {', '.join(missing)}") if p)
            raise ClusterError(f"cluster {d.get('name', '?')!r}: {what}", hint=CLUSTER_HINT)
        return cls(**d)

    def to_toml(self) -> str:
        """The human-unit TOML form read by ``load_cluster`` (core/cluster_file.py)."""
        return cluster_toml(self.to_dict())


# When the GPU presets' per-op figures were fitted, and to what: one H200's step times, partita and eager
# autocast, three GPTs (tests/data; docs/references.md, "Fitted figures")
FITTED, H200_DATA = "2026-12-04", "tests/data/h200_2026-12-04.json"
_VENDOR = "vendor data sheet (docs/references.md, Hardware figures)"
_H200_FIT = f"fitted {FITTED} to one H200's step times ({H200_DATA}; docs/references.md, Fitted figures)"
_GPU_SOURCES = {
    "flops": _VENDOR, "hbm_bandwidth": _VENDOR, "memory_bytes": _VENDOR, "intra_node_bandwidth": _VENDOR,
    "inter_node_bandwidth": _VENDOR,
    "intra_node_latency": "assumption: NCCL's small-message all-reduce on NVSwitch (5 us)",
    "inter_node_latency": "assumption: a hop over InfiniBand (10 us)",
    "attention_efficiency": _H200_FIT, "memory_efficiency": _H200_FIT, "kernel_s": _H200_FIT, "launch_s": _H200_FIT,
    "call_latency": "the fitted launch_s: a collective is an op the host issues",
    "host_bandwidth": "PCIe x16 per direction, 0.8 of the data sheet's (docs/references.md, Hardware figures)",
    "host_memory_bandwidth": "the host's DRAM channels shared by 8 GPUs (docs/references.md, Hardware figures)",
    "alloc_granularity": "PyTorch's CUDA caching allocator rounds every block up to 512 bytes",
    "fragmentation": "assumption: 5% of the peak kept free for the caching allocator's fragmentation",
    "memory_reserve": "assumption: 10% for the CUDA context, NCCL's buffers and cuBLAS's workspace",
}
# the per-op figures fitted to the H200 data (passes/cost_model.py op_time); a collective is an op the host
# issues too, so each call costs the same launch (``call_latency``)
_LAUNCH_S = 40e-6
# A CPU process runs each op where it issues it, so what the host spends on an op (dispatch,
# autograd's bookkeeping, the backward engine's) adds to its work: a chain of tiny ops forward and
# backward takes 4-5 us a kernel with torch 2.13 on this project's CI machine (one thread;
# runtime/calibrate.py ``op_seconds`` measures it). A model of many small ops, and a micro-batch
# of few rows, is bound by it.
_CPU_OP_S = 5e-6
_GPU_TIME = dict(roofline=True, attention_efficiency=0.45, memory_efficiency=0.4, kernel_s=12e-6, launch_s=_LAUNCH_S,
                 call_latency={kind: _LAUNCH_S for kind in COLLECTIVES}, alloc_granularity=512, fragmentation=0.05)


def _a100_like(name: str, **kw: Any) -> ClusterSpec:
    base = dict(
        name=name, nodes=1, gpus_per_node=8, device="cuda", device_name="A100 SXM 80GB",
        memory_bytes=int(80 * GB), flops={"bf16": 312 * TFLOPS, "fp16": 312 * TFLOPS, "fp32": 19.5 * TFLOPS},
        efficiency=0.7, hbm_bandwidth=2.0e12, intra_node_bandwidth=300 * GB, inter_node_bandwidth=25 * GB,
        intra_node_latency=5e-6, inter_node_latency=10e-6, nvlink=True, host_bandwidth=25 * GB,
        host_memory_bandwidth=51.2 * GB,
        source="DGX A100: NVLink 600 GB/s bidirectional, 8x HDR 200 Gb/s (docs/references.md)",
        sources={**_GPU_SOURCES, "efficiency": (
            "0.7: large GEMMs reach 70-80% of the peak (docs/references.md); checked " + FITTED + " against "
            "Megatron-LM's Table 1 (Narayanan et al., SC'21), the per-op figures the H200 fit's")},
        **_GPU_TIME,
    )
    base.update(kw)
    return ClusterSpec(**base)


def _presets() -> dict[str, ClusterSpec]:
    hopper = {**_GPU_SOURCES, "efficiency": _H200_FIT}
    h100 = dict(
        device_name="H100 SXM 80GB", flops={"bf16": 989 * TFLOPS, "fp16": 989 * TFLOPS, "fp32": 67 * TFLOPS},
        hbm_bandwidth=3.35e12, intra_node_bandwidth=450 * GB, inter_node_bandwidth=50 * GB, efficiency=0.8,
        host_bandwidth=50 * GB, host_memory_bandwidth=76.8 * GB, sources=hopper,
    )
    return {
        "dgx-a100": _a100_like("dgx-a100"),
        "dgx-h100": _a100_like(
            "dgx-h100", **h100, source="DGX H100: NVLink 900 GB/s bidirectional, 8x NDR 400 Gb/s (docs/references.md)"
        ),
        "h200": _a100_like(
            "h200", **{**h100, "device_name": "H200 SXM 141GB", "memory_bytes": int(141 * GB), "hbm_bandwidth": 4.8e12},
            source="HGX H200: 141 GB HBM3e 4.8 TB/s, NVLink 900 GB/s, 8x NDR 400 Gb/s (docs/references.md)",
        ),
        "ethernet-10g": _a100_like(
            "ethernet-10g", device_name="A100 PCIe 80GB", intra_node_bandwidth=32 * GB,
            inter_node_bandwidth=1.25 * GB / 8, inter_node_latency=50e-6, nvlink=False,
            source="8 A100 PCIe per node, no NVLink (PCIe 4.0 x16), 10 GbE per node shared by 8 GPUs",
        ),
        "local": ClusterSpec(
            name="local", nodes=1, gpus_per_node=4, device="cpu", device_name="CPU process (gloo)",
            memory_bytes=int(4 * GB), flops={"fp32": 20e9, "bf16": 5e9}, efficiency=1.0, hbm_bandwidth=5 * GB,
            intra_node_bandwidth=1.0 * GB, inter_node_bandwidth=1.0 * GB, intra_node_latency=100e-6,
            inter_node_latency=100e-6, nvlink=False, memory_reserve=0.25, step_overhead_s=2e-3, kernel_s=_CPU_OP_S,
            host_bandwidth=5 * GB, host_memory_bandwidth=5 * GB,  # the device is the host: a copy in memory
            source=UNCALIBRATED,
            sources={"all": "rough defaults for CPU processes, not measured on this machine: run `partita calibrate`"},
        ),
    }


PRESETS: Mapping[str, ClusterSpec] = _presets()


def load_cluster(name_or_path: str, *, nodes: int | None = None, devices: int | None = None) -> ClusterSpec:
    """A preset by name, or a TOML cluster file by path; ``nodes``/``devices`` scale it."""
    if name_or_path in PRESETS:
        spec = PRESETS[name_or_path]
    elif name_or_path.endswith(".toml") or Path(name_or_path).exists():
        spec = ClusterSpec(**toml_values(Path(name_or_path)))
    else:
        raise ClusterError(
            f"unknown cluster {name_or_path!r}",
            hint=f"use a preset ({', '.join(PRESETS)}) or a path to a .toml cluster file "
            "(`partita calibrate -o local.toml` writes one)",
        )
    if devices is not None:
        spec = spec.with_devices(devices)
    if nodes is not None:
        spec = spec.with_nodes(nodes)
    return spec
