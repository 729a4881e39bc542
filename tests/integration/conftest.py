"""Fixtures of the integration tier, and the order its files run in."""

from pathlib import Path

import pytest

from tests.browser import browser, open_page  # noqa: F401 (the browser fixtures, for the page tests)

LAUNCHERS = ("torchrun", "partita_cli", "command", "subprocess")  # what starts processes of its own


def pytest_collection_modifyitems(items):
    """The files that only run ranks (tests/harness.py ``launch``) first, then those that also start
    launchers, then those that only start launchers: starting a launcher ends the kept rank groups
    (and the captures they keep), so grouping the launcher tests at the end keeps the groups up for
    the rest. Within a file, the order is the file's own; the other tiers run before this one."""
    here = Path(__file__).parent

    def order(item) -> int:
        if here not in Path(item.path).parents:
            return -1
        names = vars(item.module)
        launches, launchers = "launch" in names, any(n in names for n in LAUNCHERS)
        return 0 if launches and not launchers else 1 if launches else 2

    items.sort(key=order)


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
