"""User-facing errors.

A ``PartitaError`` is a mistake a user can fix (bad flag, untraceable model,
infeasible budget, wrong plan file). The CLI prints its message, without a
traceback, and exits with code 2. Anything else is a bug in partita and keeps
its traceback.
"""

from __future__ import annotations


class PartitaError(Exception):
    """A user error: one clear message naming what is wrong and how to fix it."""

    exit_code = 2

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint
        super().__init__(message if hint is None else f"{message}\n  hint: {hint}")


# the hint of a count (a degree, a batch, a number of nodes) that is not a positive integer
POSITIVE_HINT = "give a whole number of at least 1, or leave the option out to let partita choose"
# The largest count partita reads (a batch, a dim, nodes, devices, a degree): 2^48, far past any run,
# and small enough that products of a few of them stay exact in the solvers' 64-bit integers (a batch
# of 10^20 kept CP-SAT running; a dim of 2^63-1 overflowed in torch's C++)
MAX_COUNT = 2**48


def too_large(what: str, v: int) -> PartitaError:
    """The one message for a count over ``MAX_COUNT``."""
    return PartitaError(f"{what} {v} is more than partita plans for (at most 2^48 = {MAX_COUNT:,})",
                        hint="give the size the run really has")


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


def printable(text: object) -> str:
    """``text`` with its control characters written as escapes (``\x1b`` for ESC; newlines kept):
    a name from a file or a flag cannot move the cursor, clear the screen or recolour a terminal."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c == "\n" else repr(c)[1:-1] for c in text)
