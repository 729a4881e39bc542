"""Start a training script on every rank of a plan with torchrun's elastic agent (``partita run``).

One node (``standalone``) or many: each node's ``partita run`` starts its
``nproc_per_node`` workers and joins a c10d rendezvous at ``rdzv_endpoint``,
as ``torchrun --nnodes N --rdzv-backend c10d --rdzv-endpoint HOST:PORT`` does;
under SLURM the node count, this node's rank and the endpoint come from
SLURM's variables (``slurm_layout``). The agent is torch's, told about the
other nodes (runtime/processes/agent.py); ``--nnodes MIN:MAX`` makes the run elastic.

Failures end in one message, not one traceback per rank: a rank that stops
on a user error (``PartitaError``) writes its message to the run's error
folder instead of printing it (runtime/distributed.py installs the hook, which
puts any other traceback there too), and the launcher prints each distinct
message once and exits 2; a hung run (runtime/processes/watchdog.py) has already printed
its report and exits 3; a lost node is one line naming it and its ranks (exit
4); any other failure is the first failing rank's traceback and one line
naming it and its exit code (runtime/processes/agent.py ``failure_report``). SIGTERM and SIGINT stop every
rank of the node and end with one line and 143 or 130. The workers die with
their launcher, a SIGKILL of it included (runtime/processes/watchdog.py
``die_with_launcher``): no rank trains on as an orphan. Each worker gets this node's cores
shared out as ``OMP_NUM_THREADS`` unless the user set it (``omp_threads``).
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import uuid
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from partita.runtime.processes.watchdog import LAUNCHER_ENV
from partita.runtime.state.lock import RUN_ENV

ERROR_DIR_ENV = "PARTITA_ERROR_DIR"


def torchrun_args(nproc_per_node: int, argv: list[str], *, max_restarts: int = 0, nnodes: int | str = 1,
                  rdzv_endpoint: str | None = None, run_id: str | None = None, node_rank: int | None = None,
                  rejoin_s: float | None = None) -> list[str]:
    """torchrun's arguments for ``nproc_per_node`` workers per node running ``argv`` (script + args):
    a c10d rendezvous at ``rdzv_endpoint``, or on a free local port for one node without one (what
    torchrun's ``--standalone`` sets up). ``nnodes``: N, or "MIN:MAX" for an elastic run, whose
    rendezvous waits ``rejoin_s`` for more nodes once MIN have joined."""
    if nproc_per_node < 1:
        raise ValueError(f"nproc_per_node={nproc_per_node} must be at least 1")
    where = ["--nnodes", str(nnodes), "--rdzv-backend", "c10d",
             "--rdzv-endpoint", str(rdzv_endpoint or "localhost:0"), "--rdzv-id", run_id or uuid.uuid4().hex[:8]]
    conf = []
    if node_rank is not None and str(nnodes) != "1":  # node 0 hosts the rendezvous store (others connect to it)
        conf.append(f"is_host={'true' if node_rank == 0 else 'false'}")
    if rejoin_s is not None:  # and a lost node is dropped from the rendezvous after 3 missed 2 s heartbeats
        conf += [f"last_call_timeout={int(rejoin_s)}", "keep_alive_interval=2", "keep_alive_max_attempt=3"]
    if conf:
        where += ["--rdzv-conf", ",".join(conf)]
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
           nnodes: int | str = 1, rdzv_endpoint: str | None = None, run_id: str | None = None,
           node_rank: int | None = None, rejoin_s: float | None = None, checkpoint_dir: str | None = None) -> int:
    """Run ``argv`` on ``nproc_per_node`` workers of this node under torchrun's elastic agent;
    the exit code: 0, 2 (a user error, printed once), 3 (a hang, reported), 4 (a node lost),
    128 + the signal that stopped it, or the failing rank's. The workers inherit this process's
    environment with ``env`` added, which is restored after (as are the signal handlers): a
    caller that launches in-process (the CLI's `main` from Python) keeps its own.
    ``checkpoint_dir``: where an elastic run's checkpoints go (a node joins at the next one)."""
    saved = dict(os.environ)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for sig in handlers:
            signal.signal(sig, _stop)
        return _launch(nproc_per_node, argv, env=env, max_restarts=max_restarts, nnodes=nnodes,
                       rdzv_endpoint=rdzv_endpoint, run_id=run_id, node_rank=node_rank, rejoin_s=rejoin_s,
                       checkpoint_dir=checkpoint_dir)
    except KeyboardInterrupt:  # a SIGINT while Python's own handler was in place
        return _stopped(signal.SIGINT)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        os.environ.clear()
        os.environ.update(saved)


def omp_threads(environ: MutableMapping[str, str], nproc_per_node: int, cpu_count: int | None = None) -> str | None:
    """Unless ``environ`` sets OMP_NUM_THREADS, set it to this node's cores per worker (each rank's
    ops would otherwise start a thread per core: on CPU a step ran about 10x slower so) and return
    the one line that says so; None when the user's setting stands."""
    if environ.get("OMP_NUM_THREADS"):
        return None
    threads = max(1, (cpu_count if cpu_count is not None else os.cpu_count() or 1) // nproc_per_node)
    environ["OMP_NUM_THREADS"] = str(threads)
    return (f"partita: OMP_NUM_THREADS={threads} for each of {nproc_per_node} rank(s) on this node (its cores "
            "per rank); set OMP_NUM_THREADS to override")


def _stop(signum: int, frame: Any) -> None:
    from torch.distributed.elastic.multiprocessing.api import SignalException

    raise SignalException(f"partita run got {signal.Signals(signum).name}", sigval=signal.Signals(signum))


def _stopped(sig: signal.Signals) -> int:
    print(f"partita: stopped by {sig.name}; every rank on this node was stopped", file=sys.stderr, flush=True)
    return 128 + int(sig)


def _launch(nproc_per_node: int, argv: list[str], *, env: Mapping[str, str] | None, max_restarts: int,
            nnodes: int | str, rdzv_endpoint: str | None, run_id: str | None, node_rank: int | None,
            rejoin_s: float | None, checkpoint_dir: str | None) -> int:
    os.environ.update(env or {})
    os.environ[LAUNCHER_ENV] = str(os.getpid())
    # one run across its nodes and restarts (a checkpoint directory is one run's: runtime/state/lock.py)
    os.environ[RUN_ENV] = f"{run_id or 'partita'}@{rdzv_endpoint}" if str(nnodes) != "1" else uuid.uuid4().hex
    threads = omp_threads(os.environ, nproc_per_node)
    if threads is not None:
        print(threads, file=sys.stderr, flush=True)
    # c10d's C++ warnings (a peer's store gone: a stack trace per call) would bury the one line
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    if max_restarts > 0 or str(nnodes) != "1":
        # torch's workers otherwise share the rendezvous TCPStore with the agent, and after a
        # restart gloo (and NCCL) read the previous attempt's addresses from it and fail to
        # connect (pytorch/pytorch#135712; seen here with torch 2.13 and gloo).
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import config_from_args, parse_args

    for name in list(logging.Logger.manager.loggerDict):  # the agent's per-rank failure logs:
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher", "torch.distributed.run")):
            logging.getLogger(name).setLevel(logging.CRITICAL)  # the summary below says it once
    args = torchrun_args(nproc_per_node, argv, max_restarts=max_restarts, nnodes=nnodes,
                         rdzv_endpoint=rdzv_endpoint, run_id=run_id or "partita", node_rank=node_rank,
                         rejoin_s=rejoin_s)
    with tempfile.TemporaryDirectory(prefix="partita-errors-") as errors:
        os.environ[ERROR_DIR_ENV] = errors
        config, cmd, cmd_args = config_from_args(parse_args(args))
        try:
            return _run_agent(config, cmd, cmd_args, node_rank=node_rank, errors=Path(errors),
                              checkpoint_dir=checkpoint_dir)
        except SignalException as e:
            return _stopped(e.sigval)
        except RendezvousError as e:
            print(f"partita: the rendezvous at {rdzv_endpoint} failed: {type(e).__name__}: {e}", file=sys.stderr,
                  flush=True)
            return 1


def _run_agent(config: Any, entrypoint: str, args: list[str], *, node_rank: int | None, errors: Path,
               checkpoint_dir: str | None) -> int:
    """torch's ``launch_agent``, with partita's agent (runtime/processes/agent.py); the exit code."""
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.rendezvous import RendezvousParameters, registry

    from partita.runtime.processes.agent import Agent, JoinAtCheckpoint, failure_report

    c = config
    params = RendezvousParameters(backend=c.rdzv_backend, endpoint=c.rdzv_endpoint, run_id=c.run_id,
                                  min_nodes=c.min_nodes, max_nodes=c.max_nodes, local_addr=c.local_addr,
                                  **c.rdzv_configs)
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = c.signals_to_handle
    handler = registry.get_rendezvous_handler(params)
    if c.min_nodes < c.max_nodes:
        handler = JoinAtCheckpoint(handler, checkpoint_dir)
    spec = WorkerSpec(role=c.role, local_world_size=c.nproc_per_node, entrypoint=entrypoint, args=tuple(args),
                      rdzv_handler=handler, max_restarts=c.max_restarts, monitor_interval=c.monitor_interval,
                      local_addr=c.local_addr)
    agent = Agent(spec=spec, logs_specs=c.logs_specs, start_method=c.start_method,
                  log_line_prefix_template=c.log_line_prefix_template, node_rank=node_rank, errors=errors)
    shutdown = True
    try:
        result = agent.run()
        if result is None or not result.is_failed():
            return 0
        lines, code = failure_report(result.failures, errors, agent.lost_nodes())  # runtime/processes/agent.py
        for line in lines:
            print(line, file=sys.stderr, flush=True)
        return code
    except SignalException:
        shutdown = False  # as torch's launcher: the rendezvous stays open for the other nodes
        raise
    finally:
        if shutdown:
            handler.shutdown()


def run_torchrun(nproc: int, argv: list[str], env: dict[str, str] | None = None, *, max_restarts: int = 0) -> int:
    """Run ``argv`` under torchrun on ``nproc`` local processes; return its exit code (``launch``)."""
    return launch(nproc, argv, env=env, max_restarts=max_restarts)
