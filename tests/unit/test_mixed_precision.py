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

import pytest

LOSS_RTOL = 5e-3
PARAM_RTOL, PARAM_ATOL = 2.0**-6, 1e-3
# Gradient clipping runs fp32 plans: only the order of the sums differs from one process's
CLIP_RTOL, CLIP_ATOL = 1e-4, 2e-5  # the parameters
NORM_RTOL, NORM_ATOL = 1e-4, 1e-6  # the norms and losses (pytest.approx's rel and abs)


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
