"""What a capture refuses, each before or right after ``torch.export`` (core/model/capture.py): inputs
the forward does not take by those names, dtypes it cannot multiply, a loss whose inputs cannot be
split as the batch is, and a model that cannot train (nothing to train, or a loss no gradient
reaches: the rule the planner applies, core/model/ops.py ``gradient_nodes``)."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from partita.core.errors import CaptureError
from partita.core.model.inputs import InputSpec, dtype_name
from partita.core.model.ops import ATTENTION, SAME_DTYPE, gradient_nodes


def check_input_names(module: torch.nn.Module, inputs: Sequence[InputSpec]) -> None:
    """The inputs are passed positionally: each name must be the forward argument at its place
    (a misnamed input would be bound to another argument, or to none, without a word)."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    # torch.nn's own modules (Sequential, a bare Linear) name their argument generically (``input``):
    # any name is taken for it, but never the name of another of its arguments
    generic = getattr(type(module).forward, "__module__", "").startswith("torch.")
    takes = f"{type(module).__name__}.forward({', '.join(positional)})"
    star = next((p.name for p in params if p.kind is p.VAR_POSITIONAL), None)
    for i, spec in enumerate(inputs):
        if i >= len(positional) and star is not None:  # torch.export passes *args as one list, not tensors
            raise CaptureError(f"input {spec.name!r} would land in *{star} of {type(module).__name__}.forward: "
                               "partita passes each input as a named argument",
                               hint=f"give forward one named argument per input, e.g. def forward(self, "
                               f"{', '.join(s.name for s in inputs)})")
        if i >= len(positional):
            raise CaptureError(f"input {spec.name!r} is input {i + 1}, but {takes} takes {len(positional)}",
                               hint="pass one --input per argument of forward, in its order")
        if spec.name != positional[i] and (spec.name in positional or not generic):
            where = (f"its argument {i + 1} is {positional[i]!r}" if spec.name in positional
                     else f"{spec.name!r} is none of its arguments")
            raise CaptureError(f"input {spec.name!r} is passed as argument {i + 1} of {takes}, but {where}",
                               hint=f"name the inputs after forward's arguments, in order: --input "
                               f"{positional[i]}=DTYPE[SHAPE]")


SHAPE_HINT = "give each --input (and --target) the shape the model takes: the message names the module it fails in"
DTYPE_HINT = "give each --input the dtype the model computes in (float32 features, int64 token ids)"


def check_input_dtypes(gm: torch.fx.GraphModule, inputs: Sequence[InputSpec]) -> None:
    """Refuse an input dtype the model cannot take: one that meets another dtype in a matmul, or
    floating indices of an embedding (torch's fake kernel takes them on some versions; no real one does)."""
    for node in gm.graph.nodes:
        op = getattr(node.target, "__name__", "").split(".")[0] if node.op == "call_function" else ""
        if op == "embedding" and len(node.args) > 1 and isinstance(node.args[1], torch.fx.Node):
            idx = node.args[1].meta.get("val")
            if isinstance(idx, torch.Tensor) and (idx.is_floating_point() or idx.is_complex()):
                given = ", ".join(str(s) for s in inputs)
                raise CaptureError(f"the model cannot take these inputs ({given}): {node.name} looks up rows of "
                                   f"an embedding by {str(idx.dtype).removeprefix('torch.')} indices, which must "
                                   "be integers (expected scalar type Long)", hint=DTYPE_HINT)
        if op not in SAME_DTYPE:
            continue
        vals = [a.meta.get("val") for a in node.all_input_nodes]
        # a bool operand of attention is a mask, not a value multiplied; of a matmul or a convolution it is
        mask = getattr(node.target, "__name__", "").split(".")[0] in ATTENTION
        dtypes = {v.dtype for v in vals if isinstance(v, torch.Tensor) and not (mask and v.dtype is torch.bool)}
        if len(dtypes) > 1:
            names = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
            given = ", ".join(str(s) for s in inputs)
            stack = list((node.meta.get("nn_module_stack") or {}).values())
            where = f" in module {stack[-1][0]!r}" if stack else ""
            raise CaptureError(f"the model cannot take these inputs ({given}): {node.name}{where} multiplies "
                               f"tensors of {names}", hint=DTYPE_HINT)


def check_loss_inputs(module: torch.nn.Module, loss: Any, inputs: Sequence[InputSpec],
                       targets: InputSpec | None) -> None:
    """What a training graph needs of the loss's inputs, refused before export would fail on it:
    targets split into micro-batches as the inputs are (the same leading dim), and a model that
    takes ``labels=`` for its own loss."""
    if targets is not None and inputs and targets.shape[0] != inputs[0].shape[0]:
        raise CaptureError(f"the targets {targets} have a batch of {targets.shape[0]}, but the input {inputs[0]} "
                           f"has {inputs[0].shape[0]}: the steps split both into the same micro-batches",
                           hint="give the targets the inputs' leading (batch) dim, e.g. --target "
                           f"{targets.name}={dtype_name(targets.dtype)}[{inputs[0].shape[0]},...]")
    if not getattr(loss, "uses_labels", False):
        return
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return
    if not any(p.name == "labels" or p.kind is p.VAR_KEYWORD for p in params):
        raise CaptureError(f"loss='model' calls the model with labels=, but {type(module).__name__}.forward("
                           f"{', '.join(p.name for p in params)}) takes no labels",
                           hint="pass a loss function or a loss name (--loss cross-entropy, mse, FILE.py:FN) "
                           "for a model that does not compute its own")


def check_trainable(module: torch.nn.Module, gm: torch.fx.GraphModule, param_targets: dict[str, str],
                     name: str) -> None:
    """A training graph must train something: floating-point parameters that require gradients,
    and a scalar floating-point loss into which a gradient flows from one of them (the rule the
    planner applies, core/model/ops.py ``gradient_nodes``). Otherwise the plan would train nothing, or
    fail only at the first step. ``param_targets``: placeholder -> parameter (a tied one by its
    first name)."""
    named = list(module.named_parameters())
    buffers = sum(1 for _ in module.buffers())
    if not named:
        raise CaptureError(f"{name} has no parameters" + (f" (only {buffers} buffer(s), which are not trained)"
                                                        if buffers else "") + ": training it changes nothing",
                           hint="plan it for inference (--inference, inference=True), or give it parameters")
    trainable = {q: p for q, p in named if p.requires_grad}
    if not trainable:
        raise CaptureError(f"every parameter of {name} is frozen (requires_grad=False): training it changes "
                           "nothing", hint="unfreeze the parameters to train (p.requires_grad_(True)), or plan for "
                           "inference (--inference)")
    odd = next(((q, p.dtype) for q, p in trainable.items() if not p.dtype.is_floating_point), None)
    if odd is not None:
        raise CaptureError(f"parameter {odd[0]} is {dtype_name(odd[1])}: partita trains floating-point parameters "
                           "only", hint="keep a complex parameter as a real one (torch.view_as_real) and view it "
                           "as complex in forward, or freeze it (requires_grad=False)")
    out = next(n for n in gm.graph.nodes if n.op == "output")
    loss_node = out.args[0][0] if isinstance(out.args[0], (tuple, list)) else out.args[0]
    val = loss_node.meta.get("val") if isinstance(loss_node, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.dim() != 0:
        shape = list(val.shape) if isinstance(val, torch.Tensor) else type(val).__name__
        raise CaptureError(f"the loss of {name} is a tensor of shape {shape}, not one number",
                           hint="reduce it in the loss function (e.g. .mean()), so that it is a scalar")
    if not val.dtype.is_floating_point:
        raise CaptureError(f"the loss of {name} is {dtype_name(val.dtype)}: an integer has no gradient",
                           hint="return a floating-point loss, computed from the model's floating-point output")
    seeds = {node for node, q in param_targets.items() if q in trainable}
    if loss_node.name not in gradient_nodes(gm.graph, seeds):
        raise CaptureError(f"the loss of {name} does not depend on any trainable parameter: the output is detached, "
                           "an integer (an argmax) or made without gradients, so no step would change the model",
                           hint="return the model's output with its gradient: no .detach(), argmax or "
                           "torch.no_grad() on its way to the loss")
