"""User-facing errors.

A ``PartitaError`` is a mistake a user can fix (bad flag, untraceable model,
infeasible budget, wrong plan file). The CLI prints its message, without a
traceback, and exits with code 2. Anything else is a bug in partita and keeps
its traceback.
"""

from __future__ import annotations

from pathlib import Path


class PartitaError(Exception):
    """A user error: one clear message naming what is wrong and how to fix it."""

    exit_code = 2

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint
        super().__init__(message if hint is None else f"{message}\n  hint: {hint}")


# the hint of a count (a degree, a batch, a number of nodes) that is not a positive integer
POSITIVE_HINT = "give a whole number of at least 1, or leave the option out to let partita choose"


class CaptureError(PartitaError):
    """The model could not be captured as an FX graph."""


class ClusterError(PartitaError):
    """An unknown preset or a malformed cluster file."""


class InputSpecError(PartitaError):
    """A malformed ``--input NAME=DTYPE[SHAPE]``."""


class PlanError(PartitaError):
    """A plan file that cannot be used: corrupt, another version, another model or world size."""


class InfeasibleError(PartitaError):
    """No plan satisfies the constraints; the message names the binding ones and what to relax."""


class ModelLoadError(PartitaError):
    """``FILE.py:NAME`` could not be loaded."""


def writable_path(path: str | Path) -> Path:
    """``path`` as a file to write, checked before any work is done: its folder must exist and
    it must not be a folder itself (``-o`` of compile, view, verify, calibrate)."""
    path = Path(path)
    folder = path.parent
    if not folder.is_dir():
        raise PartitaError(f"cannot write {path}: the folder {folder} does not exist",
                           hint=f"create it first (mkdir -p {folder}) or pass -o a path in an existing folder")
    if path.is_dir():
        raise PartitaError(f"cannot write {path}: it is a folder", hint="pass -o a file name")
    return path


def write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` (``writable_path``), an OS error becoming one user message."""
    path = writable_path(path)
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as e:
        raise PartitaError(f"cannot write {path}: {e.strerror or e}", hint='pass -o a path you can write to') from e
    return path
