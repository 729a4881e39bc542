"""The device mesh and its rank layout: the one home of "which rank is where".

Owns the mesh axes (``MeshAxis``, ``MESH_ORDER``), a rank's coordinates, the
ranks of a group along an axis or of a pipeline stage, the expert groups carved
out of the data-parallel group (``ep``), and whether a set of
ranks spans more than one node. The planner prices links with these rules
(``core/cluster.py`` ``ClusterSpec.link_for_ranks``, the pipeline's stage
links), the plan records stage ranks with them and the runtime forms its
groups with them, so a collective is priced on the link it will run on.

Ranks are numbered node by node (rank r is on node ``r // gpus_per_node``),
as torchrun numbers them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum


class MeshAxis(str, Enum):
    """Names of the device-mesh axes, outermost first in ``MESH_ORDER``."""

    PP = "pp"
    DP = "dp"
    TP = "tp"
    EP = "ep"  # expert parallelism: within "dp" (``Mesh.ep``), not an axis of the rank layout
    EDP = "edp"  # the expert layers' data parallelism: the dp ranks holding the same experts
    CP = "cp"  # context parallelism: within "dp" (``Mesh.cp``), each sequence split over cp consecutive dp ranks


# Megatron's placement: TP innermost (consecutive ranks share a node's NVLink),
# DP next, PP outermost (stages across nodes).
MESH_ORDER: tuple[MeshAxis, ...] = (MeshAxis.PP, MeshAxis.DP, MeshAxis.TP)


@dataclass(frozen=True)
class Mesh:
    """The device mesh: ``pp`` x ``dp`` x ``tp`` ranks (``MESH_ORDER``). ``ep`` splits each dp group
    into expert groups of ``ep`` consecutive dp ranks: an MoE layer's experts are sharded over an
    expert group (each rank holds ``experts / ep`` of them, core/experts.py), its tokens dispatched
    to them by all-to-all; the dp ranks holding the same experts (``dp / ep`` of them, ``ep`` apart)
    average those experts' gradients. Every other parameter stays replicated over all of "dp".

    ``cp`` (context parallelism) is carved out of "dp" the same way: ``cp`` consecutive dp ranks hold
    the same samples, each a slice of every sequence (``sequence_chunks``), and pass keys and values
    around each attention core (runtime/cp/). They hold the same parameters, so gradients are
    averaged over all of "dp" (dp x cp in Megatron's words) unchanged; the global batch is split
    over ``samples = dp / cp`` groups."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        for axis in (MeshAxis.PP, MeshAxis.DP, MeshAxis.TP, MeshAxis.EP, MeshAxis.CP):
            size = getattr(self, axis.value)
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"mesh axis {axis.value}={size!r} must be a positive integer")
        if self.dp % self.ep:
            raise ValueError(f"ep={self.ep} must divide dp={self.dp}: expert groups are carved out of the dp group")
        if self.dp % self.cp:
            raise ValueError(f"cp={self.cp} must divide dp={self.dp}: context-parallel groups are carved out of the "
                             "dp group")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def edp(self) -> int:
        """The dp ranks holding the same experts (the expert layers' data-parallel degree)."""
        return self.dp // self.ep

    @property
    def shape(self) -> tuple[int, ...]:
        """Axis sizes in ``MESH_ORDER``."""
        return tuple(getattr(self, a.value) for a in MESH_ORDER)

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(a.value for a in MESH_ORDER)

    @property
    def samples(self) -> int:
        """The groups the global batch is split over: dp ranks, less the ones that share samples (cp)."""
        return self.dp // self.cp

    def __str__(self) -> str:
        return (f"dp={self.dp} x tp={self.tp} x pp={self.pp}" + (f" (ep={self.ep})" if self.ep > 1 else "")
                + (f" (cp={self.cp})" if self.cp > 1 else ""))

    def rank(self, *, pp: int, dp: int, tp: int) -> int:
        """The global rank at these coordinates (``MESH_ORDER``: pp outermost, tp innermost)."""
        return (pp * self.dp + dp) * self.tp + tp

    def coords(self, rank: int) -> dict[str, int]:
        """``rank``'s coordinate on each axis, by axis name (the inverse of ``rank``)."""
        pp, rest = divmod(rank, self.dp * self.tp)
        dp, tp = divmod(rest, self.tp)
        return {MeshAxis.PP.value: pp, MeshAxis.DP.value: dp, MeshAxis.TP.value: tp}

    def group_ranks(self, rank: int, axis: str) -> tuple[int, ...]:
        """The ranks of ``rank``'s group along mesh axis ``axis`` (the others' coordinates fixed);
        "ep": its expert group (``ep`` consecutive dp ranks), "edp": the dp ranks holding its experts."""
        at = self.coords(rank)
        if axis in (MeshAxis.EP.value, MeshAxis.CP.value):
            size = getattr(self, axis)
            first = at[MeshAxis.DP.value] // size * size
            return tuple(self.rank(**{**at, MeshAxis.DP.value: first + i}) for i in range(size))
        if axis == MeshAxis.EDP.value:
            own = at[MeshAxis.DP.value] % self.ep
            return tuple(self.rank(**{**at, MeshAxis.DP.value: d}) for d in range(own, self.dp, self.ep))
        return tuple(self.rank(**{**at, axis: i}) for i in range(getattr(self, axis)))

    def ep_rank(self, rank: int) -> int:
        """``rank``'s place in its expert group: it holds experts ``[ep_rank * E/ep, (ep_rank + 1) * E/ep)``."""
        return self.coords(rank)[MeshAxis.DP.value] % self.ep

    def cp_rank(self, rank: int) -> int:
        """``rank``'s place in its context-parallel group: which slices of each sequence it holds."""
        return self.coords(rank)[MeshAxis.DP.value] % self.cp

    def sample_group(self, rank: int) -> int:
        """Which of the ``samples`` groups ``rank`` is in: its rows of each global batch."""
        return self.coords(rank)[MeshAxis.DP.value] // self.cp

    def groups(self, axis: str) -> tuple[tuple[int, ...], ...]:
        """Every group along mesh axis ``axis``, each once, in the order of its first rank."""
        seen: dict[tuple[int, ...], None] = {}
        for r in range(self.world_size):
            seen.setdefault(self.group_ranks(r, axis), None)
        return tuple(seen)

    def stage_ranks(self, stage: int) -> tuple[int, ...]:
        """The ranks of pipeline stage ``stage``, in rank order (pp is the outermost axis)."""
        width = self.dp * self.tp
        return tuple(range(stage * width, (stage + 1) * width))

    def stage_of(self, rank: int) -> int:
        """The pipeline stage ``rank`` belongs to."""
        return self.coords(rank)[MeshAxis.PP.value]


def held_experts(total: int, ep: int, index: int) -> range:
    """The experts, of a layer's ``total``, that the ``index``-th rank of an expert group of ``ep``
    holds: consecutive, ``total / ep`` of them (``Mesh.ep_rank`` gives the index)."""
    per = total // ep
    return range(index * per, (index + 1) * per)


def node_of(rank: int, gpus_per_node: int) -> int:
    """The node holding ``rank`` (ranks are numbered node by node)."""
    return rank // gpus_per_node


def crosses_nodes(ranks: Iterable[int], gpus_per_node: int) -> bool:
    """Whether ``ranks`` lie on more than one node."""
    return len({node_of(r, gpus_per_node) for r in ranks}) > 1


def axis_crosses_nodes(mesh: Mesh, axis: str, gpus_per_node: int) -> bool:
    """Whether any group along ``axis`` spans nodes (the axis's collectives then run at the
    slowest group's pace: the inter-node link)."""
    return any(crosses_nodes(g, gpus_per_node) for g in mesh.groups(axis))


def stage_pair_crosses_nodes(mesh: Mesh, stage: int, gpus_per_node: int) -> bool:
    """Whether any rank of pipeline stage ``stage`` sends to its peer on stage ``stage + 1``
    (same dp and tp coordinates) across nodes."""
    width = mesh.dp * mesh.tp
    return any(crosses_nodes((r, r + width), gpus_per_node) for r in mesh.stage_ranks(stage))


def sequence_chunks(cp: int, cp_rank: int) -> tuple[int, int]:
    """The two of ``2 cp`` equal chunks of every sequence that context-parallel rank ``cp_rank`` holds:
    chunk ``cp_rank`` and its mirror ``2 cp - 1 - cp_rank`` (Megatron-LM's causal load balance: under
    a causal mask a rank holding an early chunk also holds a late one, so every rank attends over
    the same number of key/value pairs). The one rule of which tokens a cp rank holds, read by the
    data share (runtime/batches.py) and the positions and masks of attention (runtime/cp/)."""
    return cp_rank, 2 * cp - 1 - cp_rank


def sequence_positions(seq_len: int, cp: int, cp_rank: int) -> list[int]:
    """The positions (of ``seq_len``) rank ``cp_rank`` of ``cp`` holds, in the order it holds them."""
    if cp == 1:
        return list(range(seq_len))
    size = seq_len // (2 * cp)
    return [i for c in sequence_chunks(cp, cp_rank) for i in range(c * size, (c + 1) * size)]
