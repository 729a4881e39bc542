"""Fixtures of the integration tier, and the order its files run in."""

from pathlib import Path

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


def pytest_terminal_summary(terminalreporter):
    """How many rank groups the run started, and why (each start imports torch in every rank and
    captures its models afresh): the number to watch when a change slows this tier."""
    import sys

    harness = sys.modules.get("tests.harness")
    if harness is not None and harness.STARTS:
        why = ", ".join(f"{n} {reason}" for reason, n in harness.STARTS.most_common())
        terminalreporter.write_line(f"rank groups started: {sum(harness.STARTS.values())} ({why})")
