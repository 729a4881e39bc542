"""Kernel launches per step, counted as the aten ops a step dispatches (exact, the same on any machine):
a 1-device bf16-mixed plan dispatches no more than eager autocast does on the same model (issue 25's
bound: 1.05x). Before the foreach gradient norm and working-copy refresh it dispatched a norm and a
copy per parameter (at 136M parameters on an H200: 1,745 kernels a step, 1.21x eager's time)."""

from __future__ import annotations

from benchmarks.dispatch_count import MODELS, dispatches


def test_a_one_device_bf16_step_dispatches_no_more_than_eager_autocast():
    cfg, batch, seq = MODELS["GPT 12 x 64"]
    ours, eager, diff = dispatches(cfg, batch, seq)
    assert ours <= 1.05 * eager, (ours, eager, diff)
    # one norm for all gradients and one copy for all working copies, not one per parameter
    assert diff.get("aten._foreach_norm.Scalar", (0, 0))[0] == 1
    assert diff.get("aten.linalg_vector_norm.default", (0, 0))[0] == 0
    assert "aten.copy_.default" not in diff or diff["aten.copy_.default"][0] < 10, diff
