"""The ring's block of attention (runtime/cp/attention.py): the written-out block every device but the
CPU runs gives the fused CPU kernel's output, logsumexp and gradients, so the path a GPU takes is
checked here too; and two halves merged by their logsumexps are the whole."""

from __future__ import annotations

import pytest
import torch

from partita.runtime.cp.attention import _block, _block_backward, _block_math, _block_math_backward


@pytest.mark.parametrize("causal", [True, False])
def test_the_written_out_block_is_the_fused_kernel(causal):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 8, 4, generator=g) for _ in range(3))
    out, lse = _block(q, k, v, causal, 0.4)
    out2, lse2 = _block_math(q, k, v, causal, 0.4)
    torch.testing.assert_close(out2, out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse2, lse, rtol=1e-5, atol=1e-6)
    do = torch.randn(out.shape, generator=g)
    for a, b in zip(_block_math_backward(do, q, k, v, out, lse, causal, 0.4),
                    _block_backward(do, q, k, v, out, lse, causal, 0.4)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_two_key_halves_merged_by_logsumexp_are_the_whole_row():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=g) for _ in range(3))
    whole, lse = _block(q, k, v, False, 0.5)
    o1, l1 = _block(q, k[:, :, :3], v[:, :, :3], False, 0.5)
    o2, l2 = _block(q, k[:, :, 3:], v[:, :, 3:], False, 0.5)
    new = torch.logaddexp(l1, l2)
    merged = o1 * torch.exp(l1 - new)[..., None] + o2 * torch.exp(l2 - new)[..., None]
    torch.testing.assert_close(merged, whole, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(new, lse, rtol=1e-5, atol=1e-6)
