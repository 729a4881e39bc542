"""Every axis's collectives, counted both ways (issue 45): the calls a step runs on each rank, by kind,
mesh axis and bytes per call, are the plan's list for that rank's stage (what `partita show` prints
and the step time prices), for data, tensor, sequence and pipeline parallelism, ZeRO 1-3, selective
and full recomputation, offload and experts, in fp32 and bf16-mixed (ZeRO-1: the gradients' wire
carries fp32, the parameters' gather bf16)."""

from __future__ import annotations

from collections import Counter

from tests.harness import launch
from tests.workers import counts_worker as worker

CASES = [("gpt", dict(dp=2)), ("gpt", dict(dp=2, zero=2, grad_accum_steps=2)),
         ("gpt", dict(dp=2, zero=3)), ("gpt", dict(tp=2)), ("gpt", dict(tp=2, sequence_parallel=True)),
         ("gpt", dict(pp=2, grad_accum_steps=2)), ("gpt", dict(tp=2, recompute="full")),
         ("gpt", dict(dp=2, recompute="selective")), ("gpt", dict(dp=2, offload="optimizer")),
         ("gpt", dict(dp=2, zero=1, precision="bf16-mixed")), ("mixtral", dict(dp=2, ep=2)),
         ("mixtral", dict(dp=2, zero=3))]


def _by_kind(calls: dict[str, int], *, sizes: bool) -> Counter:
    out: Counter = Counter()
    for key, n in calls.items():
        kind, axis, nbytes = key.split("/")
        # an expert layer's rows come back by the routing (data-dependent): its all-to-alls are counted
        # here, their sizes in tests/integration/test_expert_parallel.py
        out[f"{kind}/{axis}" + (f"/{nbytes}" if sizes and (kind, axis) != ("all_to_all", "ep") else "")] += n
    return out


def test_the_collectives_a_step_runs_are_the_plans_list_for_every_axis():
    results = launch(2, worker.run, CASES)
    for rank, per_rank in enumerate(results):
        for r in per_rank:
            what = f"rank {rank} {r['case']}"
            assert r["ran"], what
            assert _by_kind(r["ran"], sizes=True) == _by_kind(r["planned"], sizes=True), (what, r["ran"], r["planned"])
