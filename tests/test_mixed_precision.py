"""Mixed precision as planned (issue 10): bf16-mixed and fp16-mixed plans run on every axis.

Plans the planner writes with ``precision=bf16-mixed`` (and fp16-mixed) under the CLI's pins (dp,
ZeRO-1/2/3, tp, tp with recomputation, pp with GPipe and 1F1B, and on 4 ranks dp x tp with ZeRO-2,
tp x pp, dp x pp with ZeRO-3) run 3 steps each against one process running the same recipe
(mp_worker.reference_mixed; mp_worker.py measures, the test asserts). Also: fp16
skips a step with an inf gradient on one rank on every rank and halves the scale; each rank holds
the plan's 2 + 2 + 12 bytes per parameter under ZeRO 0-3; the example GPT's bf16-mixed loss curve
stays within 1% of fp32's over 20 steps; gradient clipping by the global norm as one process clips;
one optimizer drives a tied parameter too.

Why the tolerance is what it is: bf16 keeps 8 significant bits, so one rounding moves a value
by up to 2^-9 (0.2%) of itself. A plan computes the same sums in other orders and other
roundings (TP's partial sums are rounded to bf16 before they are all-reduced, pipeline stages
send activations in bf16, the dp mean of bf16 gradients is summed in fp32 and rounded once), so
losses and parameters differ from the reference by a few roundings: LOSS_RTOL (0.5%, about two
bf16 roundings of the loss) on losses and 2^-6 relative plus PARAM_ATOL (1e-3) absolute on the
bf16 parameters, i.e. a couple of bf16 units in the last place; fp16 keeps 11 bits, so the same
bounds hold with room. Measured: DP, ZeRO-1/2/3 and PP equal the reference exactly (the fp32 sum of
two bf16 gradients rounds as the reference's fp32 gradient does); TP differs by 6e-5 in the loss
and 5e-4 in a parameter. A bug (a missing all-reduce, a dropped micro-batch, an unscaled
gradient) moves losses by far more than 0.5%.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import mp_worker
from tests.harness import beyond, launch, numbers_beyond

LOSS_RTOL = 5e-3
PARAM_RTOL, PARAM_ATOL = 2.0**-6, 1e-3
# Gradient clipping runs fp32 plans: only the order of the sums differs from one process's
CLIP_RTOL, CLIP_ATOL = 1e-4, 2e-5  # the parameters
NORM_RTOL, NORM_ATOL = 1e-4, 1e-6  # the norms and losses (pytest.approx's rel and abs)


def _assert_case(r: dict, rank: int) -> None:
    """A plan's run against one process running the same recipe."""
    what = f"rank {rank} {r['case']} ({r['mesh']})"
    assert r["param_dtypes"] == [r["param_dtype"]], (what, "the parameters as built", r["param_dtypes"])
    assert not numbers_beyond(r["losses"], r["ref_losses"], rtol=LOSS_RTOL, atol=0), (
        what, r["losses"], r["ref_losses"])
    assert not r["names_unlike_the_models"], (what, r["names_unlike_the_models"])
    assert r["final_dtypes"] == [r["param_dtype"]], (what, "the full state", r["final_dtypes"])
    assert not beyond(r["params"], rtol=PARAM_RTOL, atol=PARAM_ATOL), f"{what}: parameters after the steps"
    assert r["moved"] > 4 * PARAM_ATOL, (what, r["moved"])  # the steps move parameters well past the tolerance


def _assert_memory(r: dict, rank: int, world: int) -> None:
    """The model state held equals the plan's prediction, up to ZeRO's padding of its flat buckets
    (at most world - 1 elements of 16 bytes of state per bucket)."""
    held, want = r["held"], r["predicted"]
    pad = 0 if r["stage"] == 0 else 16 * r["buckets"] * (world - 1)
    got, predicted = sum(held.values()), sum(want.values())
    assert predicted <= got <= predicted + pad, (f"rank {rank} {r['case']}", held, want)
    if r["stage"] == 0:
        n = r["numel"]
        assert held == want, (f"rank {rank} {r['case']}", held, want)
        assert want == {"params": 2 * n, "grads": 2 * n, "optimizer": 12 * n}, (f"rank {rank} {r['case']}", want)


def _assert_clipped(r: dict, rank: int) -> None:
    """The norm train_step reports and the clipped steps equal one process's ``clip_grad_norm_``."""
    what = f"rank {rank} {r['case']}"
    assert r["max_grad_norm"] == mp_worker.CLIP, (what, r["max_grad_norm"])
    assert r["norms"] == pytest.approx(r["ref_norms"], rel=NORM_RTOL, abs=NORM_ATOL), (what, r["norms"], r["ref_norms"])
    assert r["losses"] == pytest.approx(r["ref_losses"], rel=NORM_RTOL, abs=NORM_ATOL), (
        what, r["losses"], r["ref_losses"])
    assert min(r["ref_norms"]) > 2 * mp_worker.CLIP, (what, r["ref_norms"])  # every step clipped
    assert not beyond(r["params"], rtol=CLIP_RTOL, atol=CLIP_ATOL), f"{what}: parameters after the steps"


@pytest.mark.slow
def test_mixed_precision_plans_match_one_process_running_the_same_recipe(tmp_path):
    two = launch(2, mp_worker.compile_and_run_2, str(tmp_path))
    four = launch(4, mp_worker.run_4, str(tmp_path))
    cases = {mp_worker.name(c) for c in mp_worker.CASES_2 + mp_worker.CASES_4}
    for world, per_rank in ((2, two), (4, four)):
        for rank, results in enumerate(per_rank):
            for r in results:
                kind = r["case"].split("/")[0]
                if r["case"] in cases:
                    _assert_case(r, rank)
                    want = "optimizer" if "offload" in r["case"] else "none"
                    assert r["offload"] == want and r["offloaded"] == (want != "none"), (rank, r["case"])
                    assert r["sequence_parallel"] == ("-sp/" in r["case"]), (rank, r["case"])
                elif kind == "memory":
                    _assert_memory(r, rank, world)
                elif kind == "clip":
                    _assert_clipped(r, rank)
                elif kind == "fp16":  # an inf gradient on one rank: every rank skips, the scale halves
                    assert not beyond(r["state_over_the_skip"], rtol=0, atol=0), "a rank stepped on an inf gradient"
                    assert r["skipped"] == 1 and r["scale"][1] == r["scale"][0] / 2, (rank, r)
                    assert r["moved_next"] > 0 and r["skipped_next"] == 1, (rank, r)  # the next step updates
                elif kind == "curve":
                    worst = max(abs(a - b) / b for a, b in zip(r["bf16-mixed"], r["fp32"]))
                    assert worst < 0.01, r  # bf16-mixed's curve within 1% of fp32's
                    assert r["fp32"][-1] < 0.8 * r["fp32"][0], r["fp32"]  # it learns: the curve is not flat
                elif kind == "one-optimizer":  # lr = 0 stops all training, the tied parameter's too
                    assert not r["changed"] and len(set(r["losses"])) == 1, (rank, r["changed"], r["losses"])
                else:
                    raise AssertionError(f"rank {rank}: an unexpected result {r['case']}")
    results = {r["case"]: r for r in two[0] + four[0]}
    assert cases <= set(results)
    assert "curve/bf16-vs-fp32" in results and "fp16/skip" in results and "one-optimizer/lr0" in results
    assert {f"memory/zero{s}" for s in range(4)} <= set(results)
    assert {f"clip/{label}" for label in [*mp_worker.CLIP_PINS_2, *mp_worker.CLIP_PINS_4]} <= set(results)
    Path(tmp_path, "summary.json").write_text(json.dumps(results, indent=1))


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
def test_master_weights_stepped_a_bucket_at_a_time_update_as_one_step(precision):
    """``MasterWeights`` upcasts and steps the masters a chunk at a time (at most a gradient
    bucket's cap of fp32 gradients held): with a cap that makes every parameter its own chunk,
    three steps of AdamW (fused and foreach) and SGD with momentum leave the parameters and the
    masters bit for bit where one step over all of them does, a loss scale undone alike."""
    import torch

    from partita.core.optimizers import default_optimizer
    from partita.core.precision import PrecisionPolicy
    from partita.runtime.mixed_precision import MasterWeights

    policy = PrecisionPolicy(precision)
    factories = (default_optimizer, lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
                 lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9))

    def run(factory, chunk_bytes):
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(*s).to(policy.param_dtype)) for s in ((64, 32), (32,), (16, 16))]
        master = MasterWeights(ps, factory, policy, chunk_bytes=chunk_bytes)
        calls = []
        master.optimizer.register_step_pre_hook(lambda *_: calls.append(1))
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
            master.step(inv_scale=0.5)
        return ps, master.masters, len(calls)

    for factory in factories:
        one, one_m, one_calls = run(factory, 1 << 30)
        chunked, chunked_m, chunked_calls = run(factory, 1)
        assert (one_calls, chunked_calls) == (3, 9)
        for a, b in zip([*one, *one_m], [*chunked, *chunked_m]):
            assert torch.equal(a, b)
