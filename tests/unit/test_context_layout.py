"""Which tokens a context-parallel rank holds, and how the batch splits (core/mesh.py): the one rule
the data share, the positions and the ring's masks read."""

from __future__ import annotations

import pytest

from partita.core.errors import PartitaError
from partita.core.mesh import Mesh, sequence_chunks, sequence_positions
from partita.core.pins import Pins


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_the_ranks_hold_every_position_once_two_mirrored_chunks_each(cp):
    seq = 32
    held = [sequence_positions(seq, cp, r) for r in range(cp)]
    assert sorted(p for h in held for p in h) == list(range(seq))
    assert {len(h) for h in held} == {seq // cp}
    if cp > 1:
        # causal load balance: every rank attends over the same number of (query, key) pairs
        pairs = {sum(p + 1 for p in h) for h in held}
        assert len(pairs) == 1, pairs
        assert sequence_chunks(cp, 0) == (0, 2 * cp - 1)
        assert held[0][:seq // (2 * cp)] == list(range(seq // (2 * cp)))


def test_cp_is_carved_out_of_dp_and_the_batch_splits_over_sample_groups():
    m = Mesh(dp=4, tp=2, cp=2)
    assert m.world_size == 8 and m.samples == 2
    assert m.group_ranks(0, "cp") == (0, 2) and m.group_ranks(5, "cp") == (5, 7)  # consecutive dp ranks, tp apart
    assert [m.sample_group(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [m.cp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    with pytest.raises(ValueError, match="cp=3 must divide dp=4"):
        Mesh(dp=4, cp=3)


def test_the_batch_check_counts_sample_groups():
    Pins(dp=4, cp=2).check_batch(2)  # 2 sample groups of one sample
    with pytest.raises(PartitaError, match="--dp / --cp 2 x --micro-batch-size 2 = 4 does not divide"):
        Pins(dp=4, cp=2, micro_batch_size=2).check_batch(6)
