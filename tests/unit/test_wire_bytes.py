"""Wire bytes as they go (issue 45): every gradient collective is priced at the dtype it carries,
the plan's ``training.reduce_dtype`` (the runtime casts each bucket to it: runtime/dp/buckets.py),
not at the dtype the gradients are held in; parameters travel as held. The rule is
core/precision.py ``wire_bytes``; the times below are worked by hand from the cluster's link (the
ring all-reduce: a call's fixed cost, 2 (n - 1) latencies and 2 S (n - 1) / n over the bandwidth).
"""

from __future__ import annotations

import functools
import math

import pytest

from examples.models import gpt_tiny
from partita.compiler.compile import compile_model
from partita.core.cluster import PRESETS
from partita.core.options import Options
from partita.passes.cost_model import param_step_time, state_bytes_per_param, zero_optimizer_time
from partita.passes.experts import EDP_ALL_REDUCE, expert_links, expert_step

DP = 8
A100 = PRESETS["dgx-a100"].with_devices(DP)


@functools.cache
def _plan(**options):
    """gpt-tiny in bf16-mixed, data parallel over one DGX A100's 8 GPUs."""
    return compile_model(gpt_tiny, Options(inputs=["idx=int64[8,64]"], cluster="dgx-a100", devices=DP, dp=DP, tp=1,
                                           pp=1, batch=8, precision="bf16-mixed", **options)).plan


def _all_reduce_by_hand(nbytes: float, n: int, link) -> float:
    return link.call_s("all_reduce") + 2 * (n - 1) * link.latency + 2 * nbytes * (n - 1) / n / link.bandwidth


@pytest.mark.parametrize("reduce_dtype, wire", [("fp32", 4), ("bf16", 2)])
def test_the_gradient_all_reduce_is_priced_at_the_reduce_dtype(reduce_dtype, wire):
    """bf16 gradients (2 bytes held) all-reduced in fp32 by default: numel x 4 bytes on the wire, one
    bucket (274 kB held, under the 25 MB cap); with reduce_dtype bf16, numel x 2."""
    plan = _plan(zero=0, reduce_dtype=reduce_dtype)
    assert plan.training.reduce_dtype == reduce_dtype and plan.mesh.dp == DP
    numel = sum(math.prod(p.shape) for p in plan.params)
    link = A100.link_for_group(DP)
    assert plan.predicted.traffic_bytes["dp_all_reduce"] == pytest.approx(2 * numel * wire * (DP - 1) / DP, abs=1)
    assert plan.predicted.comm_s["dp_all_reduce"] == pytest.approx(_all_reduce_by_hand(numel * wire, DP, link))
    # the plan's list of collectives (what the runtime runs) says the same bytes
    listed = [c for c in plan.collectives if c.axis == "dp" and c.purpose.startswith("gradient averaging")]
    assert [(c.kind, c.bytes, c.count) for c in listed] == [("all_reduce", numel * wire, 1)]


def test_zero_reduce_scatters_gradients_in_the_reduce_dtype_and_gathers_parameters_as_held():
    """ZeRO-1 over 8: the gradients' reduce-scatter at 4 bytes an element, the parameters'
    all-gather at their 2 (the bucket padded to a multiple of 8 elements)."""
    plan = _plan(zero=1)
    numel = sum(math.prod(p.shape) for p in plan.params)
    padded = -(-numel // DP) * DP
    assert plan.predicted.traffic_bytes["zero_reduce_scatter"] == pytest.approx(padded * 4 * (DP - 1) / DP, abs=1)
    assert plan.predicted.traffic_bytes["zero_all_gather"] == pytest.approx(padded * 2 * (DP - 1) / DP, abs=1)


def test_the_tp_solver_and_the_expert_all_reduce_price_gradients_at_the_reduce_dtype():
    """The TP ILP's per-parameter step term and the experts' edp all-reduce read the same rule."""
    state = state_bytes_per_param("bf16-mixed", "adamw")
    link = A100.link_for_group(DP)
    numel = 1_000_000
    for reduce_dtype, wire in (("fp32", 4), ("bf16", 2)):
        comm = param_step_time(numel, state, DP, link, A100, reduce_dtype=reduce_dtype) - zero_optimizer_time(
            numel, state, 0, DP, A100)
        assert comm == pytest.approx(2 * numel * wire * (DP - 1) / DP / link.bandwidth)
    # the experts' slices (ep = 2 of dp = 8): averaged over the 4 ranks holding the same experts
    step = expert_step([], [numel], ep=2, dp=DP, micro_batch=1, batch=1, grad_accum=1, precision="bf16-mixed",
                       reduce_dtype="fp32", captured_dtype="float32", cluster=A100)
    edp_link = expert_links(A100, dp=DP, tp=1, ep=2)[1]
    assert step.seconds[EDP_ALL_REDUCE] == pytest.approx(_all_reduce_by_hand(numel * 4, DP // 2, edp_link))
    assert step.traffic_bytes[EDP_ALL_REDUCE] == pytest.approx(2 * numel * 4 * 3 / 4, abs=1)
