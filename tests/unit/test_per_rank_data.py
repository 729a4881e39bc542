"""Each rank loads only its share (``ParallelModel.loader``, runtime/data.py; issue 32).

On two gloo ranks, per mesh (dp2, tp2 on a fast-link cluster, pp2, ZeRO-3), training through the
per-rank loader with ``local=True`` gives the global-batch mode's losses and final parameters bit
for bit, while each rank's dataset hands out 1/dp of the bytes the global-batch mode read (every
rank of one dp replica the same share); on pp2, given one dataset per field, the first stage fetches
only the inputs and the last only the targets, with the same result. In one process: the sampler's index lists and the
IterableDataset path, against the global batches a plain ``DataLoader`` gives.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from partita.core.errors import PartitaError
from partita.runtime.data import ShareSampler, share_loader


def _program(global_batch: int, dp_rank: int, dp_size: int) -> SimpleNamespace:
    """What ``share_loader`` reads of a rank's program: the plan's global batch, its sample group and
    their number (its dp rank and size: no cp)."""
    return SimpleNamespace(plan=SimpleNamespace(training=SimpleNamespace(global_batch=global_batch)),
                           dp_rank=dp_rank, dp_size=dp_size, sample_rank=dp_rank, samples=dp_size)


def _joined(per_rank: list[list]) -> list[list]:
    """Each global batch, as the ranks' shares of it put back together in rank order."""
    return [sum((list(b) for b in batches), []) for batches in zip(*per_rank)]


def test_the_sampler_gives_each_rank_its_contiguous_slice_of_each_global_batch():
    assert [list(ShareSampler(10, 4, r, 2)) for r in (0, 1)] == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    assert len(ShareSampler(10, 4, 0, 2)) == 2  # the incomplete last global batch is dropped
    # shuffled: one permutation per pass from the seed, the same on both ranks
    samplers = [ShareSampler(10, 4, r, 2, shuffle=True, seed=3) for r in (0, 1)]
    draws = torch.Generator().manual_seed(3)
    for _ in range(2):
        want = list(BatchSampler(RandomSampler(range(10), generator=draws), 4, drop_last=True))
        assert _joined([list(s) for s in samplers]) == want
    assert want != [[0, 1, 2, 3], [4, 5, 6, 7]]  # it did shuffle


def test_a_shuffled_loader_gives_the_global_batches_of_a_seeded_shuffling_data_loader():
    loaders = [share_loader(_program(4, r, 2), range(10), shuffle=True, seed=3) for r in (0, 1)]
    plain = DataLoader(range(10), batch_size=4, shuffle=True, drop_last=True,
                       generator=torch.Generator().manual_seed(3))
    passes = []
    for _ in range(2):  # pass after pass
        passes.append([b.tolist() for b in plain])
        assert _joined([[b.tolist() for b in loader] for loader in loaders]) == passes[-1]
    assert passes[0] != passes[1]


class _Counting(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n, self.read = n, []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.read.append(i)
        return torch.tensor([i, i]), torch.tensor(i)


def test_a_map_style_loader_fetches_only_this_rank_s_samples():
    datasets = [_Counting(10) for _ in range(2)]
    batches = [list(share_loader(_program(4, r, 2), ds)) for r, ds in enumerate(datasets)]
    assert [ds.read for ds in datasets] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    x, y = batches[1][0]  # the dataset's collate: a tuple of batched tensors
    assert torch.equal(x, torch.tensor([[2, 2], [3, 3]])) and torch.equal(y, torch.tensor([2, 3]))


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(torch.arange(10).view(10, 1) * torch.tensor([1, 10]))  # sample i: [i, 10 i]


def test_an_iterable_dataset_gives_each_rank_its_slice_of_each_global_batch():
    per_rank = [[b.tolist() for b in share_loader(_program(4, r, 2), _Stream())] for r in (0, 1)]
    assert per_rank[0] == [[[0, 0], [1, 10]], [[4, 40], [5, 50]]]
    assert _joined(per_rank) == [b.tolist() for b in DataLoader(_Stream(), batch_size=4, drop_last=True)]
    assert [b.tolist() for b in share_loader(_program(4, 0, 1), _Stream())] == [
        b.tolist() for b in DataLoader(_Stream(), batch_size=4, drop_last=True)]


def test_options_the_plan_decides_are_refused():
    with pytest.raises(PartitaError, match="batch_size"):
        share_loader(_program(4, 0, 2), _Counting(8), batch_size=2)
    with pytest.raises(PartitaError, match="IterableDataset"):
        share_loader(_program(4, 0, 2), _Stream(), shuffle=True)


@pytest.mark.parametrize("dataset, words", [
    ([], "a dataset of 0 samples, fewer than the plan's global batch of 4: it gives no batch"),
    ([(torch.tensor(1.0), torch.tensor(0))] * 3, "a dataset of 3 samples, fewer than the plan's global batch of 4"),
    ({0: "a", 1: "b", 2: "c", 3: "d"}, "loader() got a dict: a dataset is read by position"),
    ((x for x in range(8)), "loader() got a generator: a dataset has a length"),
    (None, "loader() got None"),
    ((list(range(8)), []), "a dataset of 0 samples"),  # one dataset per field, one of them empty
])
def test_a_dataset_that_gives_no_batch_or_is_no_dataset_is_one_message(dataset, words):
    """It was silent: no batch at all for an empty or too short dataset (the incomplete last batch is
    dropped), a dict indexed by position as if by key."""
    with pytest.raises(PartitaError) as e:
        share_loader(_program(4, 0, 2), dataset)
    assert words in e.value.message and e.value.hint, e.value.message


@pytest.mark.parametrize("bad, words", [
    ((torch.zeros(5), torch.tensor(0)), "sample 2 of this rank's batch is (float32[5], int64[]) where sample 0 is "
                                        "(float32[4], int64[])"),
    ((torch.zeros(4),), "sample 2 of this rank's batch is (float32[4]) where sample 0 is (float32[4], int64[])"),
])
def test_ragged_samples_are_one_message_naming_the_first_unlike_one(bad, words):
    """It was torch's traceback from default_collate ("stack expects each tensor to be equal size")."""
    samples = [(torch.zeros(4), torch.tensor(0))] * 8
    samples[2] = bad
    with pytest.raises(PartitaError) as e:
        next(iter(share_loader(_program(4, 0, 1), samples)))
    assert words in e.value.message and "\n" not in e.value.message and e.value.hint, e.value.message


def test_a_middle_pipeline_stage_fetches_nothing_and_gets_as_many_batches():
    ds = _Counting(10)
    nothing = list(share_loader(_program(4, 0, 2), ds, reads=frozenset(), fields=2, shuffle=True))
    assert nothing == [(None, None)] * 2 and ds.read == []
    stream = list(share_loader(_program(4, 1, 2), _Stream(), reads=frozenset(), fields=2))
    assert stream == [(None, None)] * 2  # the stream is walked for its end; nothing is kept


def test_one_dataset_per_field_fetches_only_the_fields_the_stage_reads():
    xs, ys = _Counting(10), _Counting(10)
    first = list(share_loader(_program(4, 0, 1), (xs, ys), reads=frozenset({0}), fields=2))
    assert ys.read == [] and xs.read == list(range(8))
    assert [y for _, y in first] == [None, None] and torch.equal(first[1][0][1], torch.tensor([4, 5, 6, 7]))
    # one dataset of (x, y) samples: the last stage fetches whole samples and gets the inputs as None
    (x, y), _ = list(share_loader(_program(4, 0, 1), _Counting(10), reads=frozenset({1}), fields=2))
    assert x is None and torch.equal(y, torch.tensor([0, 1, 2, 3]))
    # every field read: the per-field form batches each field as the one-dataset form does
    both = list(share_loader(_program(4, 1, 2), (torch.arange(10), torch.arange(10) * 10), reads=None, fields=2))
    one = list(share_loader(_program(4, 1, 2), [(torch.tensor(i), torch.tensor(10 * i)) for i in range(10)]))
    assert len(both) == len(one) == 2 and torch.equal(both[1][1], torch.tensor([60, 70]))
    assert all(torch.equal(a, b) for pa, pb in zip(both, one) for a, b in zip(pa, pb))
    with pytest.raises(PartitaError, match="one per field"):
        share_loader(_program(4, 0, 1), (xs,), fields=2)
    with pytest.raises(PartitaError, match="same length"):
        share_loader(_program(4, 0, 1), (xs, _Counting(9)), fields=2)


def test_a_pipeline_rank_may_leave_out_only_what_its_stage_does_not_read():
    from partita.runtime.batches import check_batch

    plan = SimpleNamespace(model=SimpleNamespace(inputs=["idx=int64[4,8]"], targets="targets=int64[4,8]"),
                           training=SimpleNamespace(global_batch=4))
    first = SimpleNamespace(plan=plan, dp_size=1, samples=1, cp=1, pipeline=SimpleNamespace(reads=frozenset({0})))
    x = torch.zeros(4, 8, dtype=torch.int64)
    check_batch(first, (x,), None, local=True, caller="train_step")  # the first stage: no targets needed
    with pytest.raises(PartitaError, match="this rank's pipeline stage reads it"):
        check_batch(first, (None,), x, local=True, caller="train_step")
    with pytest.raises(PartitaError, match="targets=None"):  # the global-batch mode takes every field
        check_batch(first, (x,), None, local=False, caller="train_step")
