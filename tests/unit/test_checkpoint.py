"""Sharded checkpoints with torch.distributed.checkpoint (runtime/state/sharded.py), on real gloo
processes: exact resume bit for bit on DP, ZeRO-1/3, TP, PP (tied embedding), dp x tp with ZeRO-3
and tp x pp; resharding across plans; torch's dcp_to_torch_save loads into the plain model."""

from __future__ import annotations

import pytest

from partita.runtime.state.sharded import flat_range_pieces

# Resharding: fp32, but the reduction order differs between the plans, and from one process's
RTOL, ATOL = 1e-4, 2e-5

CASES = {
    "resume-2": ["resume/gpt/{'dp': 2}", "resume/gpt/{'dp': 2, 'zero': 3}", "resume/gpt/{'dp': 2, 'zero': 1}",
                 "resume/gpt/{'dp': 2, 'zero': 1, 'offload': 'optimizer'}", "resume/gpt/{'tp': 2}",
                 "resume/tied-gpt/{'pp': 2}", "torch_save/tied-gpt/{'dp': 2, 'zero': 3}",
                 "pretrained/torch/{'tp': 2}", "pretrained/safetensors/{'pp': 2}",
                 "pretrained/safetensors/{'dp': 2, 'zero': 3}"],
    "resume-reshard-4": ["resume/gpt/{'dp': 2, 'tp': 2, 'zero': 3}", "resume/hf-llama/{'pp': 2, 'tp': 2}",
                         "reshard/gpt/{'dp': 2, 'tp': 2}->{'pp': 2, 'dp': 2, 'zero': 1}",
                         "reshard/gpt/{'dp': 4, 'zero': 3, 'accum': 1}->{'tp': 2, 'pp': 2, 'accum': 4}"],
}


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (4, 1, 6)])
def test_a_flat_range_is_cut_into_few_contiguous_blocks_that_cover_it(shape):
    import math

    import torch

    n = math.prod(shape)
    whole = torch.arange(n).view(shape)
    for lo in range(n):
        for hi in range(lo, n + 1):
            pieces = flat_range_pieces(shape, lo, hi)
            assert len(pieces) <= 2 * len(shape)
            covered = []
            for off, sizes, start in pieces:
                block = whole[tuple(slice(o, o + s) for o, s in zip(off, sizes))]
                # the block is the flat elements [start, start + its size): contiguous
                assert block.flatten().tolist() == list(range(start, start + block.numel()))
                covered += block.flatten().tolist()
            assert sorted(covered) == list(range(lo, hi))
