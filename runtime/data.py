"""Each rank loads only its share of the global batch: ``ParallelModel.loader``.

The loader's batches are exactly this rank's ``share`` (runtime/batches.py) of the global batches
that ``DataLoader(dataset, batch_size=global_batch, drop_last=True)`` would give, for
``train_step(..., local=True)``. A map-style dataset is read through ``ShareSampler``: each rank
fetches only its 1/dp of the samples. An ``IterableDataset`` is walked whole by every rank, which
keeps only its slice of each global batch (``ShareOfStream``): a stream that can shard itself
should. The ranks of one replica (its tp and pp ranks) load the same share of samples, of which
a pipeline stage fetches only the fields it reads (``share_loader``'s ``reads``). docs/guide.md
says how.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    default_collate,
)

from partita.core.errors import PartitaError
from partita.runtime.program import Program

# set by the loader from the plan: a DataLoader option that would change them is refused
_SET_HERE = ("batch_size", "sampler", "batch_sampler", "drop_last", "generator")


class ShareSampler(Sampler[list[int]]):
    """Rank ``dp_rank`` of ``dp_size``'s contiguous slice of each global batch of indices.

    The global batches are torch's own: ``BatchSampler`` over the dataset's ``n`` indices in order,
    or with ``shuffle`` over a ``RandomSampler`` drawing from one generator seeded with ``seed`` on
    every rank (a new permutation each pass), ``global_batch`` at a time, the incomplete last one
    dropped. Of each, this rank gets rows ``[dp_rank * b, (dp_rank + 1) * b)``, ``b = global_batch
    / dp_size``: what ``share`` (runtime/batches.py) would take of it."""

    def __init__(self, n: int, global_batch: int, dp_rank: int, dp_size: int, *, shuffle: bool = False,
                 seed: int = 0) -> None:
        if global_batch % dp_size:
            raise PartitaError(f"global batch {global_batch} is not divisible by dp={dp_size}",
                               hint="give a global batch that is a multiple of the plan's dp degree")
        self.generator = torch.Generator().manual_seed(seed)  # the same draws on every rank, pass after pass
        order = RandomSampler(range(n), generator=self.generator) if shuffle else SequentialSampler(range(n))
        self.global_batches = BatchSampler(order, global_batch, drop_last=True)
        self.per_rank = global_batch // dp_size
        self.first = dp_rank * self.per_rank

    def __len__(self) -> int:
        return len(self.global_batches)

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.global_batches:
            yield batch[self.first:self.first + self.per_rank]


class ShareOfStream(IterableDataset):
    """This rank's samples of a stream: of each run of ``global_batch`` samples, the
    ``per_rank`` from ``first`` on (an incomplete last run is dropped, as ``drop_last``)."""

    def __init__(self, stream: IterableDataset, global_batch: int, dp_rank: int, dp_size: int, *,
                 keep: bool = True) -> None:
        self.stream, self.global_batch, self.keep = stream, global_batch, keep
        self.per_rank = global_batch // dp_size
        self.first = dp_rank * self.per_rank

    def __iter__(self) -> Iterator[Any]:
        run: list[Any] = []
        count = 0
        for i, sample in enumerate(self.stream):
            count = i + 1
            if self.first <= i % self.global_batch < self.first + self.per_rank:
                run.append(sample if self.keep else None)
            if i % self.global_batch == self.global_batch - 1:  # a whole global batch: its share counts
                yield from run
                run = []
        if count < self.global_batch:  # as a map-style dataset's (``_check_dataset``), once it is known
            raise PartitaError(f"loader() got an IterableDataset of {count} sample{'s' if count != 1 else ''}, "
                               f"fewer than the plan's global batch of {self.global_batch}: it gives no batch",
                               hint="pass a stream of at least one global batch of samples, or compile the plan "
                               "for a smaller --batch")


class Columns(Dataset):
    """Per-field datasets side by side (the inputs in order, the targets last): sample ``i`` is
    ``(columns[0][i], ..., columns[-1][i])``, each field ``reads`` leaves out None and not fetched."""

    def __init__(self, columns: Sequence[Dataset], reads: frozenset[int] | None) -> None:
        lengths = {len(c) for c in columns}
        if len(lengths) != 1:
            raise PartitaError(f"loader() got columns of {sorted(lengths)} samples: each field's dataset must "
                               "have one sample per row", hint="pass datasets of the same length")
        self.columns, self.reads = list(columns), reads

    def __len__(self) -> int:
        return len(self.columns[0])

    def __getitem__(self, i: int) -> tuple[Any, ...]:
        return tuple(c[i] if self.reads is None or j in self.reads else None for j, c in enumerate(self.columns))


class _ReadFields:
    """A collate of the fields a stage reads: ``collate`` over each read field's samples (in the
    columns form) or over whole samples, the other fields of the batch set to None."""

    def __init__(self, collate: Callable[[list[Any]], Any], reads: frozenset[int], per_field: bool) -> None:
        self.collate, self.reads, self.per_field = collate, reads, per_field

    def __call__(self, samples: list[Any]) -> Any:
        if self.per_field:
            return tuple(self.collate([s[j] for s in samples]) if j in self.reads else None
                         for j in range(len(samples[0])))
        batch = self.collate(samples)
        if isinstance(batch, (tuple, list)):
            return type(batch)(b if j in self.reads else None for j, b in enumerate(batch))
        return batch


def _check_dataset(dataset: Any, global_batch: int) -> None:
    """Refuse what would give no batch, or batches of something else, before the first step: a
    mapping (indexed by key, not position), something neither map-style nor a stream, an empty
    dataset or one of fewer samples than one global batch (the incomplete last batch is dropped)."""
    what = type(dataset).__name__
    if isinstance(dataset, Mapping):
        raise PartitaError(f"loader() got a {what}: a dataset is read by position (dataset[i] is sample i), "
                           "a mapping by key", hint="pass a list or map-style Dataset of (inputs..., targets) "
                           "samples, or a tuple of one dataset per field")
    if isinstance(dataset, IterableDataset):
        return  # a stream's length is its own to know
    if isinstance(dataset, (str, bytes, bytearray)):
        raise PartitaError(f"loader() got text ({what} of {len(dataset)} characters): its samples would be "
                           "single characters", hint="pass a list or map-style Dataset of (inputs..., targets) "
                           "samples of tensors (tokenize text first)")
    if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise PartitaError(f"loader() got {'None' if dataset is None else 'a ' + what}: a dataset has a length "
                           "and is read by position (a map-style Dataset), or is a torch IterableDataset",
                           hint="wrap a generator or stream in a torch.utils.data.IterableDataset, or pass a list")
    n = len(dataset)
    if n < global_batch:
        raise PartitaError(f"loader() got a dataset of {n} sample{'s' if n != 1 else ''}, fewer than the plan's "
                           f"global batch of {global_batch}: it gives no batch (the incomplete last one is dropped)",
                           hint="pass at least one global batch of samples, or compile the plan for a smaller "
                           "--batch")


def _shape_of(sample: Any) -> str:
    """A sample's structure in a few characters: ``(float32[4], int64[])``."""
    if isinstance(sample, torch.Tensor):
        return f"{str(sample.dtype).removeprefix('torch.')}[{','.join(map(str, sample.shape))}]"
    if isinstance(sample, (tuple, list)):
        return "(" + ", ".join(_shape_of(x) for x in sample) + ")"
    if isinstance(sample, Mapping):
        return "{" + ", ".join(f"{k}: {_shape_of(v)}" for k, v in sample.items()) + "}"
    return type(sample).__name__


def _holds_text(batch: Any) -> bool:
    if isinstance(batch, (str, bytes)):
        return True
    if isinstance(batch, (tuple, list)):
        return any(_holds_text(b) for b in batch)
    return isinstance(batch, Mapping) and any(_holds_text(b) for b in batch.values())


class _Stacked:
    """torch's ``default_collate``, its failure one message naming the first sample unlike the
    batch's first (ragged samples: another shape, another number of fields, another type). With
    ``fields``, a sample that is a tuple or list has that many (the inputs, then the targets); a
    batch holds no text, which no step takes."""

    def __init__(self, fields: int | None = None) -> None:
        self.fields = fields

    def __call__(self, samples: list[Any]) -> Any:
        first = samples[0]
        if self.fields is not None and isinstance(first, (tuple, list)) and len(first) != self.fields:
            raise PartitaError(f"loader(): sample 0 is {_shape_of(first)}, {len(first)} field"
                               f"{'s' if len(first) != 1 else ''}, but a step takes {self.fields}: the inputs in "
                               "order, then the targets",
                               hint="give each sample the model's inputs and the targets, e.g. (x, y)")
        batch = self._collate(samples)
        if _holds_text(batch):
            raise PartitaError(f"loader(): the samples hold text ({_shape_of(first)}): a step takes tensors",
                               hint="tokenize the text in the dataset (or a collate_fn) into integer tensors")
        return batch

    def _collate(self, samples: list[Any]) -> Any:
        try:
            return default_collate(samples)
        except (RuntimeError, TypeError, ValueError) as e:
            first = _shape_of(samples[0])
            unlike = next(((i, _shape_of(x)) for i, x in enumerate(samples) if _shape_of(x) != first), None)
            where = (f"sample {unlike[0]} of this rank's batch is {unlike[1]} where sample 0 is {first}"
                     if unlike else f"its samples are {first}, which torch cannot stack")
            raise PartitaError(f"loader(): the samples of a batch do not stack into one: {where} "
                               f"({type(e).__name__}: {str(e).splitlines()[0][:200]})",
                               hint="give every sample the same fields, shapes and dtypes (pad or crop them), or "
                               "pass a collate_fn that makes one batch of them") from None


def _nothing(fields: int) -> Callable[[list[Any]], tuple[None, ...]]:
    return lambda _: (None,) * fields


def share_loader(program: Program, dataset: Dataset | Sequence[Dataset], *, reads: frozenset[int] | None = None,
                 fields: int = 2, shuffle: bool = False, seed: int = 0, **dataloader_kwargs: Any) -> DataLoader:
    """A ``DataLoader`` of this rank's share of each global batch of ``dataset`` (module
    docstring); ``dataloader_kwargs`` (``collate_fn``, ``num_workers``, ``pin_memory``, ...) go to
    it. The batch size and the order are the plan's and ``shuffle``'s / ``seed``'s: the global
    batches of ``DataLoader(dataset, batch_size=global_batch, shuffle=shuffle, drop_last=True,
    generator=torch.Generator().manual_seed(seed))``, pass after pass.

    ``reads``: the positions of the ``fields`` of a sample (inputs, targets last) this rank's
    pipeline stage reads (None: all). The others come as None in each batch: not fetched at all
    when the stage reads none of them, or ``dataset`` is a tuple of one dataset per field."""
    given = sorted(set(_SET_HERE) & set(dataloader_kwargs))
    # the rows are the rank's sample group's (cp ranks share samples; each keeps its slice of every
    # sequence when the step shares the batch out, runtime/batches.py)
    global_batch, dp_rank, dp_size = program.plan.training.global_batch, program.sample_rank, program.samples
    if given:
        raise PartitaError(f"loader() sets {', '.join(given)} itself: each batch is this rank's "
                           f"{global_batch // dp_size} of the plan's global batch of {global_batch}",
                           hint="leave them out; shuffle=True (and seed=) draw the order alike on every rank")
    _check_order(shuffle, seed, dataloader_kwargs.get("collate_fn"))
    if reads is not None and set(range(fields)) <= reads:
        reads = None  # every field
    per_field = isinstance(dataset, tuple)  # (a list is a dataset of its own)
    for d in dataset if per_field else (dataset,):
        _check_dataset(d, global_batch)
    if per_field:
        if len(dataset) != fields:
            raise PartitaError(f"loader() got {len(dataset)} datasets, one per field, but a step takes {fields} "
                               "(the inputs in order, then the targets)",
                               hint="pass one dataset per input and one for the targets, or one dataset of "
                               "(inputs..., targets) samples")
        if any(isinstance(c, IterableDataset) for c in dataset):
            raise PartitaError("loader() reads per-field datasets by index: an IterableDataset cannot be one",
                               hint="pass map-style datasets, or one IterableDataset of whole samples")
        dataset = Columns(dataset, reads)
    collate = dataloader_kwargs.pop("collate_fn", None) or _Stacked(None if per_field else fields)
    if reads is not None:
        collate = _ReadFields(collate, reads, per_field)
    elif per_field:
        collate = _ReadFields(collate, frozenset(range(fields)), True)
    if isinstance(dataset, IterableDataset):
        if shuffle:
            raise PartitaError("loader() cannot shuffle an IterableDataset: it is read in its own order",
                               hint="shuffle inside the stream, with the same seed on every rank")
        if dataloader_kwargs.get("num_workers", 0):
            raise PartitaError("loader() reads an IterableDataset in this process (num_workers=0): each "
                               "worker would read the whole stream again",
                               hint="leave num_workers out, or use a map-style dataset")
        if reads is not None and not reads:  # a middle stage: only the stream's end matters
            return DataLoader(ShareOfStream(dataset, global_batch, dp_rank, dp_size, keep=False),
                              batch_size=global_batch // dp_size, collate_fn=_nothing(fields))
        return _loader(ShareOfStream(dataset, global_batch, dp_rank, dp_size),
                       batch_size=global_batch // dp_size, collate_fn=collate, **dataloader_kwargs)
    sampler = ShareSampler(len(dataset), global_batch, dp_rank, dp_size, shuffle=shuffle, seed=seed)
    if reads is not None and not reads:  # a middle stage reads nothing: the batches are Nones, nothing fetched
        return DataLoader(range(len(dataset)), batch_sampler=sampler, generator=sampler.generator,
                          collate_fn=_nothing(fields))
    # the DataLoader draws its workers' base seed from the sampler's generator before each pass, as
    # DataLoader(shuffle=True, generator=torch.Generator().manual_seed(seed)) does: the same draws
    return _loader(dataset, batch_sampler=sampler, generator=sampler.generator, collate_fn=collate,
                   **dataloader_kwargs)


def _check_order(shuffle: Any, seed: Any, collate_fn: Any) -> None:
    """``shuffle`` a bool, ``seed`` a whole number a generator takes, ``collate_fn`` a function."""
    if not isinstance(shuffle, bool):
        raise PartitaError(f"loader(shuffle={shuffle!r:.40}) must be True or False",
                           hint="shuffle=True draws a new order each pass, alike on every rank")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise PartitaError(f"loader(seed={seed!r:.40}) must be a whole number from 0 to 2^64 - 1",
                           hint="pass the same seed on every rank, e.g. seed=0")
    if collate_fn is not None and not callable(collate_fn):
        raise PartitaError(f"loader(collate_fn={collate_fn!r:.40}) is not a function",
                           hint="pass a function of a list of samples, or leave collate_fn out")


def _loader(dataset: Any, **kwargs: Any) -> DataLoader:
    """``DataLoader(dataset, **kwargs)``; an option torch refuses (``num_workers=-1``, a name it does
    not know) is one message naming it."""
    try:
        return DataLoader(dataset, **kwargs)
    except (TypeError, ValueError) as e:
        raise PartitaError(f"loader(): torch's DataLoader refuses the options given: {str(e).splitlines()[0][:200]}",
                           hint="pass only DataLoader's own options (num_workers, pin_memory, collate_fn, ...) "
                           "with values it takes") from None
