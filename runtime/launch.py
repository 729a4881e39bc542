"""Start a training script on N local processes with torchrun (``partita run``)."""

from __future__ import annotations

import os
import subprocess
import sys


def torchrun_command(nproc: int, argv: list[str]) -> list[str]:
    """The torchrun command line for ``nproc`` local processes running ``argv`` (script + args)."""
    if nproc < 1:
        raise ValueError(f"nproc={nproc} must be at least 1")
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc), *argv]


def run_torchrun(nproc: int, argv: list[str], env: dict[str, str] | None = None) -> int:
    """Run ``argv`` under torchrun on ``nproc`` processes; return torchrun's exit code.

    ``env`` entries are added to this process's environment (not replacing it),
    so the script still finds the venv, PATH and so on.
    """
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(torchrun_command(nproc, argv), env=full_env).returncode
