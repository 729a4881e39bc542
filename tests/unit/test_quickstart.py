"""The README's quickstart runs exactly as the README prints it: its ``train.py`` is written from the
README's own code block, then each line of its shell block runs in that folder, as a user types it."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
BIN = Path(sys.executable).parent  # the environment's `python` and `partita`, as `source .venv/bin/activate` gives


def quickstart_blocks() -> tuple[str, list[str], int]:
    """The README's quickstart: the train.py block, the shell lines, and the section's length in lines."""
    text = README.read_text()
    section = text[text.index("## Quickstart"):]
    section = section[:section.index("\n## ", 1)]
    train = re.search(r"<!-- quickstart: train.py -->\n```python\n(.*?)```", section, re.S)
    shell = re.search(r"<!-- quickstart: shell -->\n```bash\n(.*?)```", section, re.S)
    assert train and shell, "the README's quickstart lost its marked train.py or shell block"
    lines = [line for line in shell.group(1).splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return train.group(1), lines, len(section.splitlines())


def test_the_quickstart_is_short():
    _, lines, length = quickstart_blocks()
    assert length < 100, f"the quickstart is {length} lines"
    assert any(line.startswith("partita run ") for line in lines)
