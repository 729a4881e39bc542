"""Where the CLI writes: one console for results, one for errors and progress."""

from __future__ import annotations

import sys

from rich.console import Console

# Piped output (files, CI logs) gets wide tables rather than rich's 80-column default.
console = Console() if sys.stdout.isatty() else Console(width=160)
err_console = Console(stderr=True) if sys.stderr.isatty() else Console(stderr=True, width=160)
