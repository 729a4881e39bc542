"""Where the CLI writes: one console for results, one for errors and progress (``progress_bar``)."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

# Piped output (files, CI logs) gets wide tables rather than rich's 80-column default.
console = Console() if sys.stdout.isatty() else Console(width=160)
err_console = Console(stderr=True) if sys.stderr.isatty() else Console(stderr=True, width=160)


def progress_bar() -> Progress:
    """A progress display on the error console (stdout keeps the results)."""
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                    console=err_console, transient=False)
