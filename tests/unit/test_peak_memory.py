"""The memory model's terms at the step's peak, each against figures worked by hand (issue 26).

What the step allocates beyond the model state (docs/cost-model.md, "Memory at the step's peak"):
the loss's transients (its fp32 log-softmax gradient and input gradient, measured by replaying the
graph forward and backward under fake tensors), autocast's fp32 copies, the optimizer step's fp32
gradients, ZeRO's buffers, a pipeline's sends, a gradient added into the one held, gradients a
freeing step has not made yet, and a GPU allocator's rounding and fragmentation headroom.
tests/integration/test_runtime_memory.py checks the sum against the CPU allocator on five model shapes.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from partita.core.cluster import PRESETS
from partita.core.model.capture import capture
from partita.core.model.graph import to_networkx
from partita.core.model.inputs import parse_input_spec
from partita.core.model.losses import default_loss
from partita.core.plans.plan import MemoryBreakdown
from partita.passes.activations import annotate_saved_activations
from partita.passes.cost_model import ModelStateMemory, StateBytes
from partita.passes.peak_memory import (
    NO_BUFFERS,
    StepBuffers,
    graph_autocast,
    graph_transient,
    node_transient,
    peak_memory,
    step_buffers,
)
from partita.passes.pipeline.costs import NodeCosts
from partita.passes.pipeline.cuts import Partition, StageSetup

N, H, V = 32, 64, 1000  # tokens, width, classes


class Head(torch.nn.Module):
    """A layer norm, then a classifier: what a language model's loss sees."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(H)
        self.out = torch.nn.Linear(H, V, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


@functools.cache
def _head():
    cap = capture(Head, [parse_input_spec(f"x=float32[{N},{H}]")], loss=default_loss,
                  targets=parse_input_spec(f"y=int64[{N}]"))
    G = to_networkx(cap)
    annotate_saved_activations(G, cap)
    return G, {a["op"].split(".")[1]: a for _, a in G.nodes(data=True) if a["kind"] == "call"}


def test_the_loss_holds_its_fp32_gradients_beyond_what_it_saves():
    """Cross-entropy saves its fp32 log-softmax (N x V x 4) and the targets; while its backward
    runs it holds, beyond that, the log-softmax's gradient and the input's (2 x N x V x 4), and the
    scalars of the loss's own gradient (a few bytes)."""
    G, by_op = _head()
    ce = by_op["cross_entropy_loss"]
    assert ce["saved_bytes"] == N * V * 4 + N * 8 + 4  # log-softmax, int64 targets, the total weight
    assert 2 * N * V * 4 <= ce["transient_bytes"] <= 2 * N * V * 4 + 16
    assert G.graph["transient_node"].startswith("cross_entropy")
    # the step's whole peak is bounded by the saved activations and the largest transient (the model's sum)
    saved = sum(a["saved_bytes"] for a in by_op.values())
    assert ce["saved_bytes"] + ce["transient_bytes"] <= G.graph["step_peak_bytes"] <= saved + ce["transient_bytes"]
    # under a 16-bit policy autocast keeps the loss in fp32 (on CUDA and on CPU); a matmul's transient halves
    for device in ("cuda", "cpu"):
        assert node_transient(ce, beta=1.0, act_scale=0.5, precision="bf16-mixed", device=device) \
            == ce["transient_bytes"]
    lin = by_op["linear"]
    assert node_transient(lin, beta=0.5, act_scale=0.5, precision="bf16-mixed", device="cuda") \
        == lin["transient_bytes"] * 0.25
    t, node, grads = graph_transient(G, micro_batch=N // 2, batch=N, precision="fp32", device="cpu", captured="float32")
    assert (t, node, grads) == (ce["transient_bytes"] / 2, G.graph["transient_node"], 0.0)


def test_autocast_keeps_fp32_ops_saved_tensors_in_fp32():
    """A layer norm saves its input and its mean and rstd (4 N H + 2 x 4 N bytes captured in fp32);
    under bf16-mixed on CUDA autocast runs it in fp32, so it keeps them at 4 bytes where the policy's
    size is 2: half its saved bytes beyond the precision's; likewise the loss's log-softmax. On CPU
    autocast runs the layer norm in bf16: only the loss."""
    G, by_op = _head()
    assert by_op["layer_norm"]["saved_bytes"] == 4 * N * H + 2 * 4 * N
    args = dict(micro_batch=N, batch=N, precision="bf16-mixed", captured="float32")
    ln, ce = by_op["layer_norm"]["saved_bytes"], by_op["cross_entropy_loss"]["saved_bytes"]
    assert graph_autocast(G, device="cuda", **args) == (ln + ce) / 2
    assert graph_autocast(G, device="cpu", **args) == ce / 2
    assert graph_autocast(G, device="cuda", micro_batch=N, batch=N, precision="fp32", captured="float32") == 0


def test_the_optimizer_steps_and_zeros_buffers_worked_by_hand():
    """cost_model.step_buffers for 10M local parameters (the largest 1M) in 25 MiB buckets."""
    psi, big, cap = 10_000_000, 1_000_000, 25 * 2**20
    kw = dict(numel=psi, largest=big, bucket_bytes=cap)
    # one device, bf16-mixed: one chunk of fp32 master gradients, at most the cap and its last master
    b = step_buffers(precision="bf16-mixed", **kw)
    assert (b.collectives, b.step) == (0, cap + 4 * big)
    # data parallelism reducing bf16 in fp32: every bucket's fp32 mean kept to the step (the masters read it)
    b = step_buffers(precision="bf16-mixed", dp=2, **kw)
    assert b.terms == {"fp32 reduced gradients": 4 * psi} and b.step == 4 * psi
    # ZeRO-1: the fp32 wires until the end of backward, and a chunk of the shard's fp32 gradients
    b = step_buffers(precision="bf16-mixed", dp=2, zero_stage=1, **kw)
    assert b.step == 4 * psi + 4 * psi // 2
    # ZeRO-2, one bucket (10M elements under the cap's 13M): the bucket filling (2 bytes) and its fp32
    # wire made at its launch (4), and the one member's gradient being copied into it (the largest)
    b = step_buffers(precision="bf16-mixed", dp=2, zero_stage=2, **kw)
    assert (b.collectives, b.step) == (6 * psi + 2 * big, 4 * psi // 2)
    # in fp32 the one bucket is its own wire; several buckets: the previous one's wire still in flight
    one = step_buffers(precision="fp32", dp=2, zero_stage=2, **{**kw, "bucket_bytes": 2**26})
    assert one.collectives == 4 * psi + 4 * big
    b = step_buffers(precision="fp32", dp=2, zero_stage=2, **{**kw, "bucket_bytes": 2**22})
    assert b.collectives == 2 * 4 * (2**20 + big) + 4 * big
    # ZeRO-3 by units of 2M: two units gathered whole (2 x 2 bytes) beside a unit filling (2) and the
    # previous one's fp32 wire (4), and a member's gradient
    b = step_buffers(precision="bf16-mixed", dp=2, zero_stage=3, unit_numel=2_000_000, **kw)
    assert b.terms["ZeRO-3 units gathered whole, two"] == 2 * 2 * 2_000_000
    assert b.collectives == 10 * 2_000_000 + 2 * big and b.step == 4 * psi // 2  # a chunk: here the whole shard
    # fp32 (the fused optimizer holds nothing more), gradients held and added into: the largest one's
    assert step_buffers(precision="fp32", dp=2, **kw) == StepBuffers(0, 0, {})
    b = step_buffers(precision="fp32", dp=2, accumulates=True, **kw)
    assert b.terms == {"a gradient added into the one held": 4 * big} and b.collectives == 4 * big


def test_the_peak_is_the_state_and_the_larger_side_then_the_allocators_share():
    m = MemoryBreakdown(10, 20, 30, 40, 10**6, transient=5, step=100)
    assert (m.total, m.at_step, m.grads_at_peak) == (10 + 30 + max(20 + 40 + 5, 20 + 100), True, 20)
    # a step that frees its gradients holds only those backward has made at its peak
    m = MemoryBreakdown(10, 20, 30, 40, 10**6, transient=5, step=10, backward_grads=3)
    assert (m.total, m.at_step, m.grads_at_peak) == (10 + 30 + max(3 + 40 + 5, 20 + 10), False, 3)
    # a GPU preset: every tensor alive at the peak rounded up to 512 bytes, then 5% kept free
    gpu = PRESETS["h200"]
    state = ModelStateMemory(100, 100, 100)
    m = peak_memory(state, activations=1000, capacity=10**6, cluster=gpu, transient=50,
                    buffers=StepBuffers(0, 0, {}, tensors=10))
    assert m.allocator == round((300 + 1050 + 10 * 512) * 1.05) - (300 + 1050)
    assert m.total == round((300 + 1050 + 10 * 512) * 1.05)
    assert peak_memory(state, activations=1000, capacity=10**6, cluster=PRESETS["local"]).allocator == 0


def test_a_pipeline_stage_holds_the_sends_its_peer_has_not_had():
    """runtime/pipeline/stage.py lets a micro-batch's activations sent forward go when its gradients
    come back, and the gradients it sent back when the previous stage's activations show that stage
    ran those backwards (core/schedule.py ``sends_held``): under 1F1B stage 0 of 2 holds its 2
    micro-batches in flight, stage 1 two gradients (stage 0 runs one forward ahead); GPipe all m."""
    n, m = 4, 4
    costs = NodeCosts(order=tuple("abcd"), forward_s=(1.0,) * n, backward_s=(1.0,) * n, saved_bytes=(100,) * n,
                      param_numel=(0,) * n, send_bytes=(0, 10, 20, 30, 0), grad_bytes=(0, 1, 2, 3, 0),
                      boundaries=(1, 2, 3))
    setup = StageSetup(2, m, "1f1b", (PRESETS["local"].intra_link,), 10**9, StateBytes(4, 4, 8),
                       buffers=lambda numel: NO_BUFFERS)
    part = Partition(costs, setup, PRESETS["local"])
    assert part.memory(0, 2, 0).collectives == 2 * 20
    assert part.memory(2, 4, 1).collectives == 2 * 2
    assert part.memory(0, 2, 0).activations == 2 * 200  # 1F1B: stage 0 of 2 holds 2 micro-batches
    gpipe = Partition(costs, dataclasses.replace(setup, schedule="gpipe"), PRESETS["local"])
    assert gpipe.memory(0, 2, 0).collectives == m * 20 and gpipe.memory(2, 4, 1).collectives == m * 2


@pytest.mark.parametrize("dp, frees", [(1, True), (2, False)])
def test_a_step_that_frees_its_gradients_holds_only_those_made_by_its_peak(dp, frees):
    """One fp32 device frees its gradients after the step (runtime/engine.py): at the loss's backward,
    the peak, none exist yet. Data parallelism keeps them in its buckets: every one is counted."""
    from examples.models import GPT, GPTConfig
    from partita.compiler.compile import compile_model
    from partita.core.options import Options

    factory = functools.partial(GPT, GPTConfig(vocab_size=4096, block_size=32, n_layer=1, n_head=2, n_embd=64))
    plan = compile_model(factory, Options(inputs=["idx=int64[8,32]"], cluster="local", devices=dp, world_size=dp,
                                          dp=dp)).plan
    m = plan.predicted.memory
    assert (m.backward_grads is not None) == frees
    if frees:
        assert m.backward_grads == 0 and m.grads_at_peak == 0 < m.grads
    assert m.transient >= 2 * 4 * (8 // dp) * 32 * 4096  # the loss's two fp32 gradients of the logits
