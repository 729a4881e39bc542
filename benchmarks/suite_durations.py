"""Where the test suite's time goes: per tier, per file and per test, from pytest's JUnit XML.

    .venv/bin/python -m pytest -q -p no:logging tests/unit tests/integration --junitxml=/tmp/suite.xml
    .venv/bin/python benchmarks/suite_durations.py /tmp/suite.xml [--before /tmp/old.xml] [--tests 40]

Prints Markdown tables (docs/measurements.md "The test suite" keeps them): seconds per tier and per
file (with the number of tests), and the slowest tests; with ``--before``, each file's seconds beside
an earlier run's (files matched by name, whatever folder they were in). A test's time is pytest's:
setup, call and teardown, so a session fixture counts in the first test that asks for it.
"""

from __future__ import annotations

import argparse
import collections
import xml.etree.ElementTree as ET
from pathlib import Path


def durations(junit: Path) -> dict[str, float]:
    """test id (tests/.../test_x.py::name) -> seconds."""
    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        path = case.get("classname", "").replace(".", "/") + ".py"
        out[f"{path}::{case.get('name')}"] = float(case.get("time", 0))
    return out


def tier(test_id: str) -> str:
    parts = test_id.split("::")[0].split("/")
    return parts[1] if len(parts) > 2 else "(flat)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("junit", type=Path)
    ap.add_argument("--before", type=Path, help="an earlier run's JUnit XML, to compare per file")
    ap.add_argument("--tests", type=int, default=40, help="how many of the slowest tests to list")
    args = ap.parse_args()
    now = durations(args.junit)
    before = durations(args.before) if args.before else {}

    tiers: dict[str, list[float]] = collections.defaultdict(list)
    for t, s in now.items():
        tiers[tier(t)].append(s)
    print("| tier | tests | seconds |\n|---|---:|---:|")
    for name, times in sorted(tiers.items()):
        print(f"| {name} | {len(times)} | {sum(times):.0f} |")
    print(f"| all | {len(now)} | {sum(now.values()):.0f} |\n")

    def by_file(d: dict[str, float]) -> dict[str, list[float]]:
        files: dict[str, list[float]] = collections.defaultdict(list)
        for t, s in d.items():
            files[t.split("::")[0]].append(s)
        return files

    files, old = by_file(now), collections.defaultdict(float)
    for f, times in by_file(before).items():
        old[Path(f).name] += sum(times)
    head = "| file | tests | seconds |" + (" before |" if before else "")
    print(head + "\n|---|---:|---:|" + ("---:|" if before else ""))
    for f, times in sorted(files.items(), key=lambda kv: -sum(kv[1])):
        row = f"| {f} | {len(times)} | {sum(times):.1f} |"
        if before:
            # a split file's two halves each show the whole file's earlier time
            row += f" {old[Path(f).name]:.1f} |" if Path(f).name in old else " |"
        print(row)
    print("\n| slowest tests | seconds |\n|---|---:|")
    for t, s in sorted(now.items(), key=lambda kv: -kv[1])[:args.tests]:
        print(f"| {t} | {s:.1f} |")


if __name__ == "__main__":
    main()
