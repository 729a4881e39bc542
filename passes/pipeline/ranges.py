"""Prefix sums and range maxima over the pipeline order: what the cut DP reads of a stage's positions
[j, k) in constant time (passes/pipeline/costs.py ``NodeCosts``); and the bisection that finds where
a segment grown boundary by boundary stops fitting (``first_turned``)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import numpy as np


def prefix(values: Sequence[float]) -> list[float]:
    return list(itertools.accumulate(values, initial=0))


def max_table(values: Sequence[float] | np.ndarray) -> list[list[float]]:
    """Sparse table of ``values``: row r holds the max over each window of 2**r positions (rows built
    by numpy, held as lists: the DP reads single entries, which lists give fastest)."""
    row = np.asarray(values)
    table, n = [row.tolist()], len(row)
    while 2 ** len(table) <= n:
        half = 2 ** (len(table) - 1)
        row = np.maximum(row[:len(row) - half], row[half:])
        table.append(row.tolist())
    return table


def range_max(table: list[list[float]], j: int, k: int) -> float:
    """The largest of a ``max_table``'s values over positions [j, k) (0 where empty)."""
    if k <= j:
        return 0
    r = (k - j).bit_length() - 1
    row = table[r]
    return max(row[j], row[k - (1 << r)])


def first_turned(lo: int, hi: int, turned: Callable[[int], bool]) -> int:
    """The first index in [lo, hi) where ``turned`` holds (``hi`` where none does), by bisection, for a
    ``turned`` that, once true, stays true (a segment that grew past fitting)."""
    while lo < hi:
        mid = (lo + hi) // 2
        if turned(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo
