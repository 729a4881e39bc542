"""Fixtures of the integration tier, and the order its tests run in."""

import json
import statistics
from pathlib import Path

import pytest

from tests.browser import browser, open_page  # noqa: F401 (the browser fixtures, for the page tests)

LAUNCHERS = ("torchrun", "partita_cli", "command", "subprocess")  # what starts processes of its own
# Each test's seconds (setup + call + teardown) in a `make test` run on 2 cores (pytest --durations=0, the
# three summed per test): the order's weights, so they need only be roughly right. A test not listed
# (new, or renamed) weighs as the median of its function's other cases, else of all tests. Refresh it
# after a change that moves a test's time a lot (from --durations=0's lines).
DURATIONS = Path(__file__).with_name("durations.json")


def pytest_collection_modifyitems(items):
    """The files that only run ranks (tests/harness.py ``launch``) first, then those that also start
    launchers, then those that only start launchers: starting a launcher ends the kept rank groups
    (and the captures they keep), so grouping the launcher tests at the end keeps the groups up for
    the rest. Within each of the three, the files whose tests take longest in all first (by
    ``DURATIONS``; a file's tests stay together, in the file's own order, for its module fixtures):
    pytest-xdist hands each worker a contiguous part of this order and an idle worker takes the end of
    another's queue, so the short files left at the ends let the two workers finish together instead
    of one waiting on the other's long test. The other tiers run before this one."""
    here = Path(__file__).parent
    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    by_function: dict[str, list[float]] = {}
    for nodeid, s in seconds.items():
        by_function.setdefault(nodeid.split("[")[0], []).append(s)
    default = statistics.median(seconds.values()) if seconds else 0.0

    def weight(item) -> float:
        if item.nodeid in seconds:
            return seconds[item.nodeid]
        cases = by_function.get(item.nodeid.split("[")[0])
        return statistics.median(cases) if cases else default

    per_file: dict[Path, float] = {}
    for item in items:
        per_file[Path(item.path)] = per_file.get(Path(item.path), 0.0) + weight(item)

    def order(item) -> tuple[int, float, str]:
        path = Path(item.path)
        if here not in path.parents:
            return -1, 0.0, ""
        names = vars(item.module)
        launches, launchers = "launch" in names, any(n in names for n in LAUNCHERS)
        return (0 if launches and not launchers else 1 if launches else 2), -per_file[path], str(path)

    items.sort(key=order)  # stable: a file's tests keep their order


_STARTS_OF_WORKERS: list[dict] = []  # under pytest-xdist, each worker's (its own rank groups)


def _starts() -> dict[str, int]:
    import sys

    harness = sys.modules.get("tests.harness")
    return dict(harness.STARTS) if harness is not None else {}


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # an xdist worker: its groups, for the summary
        session.config.workeroutput["rank_group_starts"] = _starts()


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook
def pytest_testnodedown(node, error):
    _STARTS_OF_WORKERS.append(getattr(node, "workeroutput", {}).get("rank_group_starts", {}))


def pytest_terminal_summary(terminalreporter):
    """How many rank groups the run started, and why (each start imports torch in every rank and
    captures its models afresh): the number to watch when a change slows this tier."""
    total: dict[str, int] = {}
    for starts in [_starts(), *_STARTS_OF_WORKERS]:
        for reason, n in starts.items():
            total[reason] = total.get(reason, 0) + n
    if total:
        why = ", ".join(f"{n} {reason}" for reason, n in sorted(total.items(), key=lambda kv: -kv[1]))
        terminalreporter.write_line(f"rank groups started: {sum(total.values())} ({why})")
