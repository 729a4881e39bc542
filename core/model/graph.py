"""The captured FX graph as a networkx DiGraph that analyses annotate.

``to_networkx`` makes one DiGraph node per FX node (keyed by the FX node's
name) with edges along data flow. It reads ``node.meta["val"]`` (fake values),
``node.meta["nn_module_stack"]`` and ``node.meta["stack_trace"]`` and writes:

- ``op``: ``"aten.mm.default"``, ``"placeholder"``, ``"get_attr"``, ``"output"``,
  or a dotted Python name for functions in a symbolic_trace graph;
- ``kind``: ``"param"``, ``"buffer"``, ``"input"``, ``"call"`` or ``"output"``;
- ``module`` / ``module_type``: the innermost module path (``"transformer.h.3.attn.c_attn"``,
  ``""`` for the root) and its class name; parameters and buffers take the module owning them;
- ``shapes`` / ``dtypes`` / ``out_bytes``: every tensor output's shape (tuple), dtype (str)
  and their total bytes;
- ``inputs`` / ``in_shapes``: the names and shapes of the tensor arguments in argument
  order, repeats kept (what FLOP rules read);
- ``args`` / ``kwargs``: the node's arguments rendered as JSON-able values (ints, floats,
  bools, None, strings, lists of them; dtypes and devices as strings), each tensor
  argument as ``{"input": J}`` (its index in ``inputs``) and any other graph value as
  ``{"node": NAME}`` (what the tensor-parallel rules read: dims, sizes, flags);
- ``param_name`` and ``param_bytes`` on param nodes, ``buffer_name`` on buffer nodes; a
  tied parameter (GPT-2's lm_head and wte) can have several nodes with one ``param_name``:
  count its bytes once per name;
- ``source``: the user's ``file:line`` (deepest non-torch frame of the stack trace) or ``""``;
- ``depends_on_input``: whether a model input is an ancestor.

Graph attributes: ``capture_method``, ``model``, ``inputs`` (InputSpec texts), ``batch``
(the first input's leading dim) and ``module_types`` (every module path seen in ``nn_module_stack`` -> class name).
``graph_fingerprint`` hashes what makes two graphs the same for a plan; ``annotate_batch_shapes``
and ``shape_at`` give every tensor's shape at another micro-batch.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import weakref
from fractions import Fraction
from typing import Any

import networkx as nx
import torch
import torch.fx

from partita.core.model.capture import CapturedModel
from partita.core.model.ops import carries_gradient, op_name, passes_gradient, tensor_values

_TORCH_DIR = os.path.dirname(torch.__file__)
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+)')


def to_networkx(captured: CapturedModel) -> nx.DiGraph:
    """One node per FX node of ``captured.graph_module``, annotated as the module docstring says."""
    G = nx.DiGraph(
        capture_method=captured.method,
        model=captured.name,
        inputs=[str(spec) for spec in captured.inputs],
        batch=captured.inputs[0].shape[0] if captured.inputs and captured.inputs[0].shape else 1,
    )
    fx_nodes = list(captured.graph_module.graph.nodes)
    module_types = _module_types(fx_nodes)
    G.graph["module_types"] = module_types
    for node in fx_nodes:
        G.add_node(node.name, **_attributes(node, captured, module_types))
        for src in node.all_input_nodes:
            G.add_edge(src.name, node.name)
    for name in nx.topological_sort(G):
        attrs = G.nodes[name]
        attrs["depends_on_input"] = attrs["kind"] == "input" or any(
            G.nodes[p]["depends_on_input"] for p in G.predecessors(name)
        )
    return G


def graph_fingerprint(G: nx.DiGraph) -> str:
    """A 16-hex-digit sha256 of ops, edges, shapes, dtypes and parameter names.

    Built from node names and strings only (no ids, no Python hash), so it is
    the same in every process; any change of shape, parameter name or structure changes it.
    """
    nodes = [
        [n, a["op"], a["kind"], [list(s) for s in a["shapes"]], a["dtypes"], a.get("param_name", ""),
         a.get("buffer_name", "")]
        for n, a in G.nodes(data=True)
    ]
    edges = sorted([u, v] for u, v in G.edges)
    text = json.dumps({"nodes": nodes, "edges": edges, "inputs": G.graph.get("inputs", [])}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _attributes(node: torch.fx.Node, captured: CapturedModel, module_types: dict[str, str]) -> dict[str, Any]:
    tensors = tensor_values(node.meta.get("val"))
    kind = _kind(node, captured)
    attrs: dict[str, Any] = {
        "op": op_name(node),
        "kind": kind,
        "shapes": [tuple(int(d) for d in t.shape) for t in tensors],
        "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors],
        "out_bytes": sum(t.numel() * t.element_size() for t in tensors),
        **_tensor_args(node),
        "source": _user_source(node.meta.get("stack_trace") or ""),
    }
    if kind in ("param", "buffer"):
        qualified = (captured.param_nodes if kind == "param" else captured.buffer_nodes)[node.name]
        attrs["param_name" if kind == "param" else "buffer_name"] = qualified
        attrs["module"] = qualified.rpartition(".")[0]
        attrs["module_type"] = module_types.get(attrs["module"], "")
        if kind == "param":
            attrs["param_bytes"] = attrs["out_bytes"]
    else:
        attrs["module"], attrs["module_type"] = _innermost_module(node)
    return attrs


def _kind(node: torch.fx.Node, captured: CapturedModel) -> str:
    if node.op == "output":
        return "output"
    if node.name in captured.param_nodes:
        return "param"
    if node.name in captured.buffer_nodes:
        return "buffer"
    if node.op == "placeholder":
        return "input"
    return "call"


def _tensor_args(node: torch.fx.Node) -> dict[str, list]:
    """``inputs`` (names) and ``in_shapes`` of the node's tensor arguments, in argument order."""
    names: list[str] = []
    shapes: list[tuple[int, ...]] = []

    def visit(arg: torch.fx.Node) -> torch.fx.Node:
        tensors = tensor_values(arg.meta.get("val"))
        if tensors:
            names.append(arg.name)
            shapes.append(tuple(int(d) for d in tensors[0].shape))
        return arg

    torch.fx.map_arg((node.args, node.kwargs), visit)
    return {"inputs": names, "in_shapes": shapes, **_rendered_args(node)}


def _rendered_args(node: torch.fx.Node) -> dict[str, Any]:
    """``args`` and ``kwargs`` as JSON-able values; tensors as their index in ``inputs``.

    Visits arguments in the order ``torch.fx.map_arg`` does (args, then kwargs, depth
    first), so the J-th tensor met here is the J-th entry of ``inputs``.
    """
    count = [0]

    def render(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            if tensor_values(a.meta.get("val")):
                count[0] += 1
                return {"input": count[0] - 1}
            return {"node": a.name}
        if isinstance(a, (list, tuple)):
            return [render(x) for x in a]
        if isinstance(a, dict):
            return {str(k): render(v) for k, v in a.items()}
        if a is None or isinstance(a, (bool, int, float, str)):
            return a
        if isinstance(a, torch.dtype):
            return str(a).removeprefix("torch.")
        return str(a)  # devices, layouts, memory formats

    args = render(list(node.args))
    return {"args": args, "kwargs": render(dict(node.kwargs))}


def _innermost_module(node: torch.fx.Node) -> tuple[str, str]:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return "", ""
    path, cls = list(stack.values())[-1]
    return _clean_path(path), _class_name(cls)


def _module_types(fx_nodes: list[torch.fx.Node]) -> dict[str, str]:
    """Module path -> class name, from every nn_module_stack entry in the graph."""
    types: dict[str, str] = {}
    for node in fx_nodes:
        for path, cls in (node.meta.get("nn_module_stack") or {}).values():
            types.setdefault(_clean_path(path), _class_name(cls))
    return types


def _clean_path(path: str) -> str:
    # strict export spells paths as L['self'].a.b; non-strict and fx as a.b
    return re.sub(r"^L\['self'\]\.?", "", path)


def _class_name(cls: Any) -> str:
    if isinstance(cls, type):
        return cls.__name__
    return str(cls).rsplit(".", 1)[-1]


def _user_source(stack_trace: str) -> str:
    """``file:line`` of the deepest frame outside torch, or ``""``."""
    user = [m for m in _FRAME.finditer(stack_trace) if not m["file"].startswith(_TORCH_DIR)]
    return f"{user[-1]['file']}:{user[-1]['line']}" if user else ""


def gradient_flows(G: nx.DiGraph) -> dict[str, bool]:
    """Node -> whether a gradient flows into its outputs in backward: the one rule the FLOP
    count (``requires_grad``), the pipeline's gradient sends and the TP layouts' gradient
    placements (core/tp/strategies.py) all use. A parameter carries one when floating; a call
    node when an output is floating (or complex), its op is not in ``NO_GRAD_OPS`` and an input
    carries one; inputs, buffers and the output node never. Cached in ``G.graph["grad_flows"]``."""
    cached = G.graph.get("grad_flows")
    if cached is not None and len(cached) == G.number_of_nodes():
        return cached
    flows: dict[str, bool] = {}
    for n in nx.topological_sort(G):
        a = G.nodes[n]
        carries = any(carries_gradient(d) for d in a["dtypes"])
        if a["kind"] == "param":
            flows[n] = carries
        elif a["kind"] == "call":
            flows[n] = passes_gradient(a["op"], a["dtypes"], any(flows.get(p, False) for p in G.predecessors(n)))
        else:
            flows[n] = False
    G.graph["grad_flows"] = flows
    return flows


def annotate_batch_shapes(G: nx.DiGraph, other: nx.DiGraph) -> bool:
    """Record how every tensor's dims grow with the batch, from a second capture at another batch.

    ``G`` and ``other`` are the same model captured at batches ``G.graph["batch"]`` and
    ``other.graph["batch"]`` (the first input's leading dim). When both have the same
    nodes, ops and tensor ranks, writes ``batch_slope`` on every node of ``G`` (per
    output, per dim: the size added per sample, a Fraction) and ``G.graph["batch_shapes"]
    = "linear"``, so ``shape_at`` gives each tensor's shape at any micro-batch from real
    propagation, not from shape rules. Otherwise writes ``"unknown"`` and returns False
    (the model's structure depends on the batch: the caller lays out each micro-batch
    on its own capture).
    """

    b1, b2 = G.graph.get("batch"), other.graph.get("batch")
    same = (b1 and b2 and b1 != b2 and list(G.nodes) == list(other.nodes)
            and all(G.nodes[n]["op"] == other.nodes[n]["op"]
                    and [len(s) for s in G.nodes[n]["shapes"]] == [len(s) for s in other.nodes[n]["shapes"]]
                    for n in G.nodes))
    if not same:
        G.graph["batch_shapes"] = "unknown"
        return False
    for n, a in G.nodes(data=True):
        a["batch_slope"] = tuple(tuple(_whole(Fraction(d2 - d1, b2 - b1)) for d1, d2 in zip(s1, s2))
                                 for s1, s2 in zip(a["shapes"], other.nodes[n]["shapes"]))
    G.graph["batch_shapes"] = "linear"
    return True


def per_graph(store: weakref.WeakKeyDictionary[nx.DiGraph, tuple[int, dict]], G: nx.DiGraph) -> dict:
    """``G``'s dict in ``store``, a cache of what is derived from a graph: emptied when ``G`` has
    gained or lost nodes since it was filled; weakly keyed, so a dropped graph frees its entry."""
    filled, cache = store.get(G, (None, None))
    if cache is None or filled != G.number_of_nodes():
        cache = {}
        store[G] = (G.number_of_nodes(), cache)
    return cache


def _whole(f: Fraction) -> int | Fraction:
    """An integral slope as an int: ``shape_at`` then stays in int arithmetic (a search asks for
    every node's shapes at every micro-batch it weighs)."""
    return f.numerator if f.denominator == 1 else f


def shape_at(G: nx.DiGraph, node: str, index: int, micro_batch: int) -> tuple[Any, ...] | None:
    """Output ``index`` of ``node`` at ``micro_batch`` samples (``annotate_batch_shapes``'s linear
    fit); a dim that is no whole number there is returned as a Fraction. None when unknown."""
    a = G.nodes[node]
    shape = tuple(a["shapes"][index])
    if micro_batch == G.graph.get("batch"):
        return shape
    if G.graph.get("batch_shapes") != "linear":
        return None
    slope = a["batch_slope"][index]
    return tuple(d + k * (micro_batch - G.graph["batch"]) for d, k in zip(shape, slope))
