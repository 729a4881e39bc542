"""The search space: which (dp, tp, pp, micro-batch) the planners enumerate, and the pins checked
once against the cluster.

Every planner enumerates from here (passes/search.py over tp, passes/tp/mesh.py
over (tp, micro-batch) at pp = 1, passes/pipeline/stages.py over (p, dp, micro-batch)
at a tp), so a pin means the same thing to all of them and is refused with one
message wherever it cannot hold:

- tp divides the GPUs per node (a TP group stays inside a node, on its fast links)
  and the world;
- dp x tp x pp = the world: a pinned dp (with pp known) fixes tp, a pinned pp
  divides the devices left by tp;
- micro-batch size x accumulation steps = the batch share of one dp rank.
"""

from __future__ import annotations

import math

from partita.core.cluster import ClusterSpec
from partita.core.errors import PartitaError
from partita.core.pins import Pins


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending, in O(sqrt n) steps (a batch of 10**14 is ~10**7
    steps, not 10**14)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def world_size(cluster: ClusterSpec, pins: Pins) -> int:
    """The devices a plan is made for: the launched processes (``pins.world_size``) or the cluster's."""
    if pins.world_size and pins.world_size > cluster.world_size:
        raise PartitaError(
            f"{pins.world_size} processes were launched but cluster {cluster.name!r} has "
            f"{cluster.world_size} devices ({cluster.nodes} node(s) x {cluster.gpus_per_node})",
            hint="pass a cluster with enough devices (e.g. --nodes)")
    return pins.world_size or cluster.world_size


def tp_degrees(cluster: ClusterSpec, world: int, pins: Pins, pp: int | None = 1) -> list[int]:
    """The TP degrees to weigh: divisors of the GPUs per node dividing the world, narrowed by the
    pins. With ``pp`` known (1 for the mesh search, the pinned one for pipelines) a pinned dp
    fixes tp = world / (dp pp)."""
    g = cluster.gpus_per_node
    if pins.tp is not None:
        if g % pins.tp:
            raise PartitaError(f"--tp {pins.tp} does not divide {g} GPUs per node: a TP group must stay inside a node",
                               hint=f"use one of {', '.join(map(str, divisors(g)))}")
        if world % pins.tp:
            raise PartitaError(f"--tp {pins.tp} does not divide the world size {world}",
                               hint="pin a --tp that divides the world size")
    if pins.dp is not None and pp is not None:
        if world % (pins.dp * pp):
            raise PartitaError(f"--dp {pins.dp}" + (f" x pp={pp}" if pp > 1 else "")
                               + f" does not divide the world size {world}",
                               hint="pin a --dp that divides the world size")
        tp = world // (pins.dp * pp)
        if pins.tp is not None and pins.tp != tp:
            raise PartitaError(f"--dp {pins.dp} x --tp {pins.tp}" + (f" x pp={pp}" if pp > 1 else "")
                               + f" = {pins.dp * pins.tp * pp} devices, but the world size is {world}",
                               hint="pin --dp and --tp whose product is the world size, or pin only one")
        if g % tp:
            raise PartitaError(f"--dp {pins.dp} leaves tp={tp}, which does not divide {g} GPUs per node",
                               hint="a TP group must stay inside a node")
        return [tp]
    if pins.tp is not None:
        return [pins.tp]
    return [d for d in divisors(g) if world % d == 0]


def micro_batches(share: int, pins: Pins) -> list[int]:
    """Micro-batch sizes that split one dp rank's ``share`` of the batch, narrowed by the pins."""
    mbs = [pins.micro_batch_size] if pins.micro_batch_size else divisors(share)
    if pins.grad_accum_steps:
        mbs = [m for m in mbs if m * pins.grad_accum_steps == share]
    return [m for m in mbs if share % m == 0]


def pipeline_groups(devices: int, tp: int, batch: int, pins: Pins) -> list[tuple[int, int, int, int]]:
    """(p, dp, micro-batch size, micro-batches) of every pipeline over ``devices`` at ``tp``, in
    enumeration order (p, then micro-batch size, ascending). A pinned schedule asks for p > 1."""
    if devices % tp:
        raise PartitaError(f"{tp} devices per stage do not divide {devices} devices",
                           hint="pin a --tp that divides the devices")
    if pins.pp and (devices // tp) % pins.pp:
        raise PartitaError(f"--pp {pins.pp} does not divide {devices // tp} devices ({devices} / {tp} per stage)",
                           hint="pin a --pp that divides the devices per tensor-parallel group")
    groups = []
    for p in [pins.pp] if pins.pp else divisors(devices // tp):
        dp = devices // (tp * p)
        cp = pins.cp or 1  # cp ranks share their samples: the batch is split over dp / cp groups (core/mesh.py)
        if ((pins.dp and pins.dp != dp) or dp % cp or batch % (dp // cp) or (pins.schedule is not None and p == 1)
                or dp % (pins.ep or 1)):
            continue
        share = batch // (dp // cp)
        groups += [(p, dp, mb, share // mb) for mb in micro_batches(share, pins)]
    return groups
