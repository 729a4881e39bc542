"""Partita's cost model against published large-model training runs.

Run: ``.venv/bin/python benchmarks/published_runs.py`` (add ``--quick`` for the
ZeRO table and the smallest runs only). Every published configuration is
pinned (dp, tp, pp, micro-batch, ZeRO stage) and priced by ``plan_search``, the
planner's own path, on DGX A100 nodes (``dgx-a100``: 312 TFLOP/s bf16 at 0.7
efficiency, NVLink 300 GB/s, 25 GB/s per GPU between nodes). Then the same
cluster and batch are planned unpinned, and partita's own choice is shown.

Sources (numbers as recalled from the papers; a "?" marks what I am not sure
of, and no figure here was re-derived to look better):

- Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM", SC'21 (arXiv 2104.04473), Table 2 "ZeRO-3 vs
  PTD-P" (also its Figure 10): 174.6B (96 layers, h 12288, 96 heads) and
  529.6B (105 layers, h 20480, 128 heads) GPT, sequence 2048, vocabulary
  51200, A100 80GB on DGX SuperPOD nodes, full activation recomputation.
  Achieved TFLOP/s per GPU count the recomputation (their 96 B s l h^2 (...)
  FLOPs formula). PTD-P: model-parallel size 96 (t = 8, p = 12) for 175B, 280
  (t = 8, p = 35) for 530B, micro-batch 1; ZeRO-3 without model parallelism at
  micro-batch 4/2/1 as the GPU count doubles.
- Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
  Models", MLSys'23 (arXiv 2205.05198), Tables 3 and 5: 22B (t=8, p=1, 8 GPUs,
  batch 4), 175B (t=8, p=8, 64 GPUs, batch 64), 530B (t=8, p=35, 280 GPUs,
  batch 280), 1T (t=8, p=64, 512 GPUs, batch 512), micro-batch 1, with
  sequence parallelism and selective recomputation: iteration times 1.10,
  13.75, 37.83, 71.49 s ("present work" column; 1.42, 18.13, 49.05, 94.42 s
  with full recomputation).
- Rajbhandari et al., "ZeRO", SC'20, Table 1: model-state GB per device for
  7.5B/128B/1T at Nd = 1..1024 under Pos, Pos+g, Pos+g+p (K = 12).

Results (2-core CPU dev machine, one run, 262 s in all; "plan s" is capture + both plans;
ZeRO 0-3 weighed at every mesh):

| source | model | GPUs | B | t x p x d, mb, ZeRO | published | published iter | partita iter | partita TFLOP/s/GPU | ratio | partita memory | partita's own choice | own iter | plan s |
|---|---|---|---|---|---|---|---|---|---|---|---|---|---|
| Korthikanti'23 T5 | GPT 22B | 8 | 4 | 8x1x1, 1, 0 | 1.10 s | 1.10 s | 0.98 s | 145 | 0.89 | 54 GB | t=4 p=1 d=2 mb=2 ZeRO-2 | 0.83 s | 10 |
| Korthikanti'23 T5 | GPT 175B | 64 | 64 | 8x8x1, 1, 0 | 13.75 s | 13.75 s | 14.62 s | 151 | 1.06 | 71 GB | t=8 p=8 d=1 mb=1 ZeRO-0 | 14.62 s | 17 |
| Korthikanti'23 T5 | GPT 530B | 280 | 280 | 8x35x1, 1, 0 | 37.83 s | 37.83 s | 51.86 s | 128 | 1.37 | 70 GB, recompute 13/35 stages | t=8 p=7 d=5 mb=1 ZeRO-1, recompute 6/7 stages | 50.76 s | 18 |
| Korthikanti'23 T5 | GPT 1T | 512 | 512 | 8x64x1, 1, 0 | 71.49 s (?) | 71.49 s | 97.47 s | 129 | 1.36 | 71 GB, recompute 38/64 stages | t=8 p=16 d=4 mb=1 ZeRO-1, recompute 14/16 stages | 94.32 s | 23 |
| Narayanan'21 T2 | GPT 175B | 384 | 1536 | 8x12x4, 1, 0 | 153 TFLOP/s/GPU | 76.78 s (derived) | 68.27 s | 172 | 0.89 | 36 GB, recompute 12/12 stages | t=4 p=8 d=12 mb=1 ZeRO-1 | 47.83 s | 22 |
| Narayanan'21 T2 | GPT 175B | 768 | 1536 | 8x12x8, 1, 0 | 149 TFLOP/s/GPU | 39.42 s (derived) | 35.25 s | 167 | 0.89 | 36 GB, recompute 12/12 stages | t=4 p=8 d=24 mb=1 ZeRO-1 | 25.60 s | 21 |
| Narayanan'21 T2 | GPT 175B | 1536 | 1536 | 8x12x16, 1, 0 | 141 TFLOP/s/GPU | 20.83 s (derived) | 18.75 s | 157 | 0.90 | 36 GB, recompute 12/12 stages | t=8 p=6 d=32 mb=1 ZeRO-1 | 14.14 s | 21 |
| Narayanan'21 T2 | GPT 175B | 384 | 1536 | 1x1x384, 4, 3 | 144 TFLOP/s/GPU | 81.58 s (derived) | 89.17 s | 132 | 1.09 | 318 GB (does not fit 72 GB) | t=4 p=8 d=12 mb=1 ZeRO-1 | 47.83 s | 21 |
| Narayanan'21 T2 | GPT 175B | 768 | 1536 | 1x1x768, 2, 3 | 88 TFLOP/s/GPU | 66.75 s (derived) | 75.61 s | 78 | 1.13 | 159 GB (does not fit 72 GB) | t=4 p=8 d=24 mb=1 ZeRO-1 | 25.60 s | 24 |
| Narayanan'21 T2 | GPT 175B | 1536 | 1536 | 1x1x1536, 1, 3 | 44 TFLOP/s/GPU | 66.75 s (derived) | 78.84 s | 37 | 1.18 | 79 GB (does not fit 72 GB) | t=8 p=6 d=32 mb=1 ZeRO-1 | 14.14 s | 18 |
| Narayanan'21 T2 | GPT 530B | 560 | 2240 | 8x35x2, 1, 0 | 171 TFLOP/s/GPU | 206.22 s (derived) | 196.17 s | 180 | 0.95 | 42 GB, recompute 35/35 stages | t=8 p=14 d=5 mb=1 ZeRO-1, recompute 1/14 stages | 168.09 s | 17 |
| Narayanan'21 T2 | GPT 530B | 2240 | 2240 | 8x35x8, 1, 0 | 159 TFLOP/s/GPU | 55.45 s (derived) | 53.64 s | 164 | 0.97 | 42 GB, recompute 35/35 stages | t=8 p=14 d=20 mb=1 ZeRO-1 | 41.21 s | 22 |
| Narayanan'21 T2 | GPT 530B | 2240 | 2240 | 1x1x2240, 1, 3 | 48 TFLOP/s/GPU | 183.66 s (derived) | 200.19 s | 44 | 1.09 | 145 GB (does not fit 72 GB) | t=8 p=14 d=20 mb=1 ZeRO-1 | 41.21 s | 24 |

Reading it. "ratio" is partita / published iteration time. The SC'21 PTD-P
runs ran full recomputation and are priced with it on every stage: 175B
0.89-0.90 (0.68 before recomputation was modelled; what is left is one
efficiency of 0.7 x 312 TFLOP/s for every matmul and every collective
exposed), 530B 0.95-0.97. ZeRO-3 without model parallelism: 1.09-1.18, and
the trend is right: partita reproduces the collapse from 144 to 44 TFLOP/s
as the GPUs double at a fixed batch (its 132, 78, 37), because the 3 m Psi
of traffic per step does not shrink with the GPUs while the compute does;
partita does not recompute under ZeRO-3, so those runs do not fit 80 GB in
its model (79-318 GB) and are priced with the memory check relaxed.
Korthikanti (in this older run, selective recomputation and sequence parallelism not yet
modelled; see below for today's): 0.89, 1.06, then 1.37 and 1.36 for 530B and 1T, which fit only
by recomputing whole layers on 13 of 35 and 38 of 64 stages (a third more
compute each) where the paper recomputed a few percent. Partita's own
choice is at least as fast as the published configuration wherever that
configuration fits partita's memory model (22B: t=4 d=2 ZeRO-2, 0.83 s vs
0.98 s; PTD-P 175B: t=4 p=8 with ZeRO-1, 1-8% faster; 530B: t=8 p=14 with
ZeRO-1; Korthikanti 530B and 1T: fewer stages with ZeRO-1, recomputing on
most, 2-3% faster). Partita's preference for t=4 over Megatron's t=8 at
384-768 GPUs is its cost model's: exposed TP all-reduces cost more than the
deeper pipeline's bubble at m = 32-64.

What partita does not model, and which way each pushes its predictions:
- recomputation (passes/pipeline/costs.py recompute_costs): whole repeated
  layers or (Korthikanti's selective) each layer's attention core, pinned as
  the runs did. The profile's GPT uses fused attention (scaled_dot_product_
  attention), which saves no (s, s) scores, so Korthikanti's 5 a s / h term is
  absent with or without selective recomputation.
- sequence parallelism: pinned on the Korthikanti runs (docs/cost-model.md,
  "Sequence parallelism"); their rows, re-priced on 2026-12-06 with it and
  selective recomputation: 22B 1.33 s (1.21), 175B 14.37 s (1.04), 530B
  42.01 s (1.11), 1T 78.36 s (1.10), each fitting 80 GB. The table above
  is older for those four rows.
- interleaved schedules (v chunks per device), overlap of communication with
  compute, the fused kernels' efficiency: partita uses one efficiency (0.7)
  and exposes every collective.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.models import GPT, GPTConfig
from partita.core.cluster import PRESETS, ClusterSpec
from partita.core.errors import InfeasibleError
from partita.core.model.capture import capture
from partita.core.model.inputs import parse_input_spec
from partita.core.model.losses import default_loss
from partita.core.pins import Pins, TrainingRequest
from partita.passes.cost_model import model_state_memory, state_bytes_per_param
from partita.passes.profile import ModelProfile, profile_model
from partita.passes.search import Decision, plan_search

SEQ, VOCAB = 2048, 51200

# -- ZeRO Table 1 (GB per device; paper's rounding) -----------------------------------------

ZERO_TABLE_1 = {  # params -> {Nd: (Pos, Pos+g, Pos+g+p)}
    7.5e9: {1: (120, 120, 120), 4: (52.5, 41.3, 30), 16: (35.6, 21.6, 7.5), 64: (31.4, 16.6, 1.88),
            256: (30.4, 15.4, 0.47), 1024: (30.1, 15.1, 0.12)},
    128e9: {1: (2048, 2048, 2048), 4: (896, 704, 512), 16: (608, 368, 128), 64: (536, 284, 32),
            256: (518, 263, 8), 1024: (513, 257, 2)},
    1e12: {1: (16000, 16000, 16000), 4: (7000, 5500, 4000), 16: (4750, 2875, 1000), 64: (4187, 2218, 250),
           256: (4046, 2054, 62.5), 1024: (4011, 2013, 15.6)},
}


def zero_table_1() -> list[tuple[float, int, tuple[float, float, float], tuple[float, float, float]]]:
    """(params, Nd, published GB, partita's GB) for every cell of ZeRO's Table 1."""
    state = state_bytes_per_param("bf16-mixed", "adamw")  # 2 + 2 + K=12
    rows = []
    for psi, by_nd in ZERO_TABLE_1.items():
        for nd, paper in by_nd.items():
            ours = tuple(model_state_memory(int(psi), state, zero_stage=z, dp=nd).total / 1e9 for z in (1, 2, 3))
            rows.append((psi, nd, paper, ours))
    return rows


# -- published runs ------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    source: str  # paper, table
    model: str
    layers: int
    hidden: int
    heads: int
    gpus: int
    batch: int
    tp: int
    pp: int
    micro_batch: int
    zero_stage: int
    published: str  # what the paper reports, as it reports it
    iteration_s: float  # published, or derived from TFLOP/s per GPU (then ``derived``)
    derived: bool = False
    recompute: str = "full"  # "full" | "selective"
    schedule: str | None = None  # a pinned pipeline schedule (None: the planner's)
    sequence_parallel: bool = False  # Korthikanti's sequence parallelism (pinned where the run used it)

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)


def megatron_flops(r: Run, factor: int = 96) -> float:
    """Narayanan et al. eq. (3): FLOPs per iteration; factor 96 with full recomputation, 72 without."""
    B, s, layers, h, V = r.batch, SEQ, r.layers, r.hidden, VOCAB
    return factor * B * s * layers * h * h * (1 + s / (6 * h) + V / (16 * layers * h))


def _from_tflops(tflops: float, **kw) -> Run:
    r = Run(**kw, published=f"{tflops:g} TFLOP/s/GPU", iteration_s=0.0, derived=True)
    return dataclasses.replace(r, iteration_s=megatron_flops(r) / (tflops * 1e12 * r.gpus))


M175 = dict(model="GPT 175B", layers=96, hidden=12288, heads=96)
M530 = dict(model="GPT 530B", layers=105, hidden=20480, heads=128)
SC21 = "Narayanan'21 T2"
RUNS = [
    _from_tflops(153, source=SC21, **M175, gpus=384, batch=1536, tp=8, pp=12, micro_batch=1, zero_stage=0),
    _from_tflops(149, source=SC21, **M175, gpus=768, batch=1536, tp=8, pp=12, micro_batch=1, zero_stage=0),
    _from_tflops(141, source=SC21, **M175, gpus=1536, batch=1536, tp=8, pp=12, micro_batch=1, zero_stage=0),
    _from_tflops(144, source=SC21, **M175, gpus=384, batch=1536, tp=1, pp=1, micro_batch=4, zero_stage=3),
    _from_tflops(88, source=SC21, **M175, gpus=768, batch=1536, tp=1, pp=1, micro_batch=2, zero_stage=3),
    _from_tflops(44, source=SC21, **M175, gpus=1536, batch=1536, tp=1, pp=1, micro_batch=1, zero_stage=3),
    _from_tflops(171, source=SC21, **M530, gpus=560, batch=2240, tp=8, pp=35, micro_batch=1, zero_stage=0),
    _from_tflops(159, source=SC21, **M530, gpus=2240, batch=2240, tp=8, pp=35, micro_batch=1, zero_stage=0),
    _from_tflops(48, source=SC21, **M530, gpus=2240, batch=2240, tp=1, pp=1, micro_batch=1, zero_stage=3),
]
# Narayanan et al., SC'21, Table 1 ("weak-scaling throughput"): GPT, sequence 2048, vocabulary 51200,
# A100 80GB, full recomputation; (params B, heads, hidden, layers, t, p, GPUs, batch, TFLOP/s per GPU).
# The micro-batch size is not given: partita chooses it (micro_batch 0). Their schedule, 1F1B
# (PipeDream-Flush), is pinned where there is a pipeline; the interleaved one is not modelled.
SC21_T1 = "Narayanan'21 T1"
TABLE_1_ROWS = [(1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
                (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
                (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
                (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
                (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163)]
TABLE_1 = [_from_tflops(tflops, source=SC21_T1, model=f"GPT {b:g}B", layers=depth, hidden=h, heads=a, gpus=n, batch=B,
                        tp=t, pp=p, micro_batch=0, zero_stage=0, schedule="1f1b")
           for b, a, h, depth, t, p, n, B, tflops in TABLE_1_ROWS]
MLSYS23 = "Korthikanti'23 T5"
KORTHIKANTI = [
    Run(MLSYS23, "GPT 22B", 48, 6144, 64, 8, 4, 8, 1, 1, 0, "1.10 s", 1.10, recompute="selective",
        sequence_parallel=True),
    Run(MLSYS23, "GPT 175B", 96, 12288, 96, 64, 64, 8, 8, 1, 0, "13.75 s", 13.75, recompute="selective",
        sequence_parallel=True),
    Run(MLSYS23, "GPT 530B", 105, 20480, 128, 280, 280, 8, 35, 1, 0, "37.83 s", 37.83, recompute="selective",
        sequence_parallel=True),
    Run(MLSYS23, "GPT 1T", 128, 25600, 160, 512, 512, 8, 64, 1, 0, "71.49 s (?)", 71.49, recompute="selective",
        sequence_parallel=True),
]


def gpt_factory(layers: int, hidden: int, heads: int):
    cfg = GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=layers, n_head=heads, n_embd=hidden)
    return lambda: GPT(cfg)


_PROFILES: dict[tuple[int, int, int], tuple[ModelProfile, list[int]]] = {}


def profile_of(r: Run) -> tuple[ModelProfile, list[int]]:
    key = (r.layers, r.hidden, r.heads)
    if key not in _PROFILES:
        captured = capture(gpt_factory(*key), [parse_input_spec(f"idx=int64[1,{SEQ}]")], loss=default_loss)
        _PROFILES[key] = profile_model(captured), [math.prod(s) for s, _ in captured.params.values()]
    return _PROFILES[key]


def cluster_for(r: Run) -> ClusterSpec:
    a100 = PRESETS["dgx-a100"]
    return a100.with_nodes(r.gpus // a100.gpus_per_node) if r.gpus >= 8 else a100.with_devices(r.gpus)


@dataclass(frozen=True)
class Priced:
    run: Run
    decision: Decision
    fits: bool  # under the real 80 GB (False: priced with the memory check relaxed)
    memory_gb: float


def price(r: Run, pins: Pins | None = None) -> Priced:
    """The published configuration (or ``pins``) through ``plan_search``; relax memory if it does not fit."""
    prof, numels = profile_of(r)
    # DeepSpeed's ZeRO (the ZeRO-3 rows) reduced gradients in the training dtype (fp16 in 2021); Megatron-LM
    # in fp32 (its main gradients), partita's default
    request = TrainingRequest(global_batch=r.batch, precision="bf16-mixed",
                              reduce_dtype="bf16" if r.zero_stage == 3 else "fp32")
    # The runs' recomputation (full, or Korthikanti's selective), pinned on every stage; partita does
    # not recompute under ZeRO-3, so those rows are priced without it.
    pinned = r.recompute if r.recompute in ("full", "selective") and r.zero_stage < 3 else None
    pins = pins or Pins(dp=r.dp if r.pp == 1 else None, tp=r.tp, pp=r.pp, micro_batch_size=r.micro_batch or None,
                        zero_stage=r.zero_stage, recompute=pinned, offload="none",  # none of the runs offloaded
                        cp=1,  # nor split sequences (unpinned, a run that does not fit would be priced with cp)
                        schedule=r.schedule if r.pp > 1 else None, sequence_parallel=r.sequence_parallel or None)
    cluster = cluster_for(r)
    try:
        d = plan_search(prof, numels, cluster, request, pins)
        return Priced(r, d, True, d.memory.total / 1e9)
    except InfeasibleError:
        roomy = dataclasses.replace(cluster, memory_bytes=10**14)
        d = plan_search(prof, numels, roomy, request, pins)
        return Priced(r, d, False, d.memory.total / 1e9)


def own_choice(r: Run) -> Decision:
    prof, numels = profile_of(r)
    return plan_search(prof, numels, cluster_for(r), TrainingRequest(global_batch=r.batch, precision="bf16-mixed"))


def tflops_per_gpu(r: Run, step_s: float) -> float:
    """TFLOP/s per GPU as the papers count them (recomputation FLOPs included when they ran it)."""
    factor = 96 if r.recompute == "full" else 72
    return megatron_flops(r, factor) / step_s / r.gpus / 1e12


def _recomputed(d: Decision) -> str:
    modes = [s.recompute for s in d.stages if s.recompute != "none"]
    return "".join(f", recompute {m} {modes.count(m)}/{len(d.stages)} stages" for m in sorted(set(modes)))


def print_table_1(runs: list[Run]) -> None:
    """Megatron-LM's Table 1 rows priced as published (t and p pinned, full recomputation, 1F1B)."""
    print("Narayanan et al. SC'21 Table 1 (weak scaling), partita's prediction at the published configuration "
          "(dgx-a100 preset)")
    print("| model | t x p x d | GPUs | B | published TFLOP/s/GPU | published iter (derived) | partita iter | "
          "partita TFLOP/s/GPU | partita / published time | partita's micro-batch | memory |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        p = price(r)
        step = p.decision.step_s
        mem = f"{p.memory_gb:.0f} GB" + ("" if p.fits else " (does not fit)")
        print(f"| {r.model} | {r.tp}x{r.pp}x{r.dp} | {r.gpus} | {r.batch} | {r.published.split()[0]} | "
              f"{r.iteration_s:.2f} s | {step:.2f} s | {tflops_per_gpu(r, step):.0f} | {step / r.iteration_s:.2f} | "
              f"{p.decision.micro_batch_size} | {mem} |", flush=True)
    print()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the ZeRO table and the 22B run only")
    ap.add_argument("--no-own", action="store_true", help="skip partita's own unpinned choice (slow at 1,000+ GPUs)")
    ap.add_argument("--table-1", action="store_true", help="Megatron-LM's Table 1 only")
    args = ap.parse_args()
    print_table_1(TABLE_1[:4] if args.quick else TABLE_1)
    if args.table_1:
        return
    print("ZeRO (Rajbhandari et al. 2020) Table 1: model-state GB per device, paper / partita")
    print("| params | Nd | Pos | Pos+g | Pos+g+p |")
    print("|---|---|---|---|---|")
    for psi, nd, paper, ours in zero_table_1():
        cells = " | ".join(f"{p:g} / {o:.5g}" for p, o in zip(paper, ours))
        print(f"| {psi / 1e9:g}B | {nd} | {cells} |")
    runs = KORTHIKANTI[:1] if args.quick else KORTHIKANTI + RUNS
    print("\nPublished runs, partita's prediction at the published configuration (dgx-a100 preset)")
    print("| source | model | GPUs | B | t x p x d, mb, ZeRO | published | published iter | partita iter | "
          "partita TFLOP/s/GPU | ratio | partita memory | partita's own choice | own iter | plan s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        t0 = time.perf_counter()
        p = price(r)
        own = "-" if args.no_own else None
        own_s = "-"
        if own is None:
            try:
                d = own_choice(r)
            except InfeasibleError as e:  # the memory model finds no plan at this size: say so in the row
                own = f"none fits ({e.message.split(': ')[-1][:60]})"
            else:
                own = f"t={d.mesh.tp} p={d.mesh.pp} d={d.mesh.dp} mb={d.micro_batch_size} ZeRO-{d.zero_stage}"
                own += _recomputed(d)
                own_s = f"{d.step_s:.2f} s"
        step = p.decision.step_s
        mem = f"{p.memory_gb:.0f} GB" + ("" if p.fits else " (does not fit 72 GB)") + _recomputed(p.decision)
        print(f"| {r.source} | {r.model} | {r.gpus} | {r.batch} | {r.tp}x{r.pp}x{r.dp}, {r.micro_batch}, "
              f"{r.zero_stage} | {r.published} | {r.iteration_s:.2f} s{' (derived)' if r.derived else ''} | "
              f"{step:.2f} s | {tflops_per_gpu(r, step):.0f} | {step / r.iteration_s:.2f} | {mem} | {own} | "
              f"{own_s} | {time.perf_counter() - t0:.0f} |", flush=True)


if __name__ == "__main__":
    main()
