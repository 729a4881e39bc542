"""Context parallelism priced on the long-context runs of issue 42.

Run: ``.venv/bin/python benchmarks/context_parallel.py`` (``--quick``: the 8B choice only).

- Llama-3-8B's shape at 131,072 tokens on 8 DGX-H100 nodes, unpinned: the planner's own choice
  (tests/unit/test_context_planning.py asserts cp > 1 and the reason in the plan's notes).
- Llama 3 405B's long-context stage as published (Dubey et al., "The Llama 3 Herd of Models",
  2024, section 3.3 and Table 4): TP 8, CP 16, PP 16, DP 8 at 131,072 tokens on 16,384 H100s, 380
  TFLOP/s per GPU (38% MFU), priced pinned (mesh dp = 8 x 16 = 128 with cp = 16 here: dp counts
  every rank holding the same parameters). The global batch is 16M tokens (128 sequences).

The models are Llama 3's shape written out (``Llama3Like``: grouped-query attention through one
fused causal ``scaled_dot_product_attention``, RMSNorm, SwiGLU; rotary embeddings left out, a few
elementwise ops a layer). transformers' LlamaForCausalLM is not used: captured under fake tensors it
builds the S x S causal mask (``is_causal`` is not taken while tracing), which at 131,072 tokens is
17 GB a layer that a flash-attention run never holds.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from partita.core.cluster import PRESETS
from partita.core.model.capture import capture
from partita.core.model.inputs import parse_input_spec
from partita.core.model.losses import default_loss
from partita.core.pins import Pins, TrainingRequest
from partita.passes.profile import ModelProfile, profile_model
from partita.passes.search import Decision, plan_search

SEQ = 131_072
LLAMA3_8B = dict(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256)
LLAMA3_405B = dict(layers=126, hidden=16384, heads=128, kv_heads=8, ffn=53248, vocab=128256)
PUBLISHED_405B_TFLOPS = 380.0  # per GPU, Llama 3 paper, Table 4 (the 131,072-token row: 38% MFU)


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.dim = heads, kv_heads, hidden // heads
        self.attn_norm = nn.RMSNorm(hidden)
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.dim, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.mlp_norm = nn.RMSNorm(hidden)
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        h = self.attn_norm(x)
        q = self.q_proj(h).view(B, T, self.heads, self.dim).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(h).view(B, T, self.kv_heads, self.dim).transpose(1, 2)  # (B, KV, T, D)
        v = self.v_proj(h).view(B, T, self.kv_heads, self.dim).transpose(1, 2)
        rep = self.heads // self.kv_heads  # grouped-query attention: each KV head serves rep query heads
        k = k[:, :, None].expand(B, self.kv_heads, rep, T, self.dim).reshape(B, self.heads, T, self.dim)
        v = v[:, :, None].expand(B, self.kv_heads, rep, T, self.dim).reshape(B, self.heads, T, self.dim)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.o_proj(y)
        h = self.mlp_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Llama3Like(nn.Module):
    """Llama 3's shape (module docstring); build it only under fake tensors at these sizes."""

    def __init__(self, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Block(hidden, heads, kv_heads, ffn) for _ in range(layers))
        self.norm = nn.RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


@cache
def llama3_profile(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int,
                   seq: int = SEQ) -> tuple[ModelProfile, tuple[int, ...]]:
    """The profile of ``Llama3Like`` at one sample of ``seq`` tokens, and its parameter sizes."""
    captured = capture(lambda: Llama3Like(layers, hidden, heads, kv_heads, ffn, vocab),
                       [parse_input_spec(f"input_ids=int64[1,{seq}]")], loss=default_loss)
    return profile_model(captured), tuple(math.prod(s) for s, _ in captured.params.values())


def plan_8b(global_batch: int = 16, nodes: int = 8, pins: Pins = Pins()) -> Decision:
    """Llama-3-8B's shape at 131,072 tokens on ``nodes`` DGX-H100 nodes, bf16-mixed."""
    profile, numels = llama3_profile(**LLAMA3_8B)
    return plan_search(profile, list(numels), PRESETS["dgx-h100"].with_nodes(nodes),
                       TrainingRequest(global_batch=global_batch, precision="bf16-mixed"), pins)


def price_405b(layers: int = LLAMA3_405B["layers"], pp: int = 16, global_batch: int = 128) -> tuple[Decision, float]:
    """Llama 3 405B's long-context configuration pinned (TP 8, CP 16, PP ``pp``, DP 8 in Megatron's words;
    mesh dp = 8 x 16), bf16-mixed, at ``global_batch`` sequences of 131,072 tokens: the decision and its
    model TFLOP/s per GPU (the profile's FLOPs, attention counted without the causal saving, as
    Megatron-LM counts them; no recomputation FLOPs)."""
    shape = {**LLAMA3_405B, "layers": layers}
    profile, numels = llama3_profile(**shape)
    gpus = 8 * 16 * pp * 8
    cluster = PRESETS["dgx-h100"].with_nodes(gpus // 8)
    d = plan_search(profile, list(numels), cluster, TrainingRequest(global_batch=global_batch, precision="bf16-mixed"),
                    Pins(tp=8, pp=pp, dp=128, cp=16, micro_batch_size=1))
    flops = (profile.flops_fwd + profile.flops_bwd) / profile.batch_size * global_batch
    return d, flops / d.step_s / gpus / 1e12


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the 8B choice only")
    args = ap.parse_args()
    t = time.perf_counter()
    d = plan_8b()
    print(f"Llama-3-8B shape, 131,072 tokens, 16 sequences a step, 8 x DGX-H100: {d.mesh}, micro-batch "
          f"{d.micro_batch_size} x {d.grad_accum_steps}, ZeRO-{d.zero_stage}, attention {d.cp_attention}, step "
          f"{d.step_s:.2f} s (planned in {time.perf_counter() - t:.1f} s)")
    print("  " + next(n for n in d.notes if "context parallelism" in n))
    if args.quick:
        return
    t = time.perf_counter()
    d, tflops = price_405b()
    print(f"Llama 3 405B, TP 8 CP 16 PP 16 DP 8, 131,072 tokens, 128 sequences a step, 16,384 H100s: {d.mesh}, "
          f"{d.schedule}, ZeRO-{d.zero_stage}, attention {d.cp_attention}, recompute "
          f"{sorted({s.recompute for s in d.stages})}, step {d.step_s:.2f} s, {tflops:.0f} TFLOP/s per GPU "
          f"(published {PUBLISHED_405B_TFLOPS:.0f}: {tflops / PUBLISHED_405B_TFLOPS:.2f}x), memory "
          f"{d.memory.total / 1e9:.1f} GB (planned in {time.perf_counter() - t:.1f} s)")
    print(f"  comm {d.comm_s}, compute {d.compute_s:.2f} s")


if __name__ == "__main__":
    main()
