"""`partita run` (its flags in compiler/cli.py): check the plan, the script and the nodes, then
start the ranks (runtime/processes/launch.py).

The run options (``Options``' RUN fields: `--checkpoint-dir`, `--watchdog`, ...) are checked here
as the decorator checks them and reach every rank as ``PARTITA_*`` environment variables; the
plan as ``PARTITA_PLAN``. ``--nnodes MIN:MAX`` makes the run elastic: its workers plan again when
their number is not the plan's (compiler/elastic.py).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from partita.core.errors import PartitaError
from partita.core.options import RUN, Options, option_fields


class NodeCount(click.ParamType):
    """``--nnodes``: N, or MIN:MAX for an elastic run; as (MIN, MAX)."""

    name = "N|MIN:MAX"

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        if isinstance(value, tuple):
            return value
        parts = str(value).strip().split(":")
        if len(parts) > 2 or not all(p.isascii() and p.isdigit() and int(p) >= 1 for p in parts):
            self.fail(f"{value!r} is not a number of nodes (N) or a range of them (MIN:MAX), each at least 1",
                      param, ctx)
        least, most = int(parts[0]), int(parts[-1])
        if least > most:
            self.fail(f"{value!r}: MIN is more than MAX", param, ctx)
        return least, most


def _nodes(counts: tuple[int, int] | None) -> str:
    return "" if counts is None else str(counts[0]) if counts[0] == counts[1] else f"{counts[0]}:{counts[1]}"


def local_port(checkpoint_dir: str, low: int = 20000, span: int = 10000) -> int:
    """The port an elastic run on one host meets at: the same for every launcher given this checkpoint
    directory (one run's: runtime/state/lock.py), in [low, low + span)."""
    import hashlib

    digest = hashlib.sha256(str(Path(checkpoint_dir).resolve()).encode()).digest()
    return low + int.from_bytes(digest[:4], "big") % span


REJOIN_WAIT_S = 30.0  # --rejoin-wait's default: how long an elastic restart waits for a lost node


def start(plan_path: str, script: str, args: tuple[str, ...], run_options: Callable[[], Options], *,
          max_restarts: int, nnodes: tuple[int, int] | None, rejoin_wait: float | None, node_rank: int | None,
          rdzv_endpoint: str | None, standalone: bool) -> int:
    """`partita run`'s checks, then ``launch`` (runtime/processes/launch.py); its exit code. ``run_options``
    reads the run flags into ``Options`` (after the plan's and the nodes' checks)."""
    import os

    # c10d's C++ warnings (a store whose host is gone: a stack trace per call) would bury the one line
    # partita says; read when torch loads, so set before the imports below load it
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    from partita.compiler.elastic import ELASTIC_ENV
    from partita.core.plans.verify import load_plan
    from partita.runtime.compose import refuse_unsupported
    from partita.runtime.processes.launch import launch, slurm_layout

    plan = load_plan(plan_path)
    refuse_unsupported(plan)  # once, here, before any process starts
    if not Path(script).is_file():
        raise PartitaError(f"script {script} does not exist",
                           hint="pass the training script that calls partita.parallelize(...), then its arguments")
    slurm = slurm_layout()
    planned_nodes = int(plan.cluster.get("nodes", 1)) if plan.cluster.get("device") != "cpu" else 1
    least, nodes = nnodes or ((slurm.nnodes,) * 2 if slurm else (1, 1))  # MIN:MAX, or N as N:N
    if standalone and nnodes not in (None, (1, 1)):
        raise PartitaError(f"--standalone starts every rank on this host, but --nnodes {_nodes(nnodes)} spreads "
                           f"them over {nodes} nodes", hint="drop one of --standalone and --nnodes")
    if standalone:
        nodes = 1
    elif nnodes is None and slurm is None and planned_nodes > 1:
        raise PartitaError(
            f"this plan is for {planned_nodes} nodes of {plan.world_size // planned_nodes} devices; starting all "
            f"{plan.world_size} processes on this host is not what it was planned for",
            hint=f"run `partita run --nnodes {planned_nodes} --node-rank R --rdzv-endpoint HOST:PORT {plan_path} "
            f"{script}` on every node (under SLURM they are filled in), or pass --standalone to start them all here")
    if standalone:
        least = nodes
    # a fixed run shares the plan's ranks out over its nodes; an elastic one keeps the plan's processes
    # per node whatever the number of nodes (its workers plan again for the world there is)
    per_node = min(int(plan.cluster.get("gpus_per_node", plan.world_size)), plan.world_size) \
        if least < nodes else plan.world_size // nodes
    if plan.world_size % (per_node if least < nodes else nodes):
        raise PartitaError(f"--nnodes {_nodes(nnodes)}: {nodes} nodes do not divide the plan's {plan.world_size} "
                           "ranks" if least == nodes else f"the plan's {plan.world_size} ranks are not whole nodes "
                           f"of {per_node}", hint="pass a number of nodes that divides the plan's ranks, or "
                           "recompile for these nodes")
    # the run options reach every rank through the environment, checked here as the decorator checks them
    options = run_options()
    if least < nodes and (options.checkpoint_dir is None or not max_restarts):
        raise PartitaError(f"--nnodes {least}:{nodes} runs elastically: after a node is lost its survivors restart "
                           "and resume from the newest checkpoint", hint="pass --checkpoint-dir D --checkpoint-every "
                           "N and --max-restarts R (at least 1) too, or a fixed --nnodes")
    endpoint = rdzv_endpoint or (slurm.rdzv_endpoint if slurm and nodes > 1 else None)
    local = least < nodes and endpoint is None and node_rank is None and options.checkpoint_dir is not None
    if local:  # an elastic run on this host: its nodes meet at a port of this host that its directory names
        endpoint = f"localhost:{local_port(options.checkpoint_dir)}"
        wait = REJOIN_WAIT_S if rejoin_wait is None else rejoin_wait
        print(f"partita: --nnodes {least}:{nodes} on this host: its nodes meet at {endpoint}, waiting {wait:g} s "
              "for more nodes before it starts (--rejoin-wait); start the same command again for each node here, "
              "or pass --rdzv-endpoint HOST:PORT and --node-rank R on every node to span hosts",
              file=sys.stderr, flush=True)
    if nodes > 1 and endpoint is None:
        raise PartitaError(f"{nodes} nodes need a rendezvous every node can reach",
                           hint="pass --rdzv-endpoint HOST:PORT (the same on every node)")
    if rejoin_wait is not None and least == nodes:  # it would be ignored
        raise PartitaError("--rejoin-wait has no use without --nnodes MIN:MAX: it is how long an elastic run's "
                           "restart waits for a lost node",
                           hint="pass --nnodes MIN:MAX (an elastic run) too, or leave --rejoin-wait out")
    env = dict(os.environ, PARTITA_PLAN=str(Path(plan_path).resolve()))
    if least < nodes:
        env[ELASTIC_ENV] = "1"  # the workers plan again when the world size is not the plan's
    for fld in option_fields(RUN, command="run"):
        value = getattr(options, fld.name)
        if value is not None:
            env[fld.metadata["env"]] = str(Path(value).resolve()) if fld.metadata["path"] else f"{value:g}" \
                if isinstance(value, float) else str(value)
    rank = node_rank if node_rank is not None else (slurm.node_rank if slurm else None)
    if nodes > 1 and rank is None and not local:
        raise PartitaError(f"{nodes} nodes: which one is this?", hint="pass --node-rank R (0 on the node that "
                           "hosts the rendezvous, 1 to N-1 on the others)")
    if rank is not None and rank >= nodes:
        raise PartitaError(f"--node-rank {rank} is not below --nnodes {nodes}",
                           hint="node ranks run from 0 to --nnodes minus 1")
    return launch(per_node, [script, *args], env=env, max_restarts=max_restarts,
                  nnodes=f"{least}:{nodes}" if least < nodes else nodes,
                  rejoin_s=(REJOIN_WAIT_S if rejoin_wait is None else rejoin_wait) if least < nodes else None,
                  checkpoint_dir=options.checkpoint_dir,
                  rdzv_endpoint=endpoint, run_id=slurm.run_id if slurm else None, node_rank=rank)
