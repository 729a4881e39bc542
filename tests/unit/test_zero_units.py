"""ZeRO-3 by units: a repeated layer's parameters are one bucket (gathered, freed and reduce-scattered
together, as FSDP2 wraps a block), the plan records the units, the runtime gathers the next unit while
the current one computes; the cost model prices the calls exposed, an upper bound (hand-worked below)."""

from __future__ import annotations

import pytest

from examples.models import gpt_tiny
from partita.compiler.compile import compile_model
from partita.core.buckets import unit_of
from partita.core.cluster import Link
from partita.core.options import Options
from partita.passes.cost_model import zero_step_comm
from partita.passes.dp.buckets import gradient_buckets


def test_a_parameter_belongs_to_the_longest_unit_it_lies_in():
    units = ("h.1", "h.10", "h.1.mlp")
    assert unit_of("h.1.attn.weight", units) == "h.1"
    assert unit_of("h.10.attn.weight", units) == "h.10"  # not h.1: a path component, not a prefix
    assert unit_of("h.1.mlp.fc.weight", units) == "h.1.mlp"
    assert unit_of("wte.weight", units) == ""  # the root


def test_units_make_one_bucket_each_whatever_the_cap():
    # registration order: embedding, layer 0 (two params), layer 1 (two), head; buckets in reverse
    numels = [100, 10, 20, 30, 40, 50]
    units = ["", "h.0", "h.0", "h.1", "h.1", ""]
    assert gradient_buckets(numels, 2, cap_bytes=8, units=units) == [100, 140, 60, 200]
    assert gradient_buckets(numels, 2, cap_bytes=8) == [100, 80, 60, 40, 20, 200]  # the cap's buckets


def test_zero3_units_are_priced_exposed_by_hand():
    link = Link(bandwidth=1e9, latency=1e-5, name="test")
    dp, m = 2, 1
    buckets = [4000.0, 8000.0, 2000.0]  # backward order: the head's, a layer's, the embedding's

    def ag(b: float) -> float:  # one all-gather (or reduce-scatter) of a bucket over 2 ranks
        return (dp - 1) * 1e-5 + b * (dp - 1) / dp / 1e9

    exposed = zero_step_comm(3, buckets, dp, m, link, elem_bytes=2, reduce_dtype="bf16")  # bf16 held and sent
    total = sum(2 * ag(b) + ag(b) for b in buckets)  # 2 gathers (forward, backward) + 1 reduce-scatter each
    assert sum(exposed.seconds.values()) == pytest.approx(total)
    assert exposed.seconds["zero_all_gather"] == pytest.approx(2 * sum(ag(b) for b in buckets))
    # the bytes: (n - 1) / n of each bucket per call, 3 calls per unit
    assert sum(exposed.traffic_bytes.values()) == pytest.approx(3 * sum(buckets) / 2, abs=3)


def test_the_plan_records_the_units_and_lists_a_gather_per_unit():
    plan = compile_model(gpt_tiny, Options(inputs=["idx=int64[8,16]"], cluster="local", devices=2, world_size=2,
                                           dp=2, zero=3)).plan
    assert plan.training.zero_units == ("transformer.h.0", "transformer.h.1")
    gathers = [c for c in plan.collectives if c.kind == "all_gather"]
    reduces = [c for c in plan.collectives if c.kind == "reduce_scatter"]
    # the two layers share one bucket size (two calls each: forward and backward), and the root's
    # parameters form the runs before and after them (the embeddings, the final norm and head)
    assert sorted(c.count for c in gathers) == [2, 2, 4]
    assert sum(c.count for c in reduces) == 4
    zero1 = compile_model(gpt_tiny, Options(inputs=["idx=int64[8,16]"], cluster="local", devices=2, world_size=2,
                                            dp=2, zero=1)).plan
    assert zero1.training.zero_units == ()  # units are ZeRO-3's
