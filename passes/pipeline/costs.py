"""The pipeline solver's input: the order stages are runs of, where cuts may fall, and each
position's costs per micro-batch.

Reads a ``ModelProfile``'s annotated graph (``kind``, ``inputs``, ``out_bytes``,
``dtypes``, ``flops_fwd``, ``flops_bwd``, ``requires_grad``, ``saved_bytes``,
``param_name``, ``layer``, ``module``, ``depends_on_input``). Writes nothing.

The order (``pipeline_order``): the captured (topological) order with every
placeholder moved to just before its first user, so a stage owns the parameters
it uses and the last stage reads the targets itself.

The search space (``allowed_boundaries``): with repeated layers a cut may only
fall between two layers or between a layer and the code before or after them
(L + 1 places for L layers); otherwise after any call node. A cut at boundary k
sends every tensor live across it forward per micro-batch, and the gradients of
those that carry one back (``NodeCosts.send_bytes`` / ``grad_bytes``).

Recomputation (``recompute_costs``, core/recompute.py's modes): under ``full`` a layer keeps only
its inputs and runs its forward again in backward; under ``selective`` only each layer's attention
core does.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import networkx as nx
import numpy as np

from partita.core.cluster import ClusterSpec
from partita.core.model.graph import per_graph
from partita.core.pins import TrainingRequest
from partita.core.precision import activation_scale as precision_activation_scale
from partita.core.precision import is_floating
from partita.core.recompute import FULL, NONE, SELECTIVE
from partita.passes.cost_model import NODE_TIME_ATTRS, node_compute_time, precision_factor
from partita.passes.peak_memory import node_transient
from partita.passes.pipeline.ranges import max_table, prefix, range_max
from partita.passes.profile import ModelProfile

_PLACEHOLDERS = ("param", "buffer", "input")


# -- the order and the search space ---------------------------------------------


def pipeline_order(G: nx.DiGraph) -> list[str]:
    """The graph's nodes in captured order, each placeholder moved to just before its first user."""
    position = {n: i for i, n in enumerate(G.nodes)}

    def key(n: str) -> tuple[int, int]:
        if G.nodes[n]["kind"] in _PLACEHOLDERS:
            users = [position[u] for u in G.successors(n)]
            return (min(users), 0) if users else (position[n], 0)
        return (position[n], 1)

    order = sorted(G.nodes, key=key)
    at = {n: i for i, n in enumerate(order)}
    assert all(at[u] < at[v] for u, v in G.edges), "pipeline order must be topological"
    return order


def allowed_boundaries(G: nx.DiGraph, order: Sequence[str]) -> tuple[int, ...]:
    """Boundaries k (a cut between positions k - 1 and k) the solver may cut at (module docstring)."""
    n = len(order)
    spans: dict[str, list[int]] = {}
    for i, name in enumerate(order):
        layer = G.nodes[name].get("layer")
        if layer:
            spans.setdefault(layer, [i, i])[1] = i
    after_call = [k for k in range(1, n)
                  if G.nodes[order[k - 1]]["kind"] == "call" and G.nodes[order[k]]["kind"] != "output"]
    if not spans:
        return tuple(after_call)
    inside = set()
    for lo, hi in spans.values():
        inside.update(range(lo + 1, hi + 1))
    in_layer = lambda i: bool(G.nodes[order[i]].get("layer"))
    return tuple(k for k in after_call if k not in inside and (in_layer(k - 1) or in_layer(k)))


# graph -> {"both": (order, boundaries), "positions": _Positions, order: crossing spans} (graph.per_graph):
# a search asks for node costs at every (micro-batch, tp)
_STRUCTURE: weakref.WeakKeyDictionary[nx.DiGraph, tuple[int, dict]] = weakref.WeakKeyDictionary()


def _structure(G: nx.DiGraph) -> tuple[list[str], tuple[int, ...]]:
    """``pipeline_order`` and ``allowed_boundaries`` of ``G``, computed once per graph."""
    cache = per_graph(_STRUCTURE, G)
    if "both" not in cache:
        order = pipeline_order(G)
        cache["both"] = (order, allowed_boundaries(G, order))
    return cache["both"]


# The node attributes a position's own costs are priced by (``_price``): positions that agree on
# them (a repeated layer's nodes at one place in the layer) cost the same
_PRICED_ATTRS = (*NODE_TIME_ATTRS, "depends_on_input", "saved_bytes", "kv_bytes", "live_batch", "live_fixed",
                 "transient_bytes")


@dataclass(frozen=True)
class _Positions:
    """What ``node_costs`` reads of a graph that neither the micro-batch, tp nor the precision changes,
    per position of the pipeline order (``_positions``, once per graph)."""

    price_class: tuple[int, ...]  # per position: its index into ``samples``
    samples: tuple[dict, ...]  # per price class: its first position's attributes
    # per parameter name, in order: (whole numel, its users' positions, whether a cut can separate them)
    params: tuple[tuple[str, int, tuple[int, ...], bool], ...]
    outputs: dict[str, tuple[dict, bool]]  # node -> (its attributes, whether its outputs float), filled as asked
    modules: tuple[str, ...]
    layers: frozenset[str]
    cores: tuple[str, ...]
    core_reads: tuple[tuple[int, tuple[str, ...]], ...]  # per core: (first position, outside activations read)


def _positions(G: nx.DiGraph) -> _Positions:
    """``G``'s ``_Positions``, computed once per graph."""
    cache = per_graph(_STRUCTURE, G)
    if "positions" not in cache:
        order, boundaries = _structure(G)
        at = {n: i for i, n in enumerate(order)}
        nodes = [G.nodes[n] for n in order]
        classes: dict[tuple, int] = {}
        price_class = tuple(classes.setdefault(tuple(a.get(k) for k in _PRICED_ATTRS), len(classes)) for a in nodes)
        samples: dict[int, dict] = {}
        for a, c in zip(nodes, price_class):
            samples.setdefault(c, a)
        users: dict[str, list[int]] = {}
        whole: dict[str, int] = {}
        for name, a in zip(order, nodes):
            if a["kind"] == "param":
                pname = a.get("param_name", name)
                users.setdefault(pname, []).extend(sorted(at[u] for u in G.successors(name)) or [at[name]])
                whole[pname] = math.prod(a["shapes"][0]) if a["shapes"] else 0
        params = []
        for pname, used in users.items():
            used = sorted(set(used))
            i = bisect.bisect_right(boundaries, used[0])  # the first boundary after the first user
            params.append((pname, whole[pname], tuple(used), i < len(boundaries) and boundaries[i] <= used[-1]))
        cores = tuple(a.get("attention_core", "") for a in nodes)
        reads: dict[str, set[str]] = {}
        first: dict[str, int] = {}
        for i, (n, core) in enumerate(zip(order, cores)):
            if core:
                first.setdefault(core, i)
                reads.setdefault(core, set()).update(
                    u for u in G.predecessors(n) if G.nodes[u].get("attention_core") != core
                    and G.nodes[u]["kind"] not in ("param", "buffer"))
        cache["positions"] = _Positions(
            price_class, tuple(samples.values()), tuple(params), {},
            tuple(a.get("layer") or (a["module"] if a["kind"] == "param" else "") for a in nodes),
            frozenset(a["layer"] for _, a in G.nodes(data=True) if a.get("layer")),
            cores, tuple((i, tuple(reads[core])) for core, i in first.items()))
    return cache["positions"]


# -- the solver's input ----------------------------------------------------------


@dataclass(frozen=True)
class SharedParam:
    """A parameter whose users a cut can separate: every stage with a user holds a copy."""

    name: str
    numel: int  # on one device (after tensor-parallel sharding)
    users: tuple[int, ...]  # positions of its users, sorted


@dataclass(frozen=True)
class NodeCosts:
    """One micro-batch's costs per position of the pipeline order, on one device of a stage.

    The solver reads nothing else, so a tensor-parallel solve can hand in its own
    per-node costs at a TP degree. ``send_bytes[k]`` / ``grad_bytes[k]`` are the
    bytes crossing boundary k forward / backward (k = 0..N; 0 and N are empty).
    """

    order: tuple[str, ...]
    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    saved_bytes: tuple[int, ...]
    param_numel: tuple[int, ...]  # parameters used only at this position, local numel
    send_bytes: tuple[int, ...]
    grad_bytes: tuple[int, ...]
    boundaries: tuple[int, ...]
    shared: tuple[SharedParam, ...] = ()
    modules: tuple[str, ...] = ()  # per position: its layer ("transformer.h.3"), a parameter's module, or ""
    layers: frozenset[str] = frozenset()  # the repeated layers' names
    # inference: the activations alive while each position runs (activations.annotate_live_bytes); training:
    # what each position holds beyond the saved activations while it runs (peak_memory.node_transient)
    live_bytes: tuple[int, ...] = ()
    cores: tuple[str, ...] = ()  # per position: its attention core (core/recompute.py), or ""
    # per position: at a core's first position, the bytes of the activations its nodes read from
    # outside it (what the core keeps when it is recomputed); 0 elsewhere
    core_inputs: tuple[int, ...] = ()
    # per position, at ep > 1 (passes/experts.py): a rank's expert slices (out of ZeRO), its all-to-alls' seconds
    expert_numel: tuple[int, ...] = ()
    all_to_all_s: tuple[tuple[float, float], ...] = ()
    ep: int = 1
    context_s: tuple[tuple[float, float], ...] = ()  # per position, its core's cp exchanges (passes/context.py)
    cp_attention: str = ""  # ... by the strategy priced (core/axes/context.py CP_ATTENTION)

    @functools.cached_property
    def expert_sums(self) -> tuple[list[float], list[float], list[float]]:
        """Prefix sums of (expert elements, forward all-to-all seconds, backward ones) over the order."""
        n = len(self.order)
        return (prefix(self.expert_numel or [0] * n), prefix([f for f, _ in self.all_to_all_s] or [0.0] * n),
                prefix([b for _, b in self.all_to_all_s] or [0.0] * n))

    @functools.cached_property
    def _live_table(self) -> list[list[float]]:
        return max_table(self.live_bytes)

    def live_peak(self, j: int, k: int) -> int:
        """The largest ``live_bytes`` over positions [j, k): an inference stage's activations, a training
        stage's costliest transient."""
        return range_max(self._live_table, j, k) if self.live_bytes else 0

    @functools.cached_property
    def _backward_table(self) -> list[list[float]]:
        saved = self.prefix_sums[2]
        return max_table(np.add(saved[1:len(self.live_bytes) + 1], self.live_bytes))

    def backward_peak(self, j: int, k: int) -> int:
        """The most one micro-batch of positions [j, k) holds beyond its state: at each position, the
        activations saved up to it (backward has freed those of the positions after it; the forward has
        not made them yet) and its live bytes, the largest over [j, k)."""
        if not self.live_bytes or k <= j:
            return round(self.prefix_sums[2][k] - self.prefix_sums[2][j]) if k > j else 0
        return round(range_max(self._backward_table, j, k) - self.prefix_sums[2][j])

    @functools.cached_property
    def _label_runs(self) -> tuple[list[int], list[str]]:
        starts, labels = [], []
        for i, label in enumerate(self.modules):
            if not labels or label != labels[-1]:
                starts.append(i)
                labels.append(label)
        return starts, labels

    def module_runs(self, j: int, k: int) -> list[str]:
        """``modules[j:k]`` with consecutive repeats collapsed (a layer's label once per run of its
        nodes, not once per node)."""
        if k <= j:
            return []
        starts, labels = self._label_runs
        first = bisect.bisect_right(starts, j) - 1
        last = bisect.bisect_right(starts, k - 1)
        return labels[first:last]

    @functools.cached_property
    def prefix_sums(self) -> tuple[list[float], list[float], list[float], list[float]]:
        """Prefix sums of (forward + backward, forward, saved bytes, parameters) over the order."""
        return (prefix([f + b for f, b in zip(self.forward_s, self.backward_s)]), prefix(self.forward_s),
                prefix(self.saved_bytes), prefix(self.param_numel))

    def __post_init__(self) -> None:
        n = len(self.order)
        for name in ("forward_s", "backward_s", "saved_bytes", "param_numel"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"NodeCosts.{name} has {len(getattr(self, name))} entries for {n} positions")
        if len(self.send_bytes) != n + 1 or len(self.grad_bytes) != n + 1:
            raise ValueError(f"NodeCosts needs {n + 1} boundary byte counts")


@dataclass(frozen=True)
class Rerun:
    """A stage's costs under one recomputation mode (core/recompute.py)."""

    mode: str  # SELECTIVE or FULL
    costs: NodeCosts  # saved bytes: only what each rerun region reads; backward: + the region's forward
    transient_bytes: int  # the largest region's activations, rebuilt in its backward (``costs.live_bytes``)


@dataclass(frozen=True)
class Recompute:
    """The recomputation modes a stage may take (``recompute_costs``), in the order they are tried:
    the least time added first."""

    options: tuple[Rerun, ...]
    forced: bool = False  # pinned (``Pins.recompute``): every stage takes ``options[0]``


def recompute_costs(c: NodeCosts, *, pin: str | None = None) -> Recompute | None:
    """The modes weighed for ``c``: ``pin``'s alone, or (None) selective then full where the model has
    them; None when there is none (``pin`` none, no repeated layers)."""
    modes = {SELECTIVE: _selective, FULL: _full}
    chosen = [pin] if pin in modes else [] if pin == NONE else [SELECTIVE, FULL]
    options = tuple(r for r in (modes[m](c) for m in chosen) if r is not None)
    return Recompute(options, forced=pin is not None) if options else None


def _selective(c: NodeCosts) -> Rerun | None:
    """``c`` with every attention core checkpointed: a core keeps the activations it reads from outside
    (``core_inputs``, at its first position) and nothing else; its backward runs its forward again."""
    if not any(c.cores):
        return None
    bwd, saved = list(c.backward_s), list(c.saved_bytes)
    per_core: dict[str, int] = {}
    for i, core in enumerate(c.cores):
        if core:
            per_core[core] = per_core.get(core, 0) + saved[i]
            bwd[i] += c.forward_s[i]
            saved[i] = c.core_inputs[i]
    return _rerun(SELECTIVE, c, bwd, saved, c.cores, per_core)


def _full(c: NodeCosts) -> Rerun | None:
    """``c`` with every repeated layer checkpointed at its boundaries; None without layers.

    A layer keeps ``send_bytes`` at its first position (every tensor live across
    that boundary: its inputs, an upper bound when something is relayed past it)
    and nothing else; its backward runs its forward again first. The largest
    layer's saved bytes are held once more while that layer is recomputed."""
    if not c.layers:
        return None
    fwd, bwd, saved = list(c.forward_s), list(c.backward_s), list(c.saved_bytes)
    per_layer: dict[str, int] = {}
    regions = [""] * len(c.modules)  # per position: its layer, or ""
    current = ""  # the layer the previous position belonged to
    for i, label in enumerate(c.modules):
        # a layer's own nodes carry its name; its parameters (placed before their first user)
        # their module's, below it
        layer = label if label in c.layers else current if current and label.startswith(current + ".") else ""
        if not layer:
            current = ""
            continue
        regions[i] = layer
        per_layer[layer] = per_layer.get(layer, 0) + saved[i]
        bwd[i] += fwd[i]
        saved[i] = c.send_bytes[i] if layer != current else 0
        current = layer
    return _rerun(FULL, c, bwd, saved, regions, per_layer)


def _rerun(mode: str, c: NodeCosts, bwd: list[float], saved: list[int], regions: Sequence[str],
           rebuilt: dict[str, int]) -> Rerun:
    """``c`` rerun by regions (``regions``: each position's, or ""): each region's activations
    (``rebuilt``) are made again when its backward begins and held while it runs, so they count in
    the live bytes of its own positions, beside their transients, and nowhere else (not beside the
    loss's, whose backward runs before any region's rerun)."""
    live = c.live_bytes or (0,) * len(regions)
    live = tuple(b + rebuilt[r] if r else b for b, r in zip(live, regions))
    return Rerun(mode, replace(c, backward_s=tuple(bwd), saved_bytes=tuple(saved), live_bytes=live),
                 max(rebuilt.values()))


def activation_scale(profile: ModelProfile, request: TrainingRequest) -> float:
    """The precision's element size over the captured one: the profile measured saved and sent
    bytes at the capture's dtype, the plan holds floating tensors at the precision's."""
    return precision_activation_scale(request.precision, profile.param_dtype)


def kv_ratio(profile: ModelProfile, request: TrainingRequest) -> float:
    """An attention op's KV cache over the keys and values it reads at the captured sequence:
    prompt + new tokens over the captured tokens (0 unless generating; activations.annotate_kv_cache)."""
    return request.kv_tokens / profile.seq_len if request.inference and request.kv_tokens and profile.seq_len else 0.0


def node_costs(profile: ModelProfile, cluster: ClusterSpec, request: TrainingRequest, micro_batch: int,
               *, tp: int = 1) -> NodeCosts:
    """Per-node costs from the profile, scaled from the captured batch to ``micro_batch``.

    Batch-dependent nodes (``depends_on_input``) scale linearly, the rest stay; float
    tensors take the precision's element size. ``tp > 1`` divides compute, parameters
    and saved activations (an inference step's KV cache) evenly (ideal tensor + sequence parallelism, Korthikanti's
    (s b h / t)(34 + 5 a s / h), and no TP communication): pass the TP solver's per-node
    costs instead for real numbers. What crosses a cut is divided too (each rank sends its piece of a
    sequence-split b s h): a floor for every layout's.
    """
    G = profile.graph
    order, boundaries = _structure(G)
    pos = _positions(G)
    batch = micro_batch / profile.batch_size
    act = activation_scale(profile, request)
    kv = kv_ratio(profile, request)
    nbytes = output_bytes(profile, request, micro_batch)
    priced = [_price(a, cluster, request, batch, act, kv, tp) for a in pos.samples]
    fwd, bwd, saved, live = (tuple(priced[c][k] for c in pos.price_class) for k in range(4))
    params = [0] * len(order)
    shared = []
    for pname, whole, users, separable in pos.params:
        if separable:
            shared.append(SharedParam(pname, whole // tp, users))
        else:
            params[users[0]] += whole // tp
    send, grad = crossing_bytes(G, order, lambda n: nbytes(n) / tp, request.inference)
    held = [0] * len(order)
    for i, reads in pos.core_reads:
        held[i] = round(sum(nbytes(u) for u in reads) / tp)
    return NodeCosts(
        order=tuple(order), forward_s=fwd, backward_s=bwd, saved_bytes=saved, param_numel=tuple(params),
        send_bytes=send, grad_bytes=grad, boundaries=boundaries, shared=tuple(shared), modules=pos.modules,
        layers=pos.layers, live_bytes=live, cores=pos.cores, core_inputs=tuple(held),
    )


def _price(a: dict, cluster: ClusterSpec, request: TrainingRequest, batch: float, act: float, kv: float,
           tp: int) -> tuple[float, float, int, int]:
    """(forward s, backward s, saved bytes, live bytes) of one micro-batch on a node with attributes
    ``a``, by ``node_costs``'s rules."""
    scale = _batch_scale(a, batch)
    f, b = node_compute_time(a, cluster, request.precision, scale=scale / tp, byte_scale=scale * act / tp,
                             inference=request.inference)
    if request.inference:
        return (f, b, round(a.get("kv_bytes", 0) * scale * act * kv / tp),
                round((a["live_batch"] * batch + a["live_fixed"]) * act / tp))
    return (f, b, round(a["saved_bytes"] * scale * act / tp * precision_factor(a["op"], request.precision,
                                                                                cluster.device)),
            round(node_transient(a, beta=batch, act_scale=act, precision=request.precision, device=cluster.device)
                  / tp))


def output_bytes(profile: ModelProfile, request: TrainingRequest, micro_batch: int) -> Callable[[str], float]:
    """Bytes of a node's outputs at ``micro_batch``: batch-dependent ones scaled from the captured
    batch, floating ones at the precision's element size."""
    G = profile.graph
    batch, act = micro_batch / profile.batch_size, activation_scale(profile, request)
    outputs = _positions(G).outputs

    def nbytes(n: str) -> float:
        if n not in outputs:
            outputs[n] = (G.nodes[n], any(is_floating(d) for d in G.nodes[n]["dtypes"]))
        a, floating = outputs[n]
        return a["out_bytes"] * _batch_scale(a, batch) * (act if floating else 1.0)

    return nbytes


def _batch_scale(a: dict, batch: float) -> float:
    """How a node's work and tensors scale with the batch (``batch``: micro-batch / captured): only
    those depending on a model input do."""
    return batch if a["depends_on_input"] else 1.0


def crossing_bytes(G: nx.DiGraph, order: Sequence[str], nbytes: Callable[[str], float], inference: bool
                   ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``NodeCosts.send_bytes`` and ``grad_bytes``: per boundary of ``order``, the bytes of the tensors
    live across it (``nbytes`` of each node: what one device holds of its output) and of those that
    carry a gradient back. Parameters and buffers never cross: each stage reading one holds it."""
    send = [0.0] * (len(order) + 2)
    grad = [0.0] * (len(order) + 2)
    for name, first, end, carries in _spans(G, order):  # live across boundaries first..end - 1
        b = nbytes(name)
        send[first] += b
        send[end] -= b
        if carries and not inference:
            grad[first] += b
            grad[end] -= b
    return _running(send), _running(grad)


def _spans(G: nx.DiGraph, order: Sequence[str]) -> tuple[tuple[str, int, int, bool], ...]:
    """Per tensor live across a boundary of ``order``: (its node, the first boundary, one past the last,
    whether it carries a gradient); once per (graph, order)."""
    cache = per_graph(_STRUCTURE, G)
    key = tuple(order)
    if key not in cache:
        at = {n: i for i, n in enumerate(order)}
        spans = []
        for name in order:
            a = G.nodes[name]
            users = sorted(at[u] for u in G.successors(name))
            if a["kind"] in ("param", "buffer") or not users or users[-1] <= at[name] + 1:
                continue
            spans.append((name, at[name] + 1, users[-1] + 1, bool(a.get("requires_grad"))))
        cache[key] = tuple(spans)
    return cache[key]


def _running(diff: list[float]) -> tuple[int, ...]:
    return tuple(map(round, itertools.accumulate(diff[:-1])))
