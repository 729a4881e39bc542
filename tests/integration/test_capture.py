"""Capture: what starts processes (gloo
ranks, launchers, the console script, a browser); tests/unit/test_capture.py has the one-process checks."""

from __future__ import annotations

import subprocess
import sys

from examples.models import MLP, gpt_tiny
from tests.unit.test_capture import _FINGERPRINT, ROOT, _fingerprint


def test_fingerprint_is_stable_and_tells_graphs_apart() -> None:
    first = _fingerprint(gpt_tiny, "idx=int64[2,16]")
    assert first == _fingerprint(gpt_tiny, "idx=int64[2,16]")
    other_process = subprocess.run(
        [sys.executable, "-c", _FINGERPRINT], capture_output=True, text=True, check=True,
        env={"PYTHONHASHSEED": "12345", "PATH": "", "PYTHONPATH": str(ROOT)},
    ).stdout.split()[-1]
    assert other_process == first
    assert _fingerprint(gpt_tiny, "idx=int64[2,8]") != first  # another shape
    assert _fingerprint(lambda: MLP(layers=2), "x=float32[4,64]") != _fingerprint(
        lambda: MLP(hidden=128, layers=2), "x=float32[4,64]")  # another width
