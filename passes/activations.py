"""Bytes a training step holds, per node, measured by running the graph forward and backward.

``annotate_saved_activations`` replays ``captured.graph_module`` under a fresh
``FakeTensorMode`` (no real memory) with every parameter requiring grad, records each
tensor autograd saves through ``torch.autograd.graph.saved_tensors_hooks``, then runs the
backward of its output (the captured loss) and follows every tensor the two passes
allocate, as the allocator would see them: each storage from the op that makes it until
its last reference dies. What is saved and what is allocated is whatever the ATen kernels
and their autograd formulas do, not a hand-written rule.

Reads: ``kind`` and ``depends_on_input`` on the DiGraph's nodes (from ``to_networkx``) and
the placeholders' ``meta["val"]`` (shapes, dtypes, strides).
Writes, per node: ``saved_bytes`` (bytes of tensors first saved while that node ran),
``saved_input_bytes`` (of those, the bytes of each tensor input's storage, in ``inputs`` order: a
tensor-parallel strategy holds them as it places that input, the rest as it places the output),
``transient_bytes`` (the most bytes alive while its forward or its backward runs beyond the
saved tensors then alive and the parameters' gradients: the gradients in flight, the op's
temporaries, outputs not yet consumed; for a cross-entropy loss its fp32 log-softmax
gradient and input gradient) and ``grad_bytes`` (the parameters' gradients backward has
made by its last op: what a step that frees them between steps holds then). Per graph:
``saved_bytes_batch`` (saved tensors produced by nodes that depend on a model input: they
scale with the batch), ``saved_bytes_fixed`` (the rest, e.g. a causal mask built from
``arange``), ``transient_node`` (the node with the largest transient), ``step_peak_bytes``
(the most bytes the step held at once beyond the parameters, their gradients and the
optimizer's state) and ``step_peak_tensors`` (how many storages were alive then). A storage
saved twice (a tensor and its view, or by two nodes) counts once, for the first node.
Parameters and buffers are left out: they are model state, counted elsewhere. The cost
model's account of these terms: docs/cost-model.md, "Memory at the step's peak".

``annotate_live_bytes`` is the forward-only counterpart: the activations alive while each
node runs (``live_batch`` / ``live_fixed``), whose peak is an inference step's memory.
How a node's bytes change under a 16-bit policy (autocast keeps some ops in fp32) is the cost
model's ``precision_factor``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import networkx as nx
import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from partita.core.model.capture import CapturedModel
from partita.core.model.ops import tensor_values
from partita.passes.layer_replay import expand, shortcut
from partita.passes.repeats import RepeatedBlock


class _Allocations(TorchDispatchMode):
    """Every storage the ops below it allocate, alive from the op that makes it until the last
    tensor on it dies (the allocator's view), with the node running as each op completes."""

    def __init__(self, excluded: set[int]) -> None:
        super().__init__()
        self.excluded = excluded  # storages of parameters, buffers and inputs: model state, data
        self.refs: dict[int, int] = {}  # storage -> live tensors on it
        self.size: dict[int, int] = {}
        self.born: dict[int, int] = {}  # storage -> the event it was allocated at
        self.live = 0
        self.saved: set[int] = set()
        self.saved_live = 0
        self.node: str | None = None
        self.events: list[tuple[str | None, int, int, int]] = []  # (node, live bytes, saved alive, storages)
        self.freed: list[Callable[[int], None]] = []  # told of each storage freed (its key may be reused)

    def _release(self, key: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            del self.refs[key]
            self.live -= self.size[key]
            if key in self.saved:
                self.saved.discard(key)
                self.saved_live -= self.size[key]
            for tell in self.freed:
                tell(key)

    def follow(self, t: torch.Tensor) -> None:
        key = _storage_key(t)
        if key in self.excluded:
            return
        if key not in self.refs:
            self.size[key] = t.untyped_storage().nbytes()
            self.born[key] = len(self.events)
            self.live += self.size[key]
            self.refs[key] = 0
        self.refs[key] += 1
        weakref.finalize(t, self._release, key)

    def mark_saved(self, t: torch.Tensor) -> None:
        key = _storage_key(t)
        if key not in self.saved and self.refs.get(key):
            self.saved.add(key)
            self.saved_live += self.size[key]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.follow(t)
        self.events.append((self.node, self.live, self.saved_live, len(self.refs)))
        return out


class _SavedTensorRecorder(torch.fx.Interpreter):
    """Runs the graph and attributes each tensor saved for backward to the node running, and each
    backward op to the node whose forward made its autograd node."""

    def __init__(self, gm: torch.fx.GraphModule, G: nx.DiGraph, allocations: _Allocations) -> None:
        # Values die after their last use, as the runtime's program frees them: a storage's key is
        # forgotten when it is freed (the allocator may hand its address out again).
        super().__init__(gm, garbage_collect_values=True)
        self.G = G
        self.allocations = allocations
        self.current: str | None = None
        self.excluded: set[int] = set()  # storages of parameters and buffers
        self.producer: dict[int, str] = {}  # storage -> first node whose output holds it
        self.seen: set[int] = set()  # saved storages (alive until backward is done with them)
        self.saved: dict[str, int] = {}
        self.inputs: dict[int, int] = {}  # storage -> index of the running node's tensor input holding it
        self.saved_inputs: dict[str, dict[int, int]] = {}  # node -> input index -> bytes saved of it
        allocations.freed.append(self._forget)
        self.batch_bytes: dict[str, int] = {}  # node -> bytes it saved that scale with the batch
        self.fixed_bytes: dict[str, int] = {}  # node -> the rest
        self.grad_fns: set[Any] = set()  # autograd nodes already attributed

    def run_node(self, n: torch.fx.Node) -> Any:
        self.current = self.allocations.node = n.name
        self.inputs = {}
        args: list[torch.fx.Node] = []
        torch.fx.map_arg((n.args, n.kwargs), args.append)
        # the node's tensor inputs in core/model/graph.py's order (``inputs``: argument order, repeats kept)
        tensors = [tensor_values(self.env.get(a)) for a in args if tensor_values(a.meta.get("val"))]
        for j, t in enumerate(tensors):
            if t:
                self.inputs.setdefault(_storage_key(t[0]), j)
        out = super().run_node(n)
        self.inputs = {}
        for t in tensor_values(out):
            self.producer.setdefault(_storage_key(t), n.name)
        kind = self.G.nodes[n.name]["kind"]
        if kind in ("param", "buffer", "input"):  # held before the step: not the step's allocations
            self.allocations.excluded.update(_storage_key(t) for t in tensor_values(out))
            if kind != "input":  # a saved input is an activation (the batch), a parameter is state
                self.excluded.update(_storage_key(t) for t in tensor_values(out))
        self._hook_backward(n.name, tensor_values(out))
        return out

    def _forget(self, key: int) -> None:
        self.producer.pop(key, None)

    def _hook_backward(self, name: str, outputs: list[torch.Tensor]) -> None:
        """Name ``name`` the running node while the autograd nodes its forward made run backward."""
        todo = [t.grad_fn for t in outputs if t.grad_fn is not None]
        while todo:
            fn = todo.pop()
            if fn is None or fn in self.grad_fns:
                continue
            self.grad_fns.add(fn)
            fn.register_prehook(_naming(self.allocations, name))
            todo.extend(f for f, _ in fn.next_functions)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key in self.excluded or key in self.seen or self.current is None:
            return t
        self.seen.add(key)
        self.allocations.mark_saved(t)
        nbytes = t.untyped_storage().nbytes()
        self.saved[self.current] = self.saved.get(self.current, 0) + nbytes
        j = self.inputs.get(key)
        if j is not None:  # one of the node's inputs: a TP strategy holds it as that input's placement
            held = self.saved_inputs.setdefault(self.current, {})
            held[j] = held.get(j, 0) + nbytes
        # A tensor created inside this node (an op's internal mean/rstd, a mask) belongs to it.
        origin = self.producer.get(key, self.current)
        split = self.batch_bytes if self.G.nodes[origin]["depends_on_input"] else self.fixed_bytes
        split[self.current] = split.get(self.current, 0) + nbytes
        return t


def _naming(allocations: _Allocations, name: str) -> Callable[..., None]:
    def prehook(*_: Any) -> None:
        allocations.node = name
    return prehook


def annotate_saved_activations(G: nx.DiGraph, captured: CapturedModel,
                               blocks: list[RepeatedBlock] | None = None) -> nx.DiGraph:
    """Write ``saved_bytes`` and ``transient_bytes`` per node and the graph's totals (see the
    module docstring). With ``blocks`` (``find_repeated_layers``), three layers of the largest
    stand for all of them (passes/layer_replay.py) where its layers allow it."""
    cut = shortcut(captured.graph_module, G, blocks or [])
    if cut is not None:
        recorder, allocations, births, backward_at = _replay(cut.graph_module, G)
        full = expand(cut, allocations.events, births, backward_at)
        if full is not None:
            events, births = full
            for layer in cut.left_out:
                for mine, theirs in zip(layer, cut.middle):
                    for table in (recorder.saved, recorder.saved_inputs, recorder.batch_bytes,
                                  recorder.fixed_bytes):
                        if theirs in table:
                            table[mine] = table[theirs]
            _write(G, recorder, events, births)
            return G
    recorder, allocations, births, _ = _replay(captured.graph_module, G)
    _write(G, recorder, allocations.events, births)
    return G


def _replay(gm: torch.fx.GraphModule, G: nx.DiGraph) -> tuple[_SavedTensorRecorder, _Allocations,
                                                              list[tuple[int, int]], int]:
    """Run ``gm`` forward and backward on fake tensors: the recorder, the allocations' events, the
    parameters' gradients' births (event index, bytes) and the index of the first backward event."""
    allocations = _Allocations(set())
    recorder = _SavedTensorRecorder(gm, G, allocations)
    params: list[torch.Tensor] = []
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode, torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t):
        args = []
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                t = _fake_like(node, G.nodes[node.name]["kind"])
                args.append(t)
                if t.requires_grad:
                    params.append(t)
        with torch.enable_grad(), allocations:
            out = recorder.run(*args)
            outputs = [t for t in tensor_values(out) if t.requires_grad]
            allocations.node = None
            backward_at = len(allocations.events)
            if outputs:  # the step's backward, from the loss (a non-scalar output: a gradient of ones)
                torch.autograd.backward(outputs, [torch.ones_like(t) if t.numel() > 1 else None for t in outputs])
        grads = {_storage_key(p.grad) for p in params if p.grad is not None}
    births = [(allocations.born[k], allocations.size[k]) for k in grads if k in allocations.born]
    return recorder, allocations, births, backward_at


def _write(G: nx.DiGraph, recorder: _SavedTensorRecorder, events: list[tuple[str | None, int, int, int]],
           births: list[tuple[int, int]]) -> None:
    transient, grads_by, peak, tensors = _transients(events, births)
    for name, attrs in G.nodes(data=True):
        attrs["saved_bytes"] = recorder.saved.get(name, 0)
        held = recorder.saved_inputs.get(name, {})
        attrs["saved_input_bytes"] = [held.get(j, 0) for j in range(len(attrs.get("inputs", ())))]
        attrs["transient_bytes"] = transient.get(name, 0)
        attrs["grad_bytes"] = grads_by.get(name, 0)
    G.graph["saved_bytes_batch"] = sum(recorder.batch_bytes.values())
    G.graph["saved_bytes_fixed"] = sum(recorder.fixed_bytes.values())
    G.graph["transient_node"] = max(transient, key=transient.get, default="")
    G.graph["step_peak_bytes"] = peak
    G.graph["step_peak_tensors"] = tensors


def _transients(events: list[tuple[str | None, int, int, int]],
                births: list[tuple[int, int]]) -> tuple[dict[str, int], dict[str, int], int, int]:
    """Per node, the most bytes alive during its ops beyond the saved tensors then alive and the
    parameters' gradients, and the parameters' gradients alive by its last op; the most bytes alive
    at any point, the gradients excluded, and how many storages were alive then (each a block the
    allocator rounds)."""
    sizes = sorted(births)
    transient: dict[str, int] = {}
    grads_by: dict[str, int] = {}
    peak = grads_held = i = tensors = 0
    for at, (node, live, saved, count) in enumerate(events):
        while i < len(sizes) and sizes[i][0] <= at:  # a parameter's gradient lives to the step's end
            grads_held += sizes[i][1]
            i += 1
        held = live - grads_held
        if held > peak:
            peak, tensors = held, count
        if node is not None:
            transient[node] = max(transient.get(node, 0), held - saved)
            grads_by[node] = grads_held
    return transient, grads_by, peak, tensors


def _fake_like(node: torch.fx.Node, kind: str) -> torch.Tensor:
    val = node.meta["val"]
    t = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype)
    if kind == "param" and t.is_floating_point():
        t.requires_grad_(True)
    return t


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def annotate_live_bytes(G: nx.DiGraph) -> nx.DiGraph:
    """Write ``live_batch`` / ``live_fixed`` on every node: the bytes of activations alive while it
    runs in the forward (captured order), split as ``saved_bytes`` is into what grows with the batch
    and what does not. What a forward-only step needs on top of the model state is their largest
    sum (``peak_live_bytes``).

    A tensor is alive from the node producing it to its last reader, logits and outputs included
    (the output node reads them last). A view (an op whose schema says its output aliases an input,
    ``getitem`` of a tuple) adds no bytes and keeps the tensor it views alive. Parameters, buffers
    and their views are model state, counted elsewhere.
    """
    order = list(G.nodes)
    at = {n: i for i, n in enumerate(order)}
    root: dict[str, str] = {}
    for n in order:
        a = G.nodes[n]
        srcs = a.get("inputs", [])
        root[n] = root[srcs[0]] if srcs and returns_view(a["op"]) else n
    death = {n: at[n] for n in order}
    for n in order:
        for src in G.nodes[n].get("inputs", []):
            r = root[src]
            death[r] = max(death[r], at[n])
    grow = [0] * (len(order) + 1)
    fixed = [0] * (len(order) + 1)
    for n in order:
        a = G.nodes[n]
        if root[n] != n or a["kind"] not in ("call", "input"):
            continue
        acc = grow if a.get("depends_on_input") else fixed
        acc[at[n]] += a.get("out_bytes", 0)
        acc[death[n] + 1] -= a.get("out_bytes", 0)
    live_b = live_f = 0
    for i, n in enumerate(order):
        live_b += grow[i]
        live_f += fixed[i]
        G.nodes[n]["live_batch"], G.nodes[n]["live_fixed"] = live_b, live_f
    return G


def peak_live_bytes(G: nx.DiGraph, nodes: Any, micro_batch: int, batch: int, scale: float = 1.0) -> int:
    """The largest live set (``annotate_live_bytes``) over ``nodes`` at ``micro_batch`` samples of a
    graph captured at ``batch``, times ``scale`` (the precision's element size over the captured one)."""
    return round(max((G.nodes[n].get("live_batch", 0) * micro_batch / batch + G.nodes[n].get("live_fixed", 0)
                      for n in nodes), default=0) * scale)


def returns_view(op: str) -> bool:
    """Whether ``op``'s output is a view of its first input (its ATen schema's alias annotation)."""
    if op.endswith("getitem"):
        return True
    parts = op.split(".")
    if len(parts) != 3 or parts[0] != "aten":
        return False
    try:
        overload = getattr(getattr(torch.ops.aten, parts[1]), parts[2])
    except (AttributeError, RuntimeError):
        return False
    return any(r.alias_info is not None and not r.alias_info.is_write for r in overload._schema.returns)


_ATTENTION = ("scaled_dot_product", "flash_attention", "efficient_attention")
_REARRANGE = frozenset({"reshape", "clone", "contiguous", "_unsafe_view", "expand", "repeat", "repeat_interleave",
                        "_to_copy"})


def annotate_kv_cache(G: nx.DiGraph) -> int:
    """Write ``kv_bytes`` on every attention op and their sum ``G.graph["kv_bytes"]``: the keys and
    values it reads, at the captured batch and sequence, as a generation cache holds them (bytes,
    captured dtype); returns the sum. A planner scales them by the micro-batch and by
    ``TrainingRequest.kv_tokens`` over the captured sequence.

    Each attention op's key and value are followed back through ops that only rearrange or repeat
    them (views, reshapes, expands, copies), and the smallest tensor on that chain is what is cached:
    grouped-query attention repeats each KV head for its query heads after the cache, and rotary
    embeddings are applied before it (Hugging Face's order).
    """
    total = 0
    for _, a in G.nodes(data=True):
        if a["kind"] != "call" or not any(k in a["op"] for k in _ATTENTION) or len(a["inputs"]) < 3:
            continue
        for src in a["inputs"][1:3]:
            smallest = _tensor_bytes(G, src)
            while True:
                b = G.nodes[src]
                tensors = b.get("inputs", [])
                rearranges = b["op"].split(".")[1:2] and b["op"].split(".")[1] in _REARRANGE
                if len(tensors) != 1 or not (returns_view(b["op"]) or rearranges):
                    break
                src = tensors[0]
                smallest = min(smallest, _tensor_bytes(G, src))
            total += smallest
            a["kv_bytes"] = a.get("kv_bytes", 0) + smallest
    G.graph["kv_bytes"] = total
    return total


def _tensor_bytes(G: nx.DiGraph, n: str) -> int:
    return G.nodes[n].get("out_bytes", 0)
