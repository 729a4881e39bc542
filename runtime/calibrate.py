"""Measure this machine for the cost model: matmul FLOP/s, memory bandwidth and gloo all-reduce alpha/beta.

``nproc`` local processes run at once (as a data-parallel job on this machine
would), each with ``max(1, cores // nproc)`` torch threads. Each times fp32
matmuls, all at the same time, then a copy larger than the caches (the memory
bandwidth an elementwise op is bound by: the cost model's roofline); then they all-reduce messages of several sizes
and the ring model

    t(S) = 2 (n - 1) alpha + 2 S (n - 1) / n / beta

is fitted to the median times by least squares on relative error (so the
small messages, which set alpha, count as much as the large ones, which set
beta). Last, each collective kind the runtime issues runs on a small message
(``CALL_BYTES``) ``CALL_REPEATS`` times between matmuls: the mean time it adds,
less its alpha-beta time, is that kind's fixed cost per call (``call_latency``:
gloo's and torch's work around the transfer, the ranks' skew and the occasional
stall, which dominate the many small collectives of a tensor-parallel step). Turning the result into a
cluster file is the cost model's job
(passes/calibrated.py ``calibrated_local``).

On a GPU (``calibrate_gpu``, `partita calibrate --device cuda`; it runs where CUDA is, never in
CI): bf16 GEMMs by shape fitted to an efficiency and a per-kernel cost, the HBM's copy bandwidth and
what elementwise ops reach of it, the host's cost to issue an op, attention's efficiency, and with
two or more GPUs NCCL's alpha, beta and cost per call (``calibrated_gpu`` makes the cluster file).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import socket
import statistics
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from partita.runtime.collectives import all_gather_flat, reduce_scatter_flat

DEFAULT_SIZES = tuple(4096 * 4**k for k in range(8))  # 4 KiB .. 64 MiB
DEFAULT_REPEATS = 5
MATMUL_N = 1024
MATMUL_SECONDS = 1.0
TIMEOUT_S = 60
CALL_BYTES = 4096
CALL_REPEATS = 40
COPY_BYTES = 64 * 2**20  # larger than the caches: memory's bandwidth, not a cache's
COPY_REPEATS = 5
CALL_ROUNDS = 3  # a kind's per-call cost is the median of this many (with calls) - (without) loop pairs
CALL_COMPUTE_N = 512  # the matmul between calls (~3 ms on a core here: a layer's matmul, as in a TP step)
OP_CHAIN = 500  # tiny ops in the per-kernel cost's chain (``op_seconds``)
OP_REPEATS = 20
CALL_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")


@dataclass(frozen=True)
class CalibrationResult:
    nproc: int
    matmul_flops: float  # fp32 FLOP/s of one process while all nproc compute at once (median)
    allreduce_beta: float  # bytes/s
    allreduce_alpha: float  # seconds per ring step
    memory_bytes_per_process: int  # total RAM / nproc
    cpu_name: str
    samples: tuple[tuple[int, float], ...]  # (message bytes, median seconds per all-reduce)
    seconds: float  # wall time of the calibration
    call_seconds: dict[str, float]  # mean seconds one CALL_BYTES call adds between compute, by kind
    call_bytes: int = CALL_BYTES
    memory_bandwidth: float = 0.0  # bytes/s one process copies while all nproc copy at once (median; 0: not measured)
    op_seconds: float = 0.0  # host seconds per kernel of a chain of tiny ops, forward and backward (0: not measured)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _total_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def matmul_flops(n: int, seconds: float) -> float:
    """fp32 FLOP/s of ``n`` x ``n`` matmuls in this process over ``seconds`` (the calibrated rate)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)  # warm-up
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        torch.mm(a, b)
        calls += 1
    return 2 * n**3 * calls / elapsed


def op_seconds(ops: int = OP_CHAIN, repeats: int = OP_REPEATS) -> float:
    """Seconds a kernel costs this process beyond its work: a chain of ``ops`` multiplications of
    an 8-element tensor that wants a gradient, run forward and backward (``2 * ops`` kernels, as
    passes/flops.py counts an op's: one forward, one backward), median of ``repeats``. A CPU
    process issues and runs each op itself, so this adds to every op's work (``kernel_s``)."""
    x = torch.ones(8, requires_grad=True)

    def chain() -> None:
        h = x
        for _ in range(ops):
            h = h * 1.0001
        h.sum().backward()

    chain()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        chain()
        times.append(time.perf_counter() - start)
    return statistics.median(times) / (2 * ops)


def _copy_bandwidth(nbytes: int, repeats: int) -> float:
    """Bytes/s one process moves copying a ``nbytes`` buffer (read + write), best of ``repeats``:
    what an elementwise op is bound by here."""
    src = torch.randn(max(1, nbytes // 4))
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * 4 / best


def _allreduce_seconds(nbytes: int, repeats: int, device: torch.device | str = "cpu") -> float:
    t = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
    dist.all_reduce(t)  # warm-up
    times = []
    for _ in range(repeats):
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        dist.all_reduce(t)
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _sync(device: torch.device | str) -> None:
    """Wait for a GPU's queued work (NCCL's calls return once enqueued); nothing on CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _call_seconds(kind: str, nbytes: int, repeats: int, device: torch.device | str = "cpu") -> float:
    """Mean seconds one ``kind`` call of ``nbytes`` (the full array) over the world adds to a
    loop of compute, as the runtime issues them: ``repeats`` times a matmul then the call, less
    the same loop without the calls (send_recv: rank pairs 2k -> 2k + 1).

    Between compute, not after a barrier: a call then also pays for the ranks arriving apart
    and for waking a process that blocked, and on a shared machine an occasional call stalls
    for milliseconds. A step's time is the sum of its calls, so the mean, tail included, is
    what the cost model needs (on 2 gloo processes here a 4 KB all-reduce's median after a
    barrier is ~0.5 ms, its mean between matmuls ~1.7 ms, as a tensor-parallel step measures).

    The cost grows with the compute between calls (the ranks drift further apart, and a process
    that waited longer wakes slower): measured here for a 4 KB all-reduce, 1.3-1.7 ms between
    0.4 ms matmuls, 2.7-3.0 ms between 3.5 ms ones, 3-6 ms between 11 ms ones. The matmul between
    calls (``CALL_COMPUTE_N``, ~3 ms) is sized like a layer's matmul in a tensor-parallel step, the
    plans that issue calls by the dozen; with 0.4 ms between calls the planner's tp2 GPT step
    measured 1.21-1.35x its prediction, with 3 ms a median 1.21 over 15 rounds
    (benchmarks/predicted_vs_measured.py, README). Each kind's cost is the median of ``CALL_ROUNDS`` pairs
    of loops, so that one stalled loop does not set it."""
    n, rank = dist.get_world_size(), dist.get_rank()
    whole = torch.zeros(max(n, nbytes // 4), dtype=torch.float32, device=device)
    whole = whole[: whole.numel() // n * n]
    part = whole[: whole.numel() // n].clone()

    def once() -> None:
        if kind == "all_reduce":
            dist.all_reduce(whole)
        elif kind == "all_gather":
            all_gather_flat(whole, part)
        elif kind == "reduce_scatter":
            reduce_scatter_flat(part, whole)
        elif kind == "all_to_all":
            dist.all_to_all_single(torch.empty_like(whole), whole)
        elif kind == "broadcast":
            dist.broadcast(whole, src=0)
        elif rank % 2 == 0 and rank + 1 < n:
            dist.isend(whole, dst=rank + 1).wait()
        elif rank % 2 == 1:
            dist.irecv(whole, src=rank - 1).wait()

    a = torch.randn(CALL_COMPUTE_N, CALL_COMPUTE_N, device=device)
    b = torch.randn(CALL_COMPUTE_N, CALL_COMPUTE_N, device=device)

    def loop(call: bool) -> float:
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        for _ in range(repeats):
            torch.mm(a, b)
            if call:
                once()
        _sync(device)
        return time.perf_counter() - start

    once()  # warm-up
    loop(True)
    return max(0.0, statistics.median((loop(True) - loop(False)) / repeats for _ in range(CALL_ROUNDS)))


def _worker(rank: int, nproc: int, port: int, sizes: tuple[int, ...], repeats: int,
            threads: int, outdir: str) -> None:
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=nproc, timeout=timedelta(seconds=TIMEOUT_S))
    try:
        dist.barrier()
        flops = matmul_flops(MATMUL_N, MATMUL_SECONDS)
        dist.barrier()
        bandwidth = _copy_bandwidth(COPY_BYTES, COPY_REPEATS)
        dist.barrier()
        per_op = op_seconds()
        dist.barrier()
        samples = [(s, _allreduce_seconds(s, repeats)) for s in sizes]
        calls = {k: _call_seconds(k, CALL_BYTES, CALL_REPEATS) for k in CALL_KINDS}
        # Every rank waits for the slowest, so rank 0's times are the collective's (rank 1's for
        # the receive of a send / receive pair).
        Path(outdir, f"rank{rank}.json").write_text(json.dumps({"flops": flops, "samples": samples, "calls": calls,
                                                                 "bandwidth": bandwidth, "op": per_op}))
    finally:
        dist.destroy_process_group()


def fit_alpha_beta(samples: list[tuple[int, float]], nproc: int) -> tuple[float, float]:
    """(alpha, beta) of t(S) = 2(n-1) alpha + 2S(n-1)/n / beta, least squares on relative error.

    Writing t = a + b x with x = 2S(n-1)/n, each sample is weighted by 1/t.
    A fitted intercept below zero (noise) is clamped: alpha = 0, b refitted alone.
    """
    n = nproc
    xs = [2 * s * (n - 1) / n for s, _ in samples]
    ts = [t for _, t in samples]
    ws = [1 / t**2 for t in ts]  # squared weights of the relative residuals
    sw = sum(ws)
    swx = sum(w * x for w, x in zip(ws, xs))
    swxx = sum(w * x * x for w, x in zip(ws, xs))
    swt = sum(w * t for w, t in zip(ws, ts))
    swxt = sum(w * x * t for w, x, t in zip(ws, xs, ts))
    det = sw * swxx - swx**2
    a = (swxx * swt - swx * swxt) / det
    b = (sw * swxt - swx * swt) / det
    if a < 0:
        a, b = 0.0, swxt / swxx
    return a / (2 * (n - 1)), 1 / b


def calibrate(nproc: int = 4, *, sizes: tuple[int, ...] = DEFAULT_SIZES,
              repeats: int = DEFAULT_REPEATS) -> CalibrationResult:
    """Measure matmul FLOP/s per process and gloo all-reduce alpha/beta among ``nproc`` processes."""
    if nproc < 2:
        raise ValueError(f"nproc={nproc}: an all-reduce needs at least 2 processes")
    if len(sizes) < 2:
        raise ValueError(f"need at least 2 message sizes to fit alpha and beta, got {len(sizes)}")
    start = time.perf_counter()
    threads = max(1, (os.cpu_count() or 1) // nproc)
    with tempfile.TemporaryDirectory() as outdir:
        mp.spawn(_worker, args=(nproc, _free_port(), tuple(sizes), repeats, threads, outdir),
                 nprocs=nproc)
        results = [json.loads(Path(outdir, f"rank{r}.json").read_text()) for r in range(nproc)]
    samples = tuple((int(s), float(t)) for s, t in results[0]["samples"])
    alpha, beta = fit_alpha_beta(list(samples), nproc)
    calls = {**results[0]["calls"], "send_recv": results[1]["calls"]["send_recv"]}
    return CalibrationResult(
        nproc=nproc,
        matmul_flops=statistics.median(r["flops"] for r in results),
        allreduce_beta=beta,
        allreduce_alpha=alpha,
        memory_bytes_per_process=_total_memory() // nproc,
        cpu_name=_cpu_name(),
        samples=samples,
        seconds=time.perf_counter() - start,
        call_seconds=calls,
        memory_bandwidth=statistics.median(r["bandwidth"] for r in results),
        op_seconds=statistics.median(r["op"] for r in results),
    )



# -- a GPU: GEMMs by shape, memory bandwidth, launch cost, NCCL collectives --------------------------
#
# ``calibrate_gpu`` runs where CUDA is (never in CI: the project's tests run on CPU). It measures what
# the cost model's per-op terms are made of (passes/cost_model.py ``op_time``): bf16 GEMMs over a
# range of shapes, fitted as t = F / (peak x efficiency) + kernel_s; a large copy (the HBM's
# bandwidth) and elementwise ops the size of a layer's activations (what ``memory_efficiency`` of it
# they reach); many tiny ops in a row (the host's cost to issue one, ``launch_s``); attention forward
# and backward (``attention_efficiency``); and, with two or more GPUs, NCCL's all-reduce alpha and
# beta and each collective kind's cost per call, as the CPU path measures gloo's.

GEMM_SHAPES = ((8192, 8192, 8192), (8192, 4096, 4096), (8192, 3072, 768), (8192, 768, 3072), (8192, 768, 768),
               (4096, 1024, 1024), (2048, 2048, 512), (1024, 1024, 1024), (512, 512, 512), (256, 256, 256))
ELEMENTWISE_SHAPES = ((8192, 768), (16384, 1024), (16384, 2048), (16384, 4096))
# dense bf16 peak FLOP/s and fp32 of the devices the presets know (docs/references.md), by name fragment
PEAK_FLOPS = {"H200": (989e12, 67e12), "H100": (989e12, 67e12), "A100": (312e12, 19.5e12)}


@dataclass(frozen=True)
class GpuCalibration:
    device_name: str
    devices: int
    memory_bytes: int  # of one device
    peak_flops: float  # bf16, the data sheet's (PEAK_FLOPS), or the best measured where the device is not known
    peak_fp32: float
    peak_source: str
    gemm: tuple[tuple[int, int, int, float], ...]  # (m, n, k, median seconds)
    efficiency: float  # fitted: the large-GEMM rate over the peak
    kernel_s: float  # fitted: a GEMM's time beyond its FLOPs' (latency, last wave)
    hbm_bandwidth: float  # bytes/s of a large device-to-device copy (read + write)
    memory_efficiency: float  # elementwise ops of a layer's size, achieved bandwidth over hbm_bandwidth (median)
    launch_s: float  # seconds one tiny op takes when issued back to back (the host's cost)
    attention_efficiency: float  # SDPA forward + backward, FLOPs (Megatron's count) over time and peak
    allreduce_alpha: float = 0.0  # NCCL, seconds per ring step (0: one GPU, not measured)
    allreduce_beta: float = 0.0  # NCCL, bytes/s (0: not measured)
    call_seconds: dict[str, float] | None = None  # NCCL, per collective kind, beyond alpha-beta at CALL_BYTES
    seconds: float = 0.0


def fit_gemm(samples: list[tuple[int, int, int, float]], peak: float) -> tuple[float, float]:
    """(efficiency, kernel_s) of t = 2 m n k / (peak x efficiency) + kernel_s, least squares on
    relative error (the small GEMMs, which set kernel_s, count as much as the large ones); a
    negative intercept (noise) is clamped to 0 and the slope refitted alone."""
    xs = [2 * m * n * k for m, n, k, _ in samples]
    ts = [t for *_, t in samples]
    ws = [1 / t**2 for t in ts]
    sw, swx = sum(ws), sum(w * x for w, x in zip(ws, xs))
    swxx = sum(w * x * x for w, x in zip(ws, xs))
    swt, swxt = sum(w * t for w, t in zip(ws, ts)), sum(w * x * t for w, x, t in zip(ws, xs, ts))
    det = sw * swxx - swx**2
    b = (swxx * swt - swx * swxt) / det
    a = (sw * swxt - swx * swt) / det
    if b < 0:
        b, a = 0.0, swxt / swxx
    return min(1.0, 1 / (a * peak)), b


def _cuda_seconds(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` on the current CUDA stream (events; one warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _peak(name: str) -> tuple[float, float, str] | None:
    for fragment, (bf16, fp32) in PEAK_FLOPS.items():
        if fragment in name:
            return bf16, fp32, f"{fragment} data sheet (docs/references.md)"
    return None


def measure_gpu(repeats: int = 20) -> GpuCalibration:
    """Everything but the collectives, on CUDA device 0 (the module's section comment)."""
    import torch.nn.functional as F

    start = time.perf_counter()
    dev = torch.device("cuda", 0)
    props = torch.cuda.get_device_properties(dev)
    bf16 = torch.bfloat16
    gemm = []
    for m, n, k in GEMM_SHAPES:
        a, b = torch.randn(m, k, device=dev, dtype=bf16), torch.randn(k, n, device=dev, dtype=bf16)
        gemm.append((m, n, k, _cuda_seconds(lambda a=a, b=b: torch.mm(a, b), repeats)))
    known = _peak(props.name)
    best = max(2 * m * n * k / t for m, n, k, t in gemm)
    peak, peak32, peak_source = known or (best, best / 16, f"the best GEMM measured on this {props.name}")
    efficiency, kernel_s = fit_gemm(gemm, peak)
    big = torch.empty(1 << 28, device=dev, dtype=torch.uint8)  # 256 MiB: beyond every cache
    dst = torch.empty_like(big)
    hbm = 2 * big.numel() / _cuda_seconds(lambda: dst.copy_(big), repeats)
    achieved = []
    for rows, cols in ELEMENTWISE_SHAPES:
        x = torch.randn(rows, cols, device=dev, dtype=bf16)
        w = torch.ones(cols, device=dev, dtype=bf16)
        for op in (lambda x=x: F.gelu(x), lambda x=x, w=w: F.layer_norm(x, (x.shape[-1],), w)):
            achieved.append(2 * x.numel() * 2 / _cuda_seconds(op, repeats))  # read + write, 2 bytes each
    tiny = torch.ones(8, device=dev)
    ops = 2000
    torch.cuda.synchronize()

    def many() -> None:
        for _ in range(ops):
            tiny.add_(1.0)
    launch_s = _cuda_seconds(many, 5) / ops
    q = torch.randn(8, 16, 1024, 64, device=dev, dtype=bf16, requires_grad=True)
    k, v = torch.randn_like(q, requires_grad=True), torch.randn_like(q, requires_grad=True)

    def attention() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    flops = 3.5 * 4 * 8 * 16 * 1024 * 1024 * 64  # forward 4 b h s^2 d, backward 2.5x (passes/flops.py's count)
    attention_efficiency = min(1.0, flops / _cuda_seconds(attention, repeats) / peak)
    return GpuCalibration(
        device_name=props.name, devices=torch.cuda.device_count(), memory_bytes=props.total_memory, peak_flops=peak,
        peak_fp32=peak32, peak_source=peak_source, gemm=tuple(gemm), efficiency=efficiency, kernel_s=kernel_s,
        hbm_bandwidth=hbm, memory_efficiency=min(1.0, statistics.median(achieved) / hbm), launch_s=launch_s,
        attention_efficiency=attention_efficiency, seconds=time.perf_counter() - start)


def _nccl_worker(rank: int, nproc: int, port: int, sizes: tuple[int, ...], repeats: int, outdir: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nproc,
                            timeout=timedelta(seconds=TIMEOUT_S))
    try:
        device = torch.device("cuda", rank)
        samples = [(s, _allreduce_seconds(s, repeats, device)) for s in sizes]
        calls = {k: _call_seconds(k, CALL_BYTES, CALL_REPEATS, device) for k in CALL_KINDS}
        Path(outdir, f"rank{rank}.json").write_text(json.dumps({"samples": samples, "calls": calls}))
    finally:
        dist.destroy_process_group()


def calibrate_gpu(*, sizes: tuple[int, ...] = DEFAULT_SIZES, repeats: int = DEFAULT_REPEATS) -> GpuCalibration:
    """Measure this machine's GPU (``measure_gpu``) and, with two or more, NCCL between all of them."""
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: `partita calibrate --device cpu` measures CPU processes")
    start = time.perf_counter()
    result = measure_gpu()
    nproc = torch.cuda.device_count()
    if nproc < 2:
        return result
    with tempfile.TemporaryDirectory() as outdir:
        mp.spawn(_nccl_worker, args=(nproc, _free_port(), tuple(sizes), repeats, outdir), nprocs=nproc)
        ranks = [json.loads(Path(outdir, f"rank{r}.json").read_text()) for r in range(nproc)]
    samples = [(int(s), float(t)) for s, t in ranks[0]["samples"]]
    alpha, beta = fit_alpha_beta(samples, nproc)
    calls = {**ranks[0]["calls"], "send_recv": ranks[1]["calls"]["send_recv"]}
    return dataclasses.replace(result, allreduce_alpha=alpha, allreduce_beta=beta, call_seconds=calls,
                               seconds=time.perf_counter() - start)
