"""Start a training script on every rank of a plan with torchrun's elastic agent (``partita run``).

One node (``standalone``) or many: each node's ``partita run`` starts its
``nproc_per_node`` workers and joins a c10d rendezvous at ``rdzv_endpoint``,
as ``torchrun --nnodes N --rdzv-backend c10d --rdzv-endpoint HOST:PORT`` does;
under SLURM the node count, this node's rank and the endpoint come from
SLURM's variables (``slurm_layout``).

Failures end in one message, not one traceback per rank: a rank that stops
on a user error (``PartitaError``) writes its message to the run's error
folder instead of printing it (runtime/distributed.py installs the hook), and
the launcher prints each distinct message once and exits 2; a hung run
(runtime/watchdog.py) has already printed its report and exits 3; any other
failure is one line naming the rank and its exit code (its output is above).
"""

from __future__ import annotations

import os
import sys
import tempfile
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

ERROR_DIR_ENV = "PARTITA_ERROR_DIR"


def torchrun_args(nproc_per_node: int, argv: list[str], *, max_restarts: int = 0, nnodes: int = 1,
                  rdzv_endpoint: str | None = None, run_id: str | None = None, node_rank: int | None = None
                  ) -> list[str]:
    """torchrun's arguments for ``nproc_per_node`` workers per node running ``argv`` (script + args):
    a c10d rendezvous at ``rdzv_endpoint``, or on a free local port for one node without one (what
    torchrun's ``--standalone`` sets up)."""
    if nproc_per_node < 1:
        raise ValueError(f"nproc_per_node={nproc_per_node} must be at least 1")
    where = ["--nnodes", str(nnodes), "--rdzv-backend", "c10d",
             "--rdzv-endpoint", str(rdzv_endpoint or "localhost:0"), "--rdzv-id", run_id or uuid.uuid4().hex[:8]]
    if node_rank is not None and nnodes > 1:  # node 0 hosts the rendezvous store (others connect to it)
        where += ["--rdzv-conf", f"is_host={'true' if node_rank == 0 else 'false'}"]
    return [*where, "--nproc-per-node", str(nproc_per_node), "--max-restarts", str(max_restarts), *argv]


@dataclass(frozen=True)
class SlurmLayout:
    nnodes: int
    node_rank: int
    rdzv_endpoint: str
    run_id: str


def slurm_layout(environ: Mapping[str, str] = os.environ, port: int = 29500) -> SlurmLayout | None:
    """The node count, this node's rank and a rendezvous endpoint (the job's first node) from SLURM's
    variables, or None outside a SLURM job step."""
    if "SLURM_JOB_ID" not in environ or "SLURM_NNODES" not in environ:
        return None
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST") or ""
    first = _first_host(nodelist) or environ.get("SLURMD_NODENAME", "localhost")
    return SlurmLayout(int(environ["SLURM_NNODES"]), int(environ.get("SLURM_NODEID", "0")), f"{first}:{port}",
                       f"slurm-{environ['SLURM_JOB_ID']}")


def _first_host(nodelist: str) -> str | None:
    """The first host of a SLURM node list: ``gpu[003-010,012],cpu1`` -> ``gpu003``."""
    if not nodelist:
        return None
    head = nodelist.split(",")[0] if "[" not in nodelist.split(",")[0] else nodelist[: nodelist.index("]") + 1]
    if "[" not in head:
        return head
    prefix, ranges = head.split("[", 1)
    return prefix + ranges.rstrip("]").split(",")[0].split("-")[0]


def launch(nproc_per_node: int, argv: list[str], *, env: Mapping[str, str] | None = None, max_restarts: int = 0,
           nnodes: int = 1, rdzv_endpoint: str | None = None, run_id: str | None = None,
           node_rank: int | None = None) -> int:
    """Run ``argv`` on ``nproc_per_node`` workers of this node under torchrun's elastic agent;
    the exit code: 0, 2 (a user error, printed once), 3 (a hang, reported) or the failing rank's.
    The workers inherit this process's environment with ``env`` added, which is restored after: a
    caller that launches in-process (the CLI's `main` from Python) keeps its own."""
    saved = dict(os.environ)
    try:
        return _launch(nproc_per_node, argv, env=env, max_restarts=max_restarts, nnodes=nnodes,
                       rdzv_endpoint=rdzv_endpoint, run_id=run_id, node_rank=node_rank)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _launch(nproc_per_node: int, argv: list[str], *, env: Mapping[str, str] | None, max_restarts: int,
            nnodes: int, rdzv_endpoint: str | None, run_id: str | None, node_rank: int | None) -> int:
    os.environ.update(env or {})
    if max_restarts > 0:
        # torch's workers otherwise share the rendezvous TCPStore with the agent, and after a
        # restart gloo (and NCCL) read the previous attempt's addresses from it and fail to
        # connect (pytorch/pytorch#135712; seen here with torch 2.13 and gloo).
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    for name in list(logging.Logger.manager.loggerDict):  # the agent's per-rank failure logs:
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher", "torch.distributed.run")):
            logging.getLogger(name).setLevel(logging.CRITICAL)  # the summary below says it once
    args = torchrun_args(nproc_per_node, argv, max_restarts=max_restarts, nnodes=nnodes,
                         rdzv_endpoint=rdzv_endpoint, run_id=run_id or "partita", node_rank=node_rank)
    with tempfile.TemporaryDirectory(prefix="partita-errors-") as errors:
        os.environ[ERROR_DIR_ENV] = errors
        config, cmd, cmd_args = config_from_args(parse_args(args))
        try:
            elastic_launch(config, cmd)(*cmd_args)
            return 0
        except ChildFailedError as e:
            return _report(e, Path(errors))


def _report(e: object, errors: Path) -> int:
    from partita.runtime.watchdog import EXIT_HUNG

    messages = {}
    for f in sorted(errors.glob("rank*.txt")):
        messages.setdefault(f.read_text().strip(), []).append(int(f.stem[4:]))
    if messages:
        for text, ranks in messages.items():
            who = "every rank" if len(ranks) > 1 else f"rank {ranks[0]}"
            print(f"error ({who}): {text}", file=sys.stderr, flush=True)
        return 2
    codes = {rank: f.exitcode for rank, f in getattr(e, "failures", {}).items()}
    if EXIT_HUNG in codes.values():
        return EXIT_HUNG  # the watchdog's report is above
    rank, first = e.get_first_failure() if codes else (None, None)  # the root cause: the others were stopped
    code = first.exitcode if first is not None else 1
    print(f"the run failed: rank {rank} exited with code {code}; its output is above", file=sys.stderr, flush=True)
    return code if isinstance(code, int) and code > 0 else 1


def run_torchrun(nproc: int, argv: list[str], env: dict[str, str] | None = None, *, max_restarts: int = 0) -> int:
    """Run ``argv`` under torchrun on ``nproc`` local processes; return its exit code (``launch``)."""
    return launch(nproc, argv, env=env, max_restarts=max_restarts)
