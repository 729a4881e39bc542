"""Start a training script on N local processes with torchrun (``partita run``)."""

from __future__ import annotations

import os
import subprocess
import sys


def torchrun_command(nproc: int, argv: list[str], *, max_restarts: int = 0) -> list[str]:
    """The torchrun command line for ``nproc`` local processes running ``argv`` (script + args);
    ``max_restarts``: torchrun restarts every worker this often after one fails."""
    if nproc < 1:
        raise ValueError(f"nproc={nproc} must be at least 1")
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts), *argv]


def run_torchrun(nproc: int, argv: list[str], env: dict[str, str] | None = None, *, max_restarts: int = 0) -> int:
    """Run ``argv`` under torchrun on ``nproc`` processes; return torchrun's exit code.

    ``env`` entries are added to this process's environment (not replacing it),
    so the script still finds the venv, PATH and so on.
    """
    full_env = {**os.environ, **(env or {})}
    if max_restarts > 0:
        # torch's workers otherwise share the rendezvous TCPStore with the agent, and after a
        # restart gloo (and NCCL) read the previous attempt's addresses from it and fail to
        # connect (pytorch/pytorch#135712; seen here with torch 2.13 and gloo).
        full_env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    return subprocess.run(torchrun_command(nproc, argv, max_restarts=max_restarts), env=full_env).returncode
