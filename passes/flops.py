"""Forward and backward FLOPs, bytes and kernels per node.

``annotate_flops`` reads ``op``, ``kind``, ``shapes``, ``dtypes``, ``inputs`` and ``in_shapes``
(written by ``to_networkx``) and writes ``flops_fwd`` and ``flops_bwd`` (ints) on
every node, ``bytes_fwd`` / ``bytes_bwd`` (the memory traffic a roofline prices) and
``kernels_fwd`` / ``kernels_bwd`` (the kernels each pass launches, which a GPU's per-kernel
costs price), plus ``requires_grad`` (whether the node's output carries a gradient).
Totals go to ``G.graph["flops_fwd"]`` and ``G.graph["flops_bwd"]``.

Bytes and kernels: an op reads its inputs and writes its outputs, its backward about
twice that; a view (an op whose output aliases its input: ``transpose``, ``view``,
``flatten``, ``getitem``) moves nothing and launches nothing. One kernel a pass, and in
backward two for a matmul-like (the input's gradient and the weight's) and one more for a
bias (its gradient's reduction).

Forward rules (one multiply-add = 2 FLOPs):
- matmul-likes (mm, addmm, bmm, matmul, linear, baddbmm): 2 m n k, i.e.
  2 x output elements x the contracted dim; a grouped matmul over experts (core/experts.py: rows
  (R, K) against stacked weights (E, K, N), each row by its expert's): 2 R K N, the same rule;
- convolution: 2 x output elements x (C_in / groups) x kernel elements;
- scaled_dot_product_attention: 4 b heads s_q s_k d (QK^T and AV; no saving
  for the causal mask, as in Megatron's count);
- views, reshapes, copies, factories, gathers (embedding), placeholders, getitem: 0;
- reductions (sum, mean, amax, var, logsumexp, ...): 1 per input element;
- everything else (elementwise, norms, softmax, dropout, activations): 1 per output element.

Backward rules:
- matmul-likes (grouped ones too) and convolution: the forward count for each of the two operands
  (activation, weight) that needs a gradient: 2x when both do, 1x when only one
  does (the first layer's input needs none);
- attention: 2.5x forward, FlashAttention's accounting (the backward recomputes
  QK^T and does four matmuls: 5 matmuls against the forward's 2);
- embedding: 1 per output element (the scatter-add into the weight's gradient);
- other differentiable ops: 1x forward;
- nodes whose output needs no gradient (no parameter upstream, integer outputs): 0.
"""

from __future__ import annotations

import math

import networkx as nx

from partita.core.experts import is_grouped_mm_op
from partita.core.model.graph import gradient_flows
from partita.core.model.ops import ATTENTION as _ATTENTION
from partita.core.model.ops import CONV as _CONV
from partita.core.model.ops import MATMUL as _MATMUL
from partita.core.model.ops import base_op
from partita.passes.activations import returns_view

_FREE = {
    "view", "_unsafe_view", "reshape", "transpose", "t", "permute", "expand", "expand_as", "split",
    "split_with_sizes", "chunk", "unbind", "getitem", "slice", "select", "unsqueeze", "squeeze",
    "flatten", "unflatten", "contiguous", "clone", "detach", "alias", "lift_fresh_copy", "to", "_to_copy",
    "type_as", "arange", "zeros", "ones", "full", "empty", "zeros_like", "ones_like", "full_like",
    "empty_like", "scalar_tensor", "embedding", "index_select", "cat", "stack", "sym_size", "sym_numel",
    "sym_stride", "triu", "tril", "copy", "copy_", "index", "gather",
}
_REDUCTIONS = {"sum", "mean", "amax", "amin", "max", "min", "var", "std", "var_mean", "prod", "norm",
               "logsumexp", "argmax", "argmin", "all", "any"}
# ops whose output carries no gradient whatever their inputs (comparisons, factories, argmax, detach)
def annotate_flops(G: nx.DiGraph) -> nx.DiGraph:
    """Write ``flops_fwd``, ``flops_bwd``, ``bytes_fwd``, ``bytes_bwd`` (memory traffic, for a
    roofline cluster) and ``requires_grad`` on every node (rules in the module doc)."""
    flows = gradient_flows(G)
    for name in nx.topological_sort(G):
        a = G.nodes[name]
        op = base_op(a["op"])
        a["requires_grad"] = flows[name]
        a["flops_fwd"] = _forward(a, op)
        a["flops_bwd"] = _backward(G, name, op) if a["requires_grad"] else 0
        # bytes an op moves: reads its inputs, writes its outputs; backward reads the output's
        # gradient and the saved inputs and writes the inputs' gradients (about twice)
        runs = a["kind"] == "call" and not is_view(a["op"])
        a["bytes_fwd"] = a["out_bytes"] + sum(G.nodes[u]["out_bytes"] for u in a.get("inputs", ())) if runs else 0
        a["bytes_bwd"] = 2 * a["bytes_fwd"] if a["requires_grad"] else 0
        a["kernels_fwd"] = int(runs)
        a["kernels_bwd"] = _backward_kernels(a, op) if runs and a["requires_grad"] else 0
    G.graph["flops_fwd"] = sum(a["flops_fwd"] for _, a in G.nodes(data=True))
    G.graph["flops_bwd"] = sum(a["flops_bwd"] for _, a in G.nodes(data=True))
    return G


# ops that return a view of their input (no data moved, no kernel), beside those whose ATen schema says so
_VIEWS = {"view", "_unsafe_view", "flatten", "unflatten", "view_as", "expand_as", "getitem", "alias", "detach",
          "t", "transpose", "permute", "expand", "unsqueeze", "squeeze", "select", "slice", "split",
          "split_with_sizes", "chunk", "unbind", "sym_size", "sym_numel", "sym_stride"}


def is_view(op: str) -> bool:
    """Whether a call of ``op`` (a node's target) only makes a view of its input."""
    return base_op(op) in _VIEWS or returns_view(op)


def _matmul_like(op: str, a: dict) -> bool:
    """A matmul, a grouped matmul over experts (its op named in full in ``a``) or a convolution."""
    return op in _MATMUL or op in _CONV or is_grouped_mm_op(a.get("op", ""))


def _backward_kernels(a: dict, op: str) -> int:
    if _matmul_like(op, a):
        bias = op in ("addmm", "baddbmm") or (op in ("linear", "convolution", "conv1d", "conv2d", "conv3d")
                                             and len(a.get("inputs", ())) >= 3)
        return 2 + int(bias)
    return 1


def _forward(a: dict, op: str) -> int:
    if a["kind"] != "call" or not a["shapes"]:
        return 0
    out = math.prod(a["shapes"][0])
    ins = a["in_shapes"]
    if op in _MATMUL or is_grouped_mm_op(a["op"]):
        operand = ins[1] if op in ("addmm", "baddbmm") else ins[0]
        if op == "linear":
            return 2 * out * ins[1][-1]  # weight (out, in)
        return 2 * out * operand[-1]
    if op in _CONV:
        weight = ins[1]  # (C_out, C_in / groups, *kernel)
        return 2 * out * math.prod(weight[1:])
    if op in _ATTENTION:
        q, k = ins[0], ins[1]  # (b, heads, s, d)
        return 4 * math.prod(q[:-2]) * q[-2] * k[-2] * q[-1]
    if op in _FREE:
        return 0
    if op in _REDUCTIONS:
        return math.prod(ins[0]) if ins else out
    return out


def _backward(G: nx.DiGraph, name: str, op: str) -> int:
    a = G.nodes[name]
    if a["kind"] != "call":
        return 0
    if _matmul_like(op, a):
        preds = _ordered_operands(G, name, op)
        return a["flops_fwd"] * sum(1 for p in preds if G.nodes[p]["requires_grad"])
    if op in _ATTENTION:
        return int(2.5 * a["flops_fwd"])
    if op == "embedding":
        return math.prod(a["shapes"][0])
    return a["flops_fwd"]


def _ordered_operands(G: nx.DiGraph, name: str, op: str) -> list[str]:
    """The two contracted operands' node names (activation, weight) in argument order."""
    preds = G.nodes[name]["inputs"]
    if op in ("addmm", "baddbmm"):
        return preds[1:3] if len(preds) >= 3 else preds
    return preds[:2]
