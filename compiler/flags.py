"""The CLI's flag types and the flags several commands share: numbers written in ASCII digits
(``Number``: every numeric flag), a rendezvous endpoint (``Endpoint``) and ``--verbose`` (what
torch logs while a model is captured)."""

from __future__ import annotations

import math
import re
import sys
from typing import Any

import click


class Number(click.ParamType):
    """An integer or float flag written in ASCII (click's own take full-width digits: int("８") is 8),
    finite (``nan`` is no number of seconds, ``inf`` no limit), at least ``low`` when given; every
    numeric flag of the CLI is one."""

    def __init__(self, kind: type, low: float | None = None) -> None:
        self.kind, self.low = kind, low
        self.name = "integer" if kind is int else "float"

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        if isinstance(value, self.kind) and not isinstance(value, bool):
            number = value
        else:
            text = str(value).strip()
            try:
                number = self.kind(text) if text.isascii() else None
            except ValueError:
                number = None
            if number is None:
                self.fail(f"{value!r} is not a valid {self.name}", param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite {self.name}", param, ctx)
        if self.low is not None and number < self.low:
            self.fail(f"{value!r} is not in the range x>={self.low}", param, ctx)
        return number


INT, FLOAT = Number(int), Number(float)


class Endpoint(click.ParamType):
    """``HOST[:PORT]`` (torchrun's rendezvous endpoint; an IPv6 host in brackets): a host of printable
    ASCII without spaces, a port from 1 to 65535 when given."""

    name = "HOST:PORT"

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        text = str(value)
        m = re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[^\s:\[\]]+)(?::([0-9]+))?", text) if text.isascii() else None
        if m is None or not text.isprintable():
            self.fail(f"{value!r} is not HOST:PORT (a host name or address, then a port)", param, ctx)
        if m.group(2) is not None and not 1 <= int(m.group(2)) <= 65535:
            self.fail(f"{value!r}: port {int(m.group(2))} is not from 1 to 65535", param, ctx)
        return text


def _show_capture_log(ctx: click.Context, param: click.Parameter, verbose: bool) -> None:
    """``--verbose``: what torch logs while a model is captured (held back otherwise: a failed
    capture is one message, core/model/capture.py) is written to stderr."""
    if verbose:
        import logging

        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        log = logging.getLogger("partita")
        log.addHandler(handler)
        log.setLevel(logging.DEBUG)
        ctx.call_on_close(lambda: (log.removeHandler(handler), log.setLevel(logging.NOTSET)))


verbose_flag = click.option("-v", "--verbose", is_flag=True, expose_value=False, callback=_show_capture_log,
                            help="also show what torch logs while the model is captured")
