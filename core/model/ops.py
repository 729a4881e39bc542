"""Families of graph ops, by the name a node's target goes by (``"aten.addmm.default"`` ->
``"addmm"``, ``base_op``): the one list each family lives in; and the one rule of whether a
gradient flows through a node (``passes_gradient``), which the planner (passes/flops.py
``gradient_flows``: FLOPs, the TP layouts' gradient placements, the pipeline's gradient sends)
and the pipeline runtime (runtime/pipeline/stage.py, by ``gradient_nodes``: which gradients cross
a cut) both apply.

passes/flops.py counts their FLOPs (2mnk for a matmul, per output element for a
convolution, the two matmuls of attention); core/model/capture_checks.py refuses inputs
whose dtype would meet another in one of them (fake tensors do not check it: a float
matmul of an int64 input would capture, then fail on the device).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported by the functions that read fx nodes: the plan's checks run without it
    import torch
    import torch.fx

MATMUL = frozenset({"mm", "addmm", "bmm", "matmul", "linear", "baddbmm"})
CONV = frozenset({"convolution", "conv1d", "conv2d", "conv3d", "_convolution", "conv_transpose1d",
                  "conv_transpose2d"})
ATTENTION = frozenset({"scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                       "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu"})
# ops whose tensor operands must share one dtype (a bool operand is a mask, not a value multiplied)
SAME_DTYPE = MATMUL | CONV | ATTENTION


# ops whose outputs carry no gradient whatever their dtype (comparisons, index results, constants)
NO_GRAD_OPS = frozenset({
    "argmax", "argmin", "eq", "ne", "lt", "le", "gt", "ge", "all", "any", "arange", "zeros", "ones", "full",
    "empty", "scalar_tensor", "zeros_like", "ones_like", "full_like", "empty_like", "logical_not", "logical_and",
    "logical_or", "bitwise_not", "sym_size", "detach", "_assert_tensor_metadata",
})
_GRAD_DTYPES = ("float", "bfloat16", "half", "complex")


def base_op(op: str) -> str:
    """``"aten.addmm.default"`` -> ``"addmm"``; ``"torch._C._nn.linear"`` -> ``"linear"``."""
    parts = op.split(".")
    if parts[0] == "aten" and len(parts) >= 2:
        return parts[1]
    return parts[-1]


def carries_gradient(dtype: str) -> bool:
    """Whether a tensor of dtype ``dtype`` (a torch name, ``"float32"``) can carry a gradient:
    floating or complex."""
    return dtype.startswith(_GRAD_DTYPES)


def passes_gradient(op: str, dtypes: Iterable[str], an_input_carries: bool) -> bool:
    """Whether a gradient flows into the outputs of a call of ``op`` (its target as a string)
    with outputs of ``dtypes``: an output can carry one, the op is not in ``NO_GRAD_OPS``, and
    one of its inputs carries one."""
    return an_input_carries and base_op(op) not in NO_GRAD_OPS and any(carries_gradient(d) for d in dtypes)


def op_name(node: torch.fx.Node) -> str:
    """``"aten.mm.default"`` for an ATen overload; a dotted name for other callables."""
    import torch

    if node.op in ("placeholder", "get_attr", "output"):
        return node.op
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    if node.op == "call_module":
        return f"module.{node.target}"
    target = node.target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or str(target)
    return f"{module}.{name}" if module else name


def tensor_values(val: object) -> list[torch.Tensor]:
    """The tensors in a node's ``meta["val"]`` (a tensor, or a tuple/list holding some)."""
    import torch

    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (tuple, list)):
        return [t for v in val for t in tensor_values(v)]
    return []


def gradient_nodes(graph: torch.fx.Graph, param_nodes: Iterable[str]) -> set[str]:
    """Names of the nodes of a captured graph into whose outputs a gradient flows: parameter
    placeholders that can carry one, and calls by ``passes_gradient`` (passes/flops.py
    ``gradient_flows`` applies the same rule to the planner's graph)."""

    params = set(param_nodes)
    out: set[str] = set()
    for n in graph.nodes:
        vals = tensor_values(n.meta.get("val"))
        dtypes = [str(v.dtype).removeprefix("torch.") for v in vals]
        if n.name in params:
            if any(carries_gradient(d) for d in dtypes):
                out.add(n.name)
        elif n.op in ("call_function", "call_method", "call_module") and passes_gradient(
                op_name(n), dtypes, any(a.name in out for a in n.all_input_nodes)):
            out.add(n.name)
    return out


def running_buffers(graph: torch.fx.Graph, buffer_nodes: dict[str, str]) -> dict[str, tuple[int, torch.dtype]]:
    """Floating-point buffers a training forward writes (batch norm's running statistics), by
    placeholder: (elements, dtype). A replica's are computed from its share of the batch, so the
    runtime averages them over "dp" after each step (runtime/dp/averaging.py ``BufferAverager``)
    and the plan lists that all-reduce. ``graph``: a captured graph; ``buffer_nodes`` its
    placeholder -> buffer name map (``CapturedModel.buffer_nodes``)."""
    import torch

    out: dict[str, tuple[int, torch.dtype]] = {}
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        name = base_op(op_name(n))
        if name == "batch_norm" and len(n.args) > 5 and n.args[5] is True:
            written = [a for a in n.args[3:5] if isinstance(a, torch.fx.Node)]
        elif name.endswith("_") and n.args and isinstance(n.args[0], torch.fx.Node):
            written = [n.args[0]]  # an in-place op on its first operand
        else:
            continue
        for a in written:
            val = a.meta.get("val")
            if a.name in buffer_nodes and isinstance(val, torch.Tensor) and val.is_floating_point():
                out[a.name] = (val.numel(), val.dtype)
    return out
