"""The user's files: read only from regular files and only up to a cap; never written over an input.

A path a user names may be anything: a FIFO (opening it waits for a writer that never comes),
a character device (/dev/zero never ends), a folder, a file of gigabytes, or the very file the
command reads. ``read_user_file`` opens without waiting, refuses anything but a regular file and
reads at most a cap; ``writable_path`` checks an output before any work is done (its folder
exists, it is no folder, it is none of the command's inputs); ``write_text`` writes it; the
CLI's commands declare their outputs with ``writes`` and every other path they are given is an
input that no output may replace.
"""

from __future__ import annotations

import functools
import os
import stat
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from partita.core.errors import PartitaError

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def read_user_file(path: str | os.PathLike, *, what: str, limit: int, hint: str,
                   error: type[PartitaError] = PartitaError) -> bytes:
    """The bytes of the ``what`` (e.g. "plan file") at ``path``: a regular file (a link to one is
    followed) of at most ``limit`` bytes, else one ``error`` saying what the path is instead."""
    path = Path(path)
    try:  # O_NONBLOCK: opening a FIFO returns at once instead of waiting for a writer
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except (OSError, ValueError) as e:
        raise error(f"cannot read {what} {path}: {getattr(e, 'strerror', None) or e}", hint=hint) from e
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise error(f"cannot read {what} {path}: it is {_kind(mode)}, not a regular file", hint=hint)
    with os.fdopen(fd, "rb", buffering=0) as f:
        chunks, size = [], 0
        while size <= limit:
            chunk = f.read(min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    if size > limit:
        raise error(f"cannot read {what} {path}: it is larger than {limit:,} bytes, more than any {what} "
                    "partita reads", hint=hint)
    return b"".join(chunks)


def check_regular_file(path: str | os.PathLike, *, what: str, hint: str,
                       error: type[PartitaError] = PartitaError) -> Path:
    """``path`` when it names a regular file (a link to one is followed), else one ``error``
    saying what it is instead: for a file something else reads (a model file Python imports)."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError) as e:
        reason = "it does not exist" if isinstance(e, FileNotFoundError) else getattr(e, "strerror", None) or e
        raise error(f"cannot read {what} {path}: {reason}", hint=hint) from e
    if not stat.S_ISREG(mode):
        raise error(f"cannot read {what} {path}: it is {_kind(mode)}, not a regular file", hint=hint)
    return path


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a file")


def read_user_text(path: str | os.PathLike, *, what: str, limit: int, hint: str,
                   error: type[PartitaError] = PartitaError) -> str:
    """``read_user_file`` decoded as UTF-8; a byte that is not is named."""
    data = read_user_file(path, what=what, limit=limit, hint=hint, error=error)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{path} is not a {what}: byte {e.start} is not UTF-8 text", hint=hint) from e


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether ``a`` and ``b`` name one file (through links, hard links and relative paths)."""
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):
        return os.path.abspath(a) == os.path.abspath(b)


def writable_path(path: str | os.PathLike, *, inputs: Iterable[str | os.PathLike | None] = ()) -> Path:
    """``path`` as a file to write, checked before any work is done: its folder must exist, it
    must not be a folder itself, and it must be none of ``inputs`` (the files the command reads:
    writing would destroy one)."""
    path = check_path_text(path, "the output path")
    folder = path.parent
    above = next((p for p in [folder, *folder.absolute().parents] if p.exists()), None)
    if above is not None and not above.is_dir():
        raise PartitaError(f"cannot write {path}: {above} is a file, not a folder",
                           hint="pass -o a path in a folder")
    if not folder.is_dir():
        raise PartitaError(f"cannot write {path}: the folder {folder} does not exist",
                           hint=f"create it first (mkdir -p {folder}) or pass -o a path in an existing folder")
    if path.is_dir():
        raise PartitaError(f"cannot write {path}: it is a folder", hint="pass -o a file name")
    if not os.access(path if path.exists() else folder, os.W_OK):
        raise PartitaError(f"cannot write {path}: {'it' if path.exists() else f'the folder {folder}'} is not "
                           "writable", hint="pass -o a path you can write to")
    check_output(path, [source for source in inputs if source is not None])
    return path


NAME_MAX, PATH_MAX = 255, 4096  # bytes of one path component, and of a whole path (Linux's limits)


def check_path_text(path: str | os.PathLike, what: str) -> Path:
    """A path's text: not empty, no NUL byte, no component over ``NAME_MAX`` bytes, the whole under ``PATH_MAX``."""
    text = os.fspath(path)
    if not str(text).strip():
        raise PartitaError(f"{what} {text!r} is empty (no path at all; the current folder is written '.')",
                           hint="pass a path")
    if "\0" in str(text):
        raise PartitaError(f"{what} {text!r} holds a NUL character, which no path can", hint="pass a plain path")
    raw = os.fsencode(text)
    if len(raw) >= PATH_MAX or any(len(part) > NAME_MAX for part in raw.split(b"/")):
        raise PartitaError(f"{what} is too long ({len(raw):,} bytes; a file name may have {NAME_MAX}, a path "
                           f"{PATH_MAX - 1}): {str(text)[:60]}...", hint="pass a shorter path")
    return Path(text)


def writable_folder(path: str | os.PathLike, what: str) -> Path:
    """``path`` as a folder a run writes into (created when missing), checked before any work is
    done: a sane path (``check_path_text``), not a file, under no file, and writable where it will be
    made. ``what`` names the option in the message."""
    path = check_path_text(path, what)
    if path.exists() and not path.is_dir():
        raise PartitaError(f"{what} {path} is a file, not a folder", hint="pass a folder (it is created if missing)")
    above = next((p for p in [path, *path.absolute().parents] if p.exists()), None)
    if above is not None and not above.is_dir():
        raise PartitaError(f"{what} {path} is below {above}, which is a file, not a folder",
                           hint="pass a folder (it is created if missing) under a folder")
    if above is not None and not os.access(above, os.W_OK | os.X_OK):
        raise PartitaError(f"{what} {path}: {above} is not writable", hint="pass a folder you can write to")
    return path


def write_text(path: str | os.PathLike, text: str, *, inputs: Iterable[str | os.PathLike | None] = ()) -> Path:
    """Write ``text`` to ``path`` (``writable_path``), an OS error becoming one user message."""
    path = writable_path(path, inputs=inputs)
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as e:
        raise PartitaError(f"cannot write {path}: {e.strerror or e}", hint='pass -o a path you can write to') from e
    return path


def paths_given(params: Mapping[str, Any], *, leave_out: Iterable[str] = ()) -> list[str]:
    """The existing files named by a command's parameters (``FILE.py:NAME`` names FILE.py), but
    those in ``leave_out``: what the command reads."""
    out = []
    for name, value in params.items():
        if name in leave_out:
            continue
        for text in value if isinstance(value, (tuple, list)) else (value,):
            if not isinstance(text, (str, os.PathLike)):
                continue
            text = os.fspath(text)
            for candidate in (text, text.rpartition(":")[0]):
                try:
                    if candidate and os.path.exists(candidate):
                        out.append(candidate)
                        break
                except ValueError:  # a NUL byte: no path at all
                    break
    return out


def writes(*outputs: str, replaces: tuple[str, ...] = ()) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A command whose parameters ``outputs`` are paths it writes: before it runs, each given one
    is checked (``writable_path``) against every file its other parameters name, but those in
    ``replaces`` (``partita verify PLAN -o PLAN`` writes its plan back, as without ``-o``)."""
    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(command)
        def guarded(**params: Any) -> Any:
            read = paths_given(params, leave_out=(*outputs, *replaces))
            for name in outputs:
                if params.get(name) is not None:  # -o (output, plan_path), or the flag of its name
                    check_path_text(params[name], "the output path" if name in ("output", "plan_path")
                                    else f"--{name.replace('_', '-')}")
                    check_output(params[name], read)
            return command(**params)
        return guarded
    return decorate


def check_output(path: str | os.PathLike, inputs: Iterable[str | os.PathLike]) -> None:
    """An output that names one of ``inputs`` is refused (a folder output, a checkpoint folder, too)."""
    for source in inputs:
        if same_file(path, source):
            raise PartitaError(f"cannot write {path}: it is {source}, an input this reads; writing would replace it",
                               hint="write the output to another path")
