"""Capture a model as an FX graph of ATen ops, on fake tensors.

``capture`` is the front door of the compiler: it turns a model (a class or a
factory that builds one, or a module instance with real weights) and the
shapes of its inputs into a ``CapturedModel``. No real memory is used for
parameters built by a factory: they are created under ``FakeTensorMode``.
The primary method is ``torch.export.export(strict=False)`` (training IR, with
``nn_module_stack``, ``stack_trace`` and fake ``val`` on every node);
``torch.fx.symbolic_trace`` is the fallback when export refuses a forward-only
capture for a reason other than data-dependent control flow, with shapes then
propagated by ``ShapeProp`` on fake tensors (a training capture never falls back:
the fallback's graph would lack the loss). A model that cannot be captured, or
cannot train (core/model/capture_checks.py), raises ``CaptureError`` naming the module
and the source line; what torch logs meanwhile goes to the ``partita.capture``
logger at DEBUG (``partita compile --verbose``).
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import io
import linecache
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import FrameType, TracebackType
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata

from partita.core.errors import CaptureError
from partita.core.model.capture_checks import (
    DTYPE_HINT,
    SHAPE_HINT,
    check_input_dtypes,
    check_input_names,
    check_loss_inputs,
    check_trainable,
)
from partita.core.model.capture_memo import capture_key, keep, kept
from partita.core.model.fake_ops import buffers_kept, capturable
from partita.core.model.inputs import InputSpec, dtype_name
from partita.core.model.losses import select_output, training_loss
from partita.core.model.moe_loops import traceable_experts

EXPORT = "torch.export"
SYMBOLIC_TRACE = "torch.fx.symbolic_trace"

LOG = logging.getLogger("partita.capture")
_TORCH_DIR = os.path.dirname(torch.__file__)
_DATA_DEPENDENT = ("GuardOnDataDependentSymNode", "DataDependentOutputException", "data-dependent", "data dependent")


@dataclass
class CapturedModel:
    """A captured model: its FX graph and what the analyses need to know about it.

    ``params`` and ``buffers`` map qualified names (``transformer.h.0.attn.c_attn.weight``)
    to (shape, dtype). Tied parameters appear once, under their first name.

    It holds no tensor of the model: not the ``ExportedProgram``, whose state dict
    references every parameter of a captured instance (a tensor-parallel rank keeps
    a captured graph, and must not keep the other ranks' shards with it). The
    only tensors it carries are ``constants``, the tensor constants export lifted
    out of the forward (values that are neither parameters nor buffers), by name.
    """

    graph_module: torch.fx.GraphModule
    constants: dict[str, torch.Tensor]
    method: str
    inputs: tuple[InputSpec, ...]
    params: dict[str, tuple[tuple[int, ...], torch.dtype]]
    buffers: dict[str, tuple[tuple[int, ...], torch.dtype]]
    name: str
    seconds: float
    # placeholder / get_attr node name -> qualified parameter (buffer) name; a tied
    # parameter's nodes all name its first qualified name, the one in ``params``
    param_nodes: dict[str, str] = field(default_factory=dict)
    buffer_nodes: dict[str, str] = field(default_factory=dict)
    # training graphs: the loss is captured with the model, its targets are the last placeholder
    targets: InputSpec | None = None
    loss: str | None = None


def uncompiled(module: Any) -> Any:
    """The module ``torch.compile`` wrapped (its ``_orig_mod``), else ``module`` itself: partita
    captures and runs the model's own forward (the plan's graph), so the compiled wrapper is set
    aside; the parameters are the same objects, and the wrapper sees every update."""
    while isinstance(module, torch.nn.Module) and isinstance(getattr(module, "_orig_mod", None), torch.nn.Module):
        module = module._orig_mod
    return module


def capture(
    model: torch.nn.Module | Callable[[], torch.nn.Module],
    inputs: Sequence[InputSpec],
    *,
    name: str | None = None,
    loss: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
    targets: InputSpec | None = None,
    stack_traces: bool = False,
) -> CapturedModel:
    """Capture ``model`` against fake inputs of the ``inputs`` shapes.

    With ``loss``, the graph is the training graph ``loss(model(*inputs),
    targets)``: the loss's ops are captured too, so the solvers can lay out
    (say) a vocabulary-parallel cross-entropy. ``targets`` defaults to what
    the model's output implies: integer class indices of ``output.shape[:-1]``.

    ``model`` is a zero-argument callable building an ``nn.Module`` (built under
    ``FakeTensorMode``: a 70B-parameter shape costs no parameter memory) or an
    ``nn.Module`` instance (exported with its real parameters fake-ified by
    export itself; they are not copied).

    ``stack_traces=True`` records each node's source line (``node.meta["stack_trace"]``, the
    graph's ``source`` attribute): 15-40% of an export, and only a planner-bug message reads
    it, so planning and running capture without.
    """
    start = time.perf_counter()
    inputs = tuple(inputs)
    model = uncompiled(model)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    if isinstance(model, torch.nn.Module):
        module = model
    elif callable(model):
        try:
            module = _build_fake(model, mode)
        except Exception as e:
            raise _capture_error(e, model, None, "building the model under fake tensors failed",
                                 hint="the factory's initialisation must not read tensor values (it runs on fake "
                                 "and meta tensors); or pass a built model instance") from e
        if not isinstance(module, torch.nn.Module):
            raise CaptureError(f"{_name_of(model)}() returned {type(module).__name__}, not an nn.Module",
                               hint="pass an nn.Module subclass, a factory returning one, or a module instance")
    else:
        raise CaptureError(
            f"cannot capture {type(model).__name__}: expected an nn.Module or a zero-argument factory",
            hint="pass an nn.Module subclass, a factory returning one, or a module instance")

    key = capture_key(module, inputs, name=name, loss=loss, targets=targets, stack_traces=stack_traces)
    if reused := kept(key):  # core/model/capture_memo.py: off unless a process turns it on
        return reused
    check_input_names(module, inputs)
    if loss is not None:
        check_loss_inputs(module, loss, inputs, targets)
    with mode:
        args = tuple(_example(spec) for spec in inputs)
    if loss is not None and targets is None:
        with capturable(), traceable_experts(module):
            targets = _infer_targets(module, args, mode, loss, inputs)
    if loss is not None:
        with mode:
            args = args + (_example(targets),)
    try:
        with _held_output(name or _name_of(model)), _forward_with_loss(module, loss, len(inputs)), \
                _fx_config(do_not_emit_stack_traces=not stack_traces), capturable(), traceable_experts(module):
            exported = torch.export.export(module, args, strict=False)
        gm, method = exported.graph_module, EXPORT
        signature = exported.graph_signature
        param_targets = dict(signature.inputs_to_parameters)
        buffer_targets = {**signature.inputs_to_buffers, **signature.inputs_to_lifted_tensor_constants}
        constants = {k: v for k, v in exported.constants.items() if isinstance(v, torch.Tensor)}
        del exported  # its state dict references the model's parameters
        if isinstance(model, torch.nn.Module):
            # Non-strict export leaves reference cycles that hold every parameter and buffer of
            # the module (torch/_export/non_strict_utils.py: _gather_constant_attrs's closure,
            # which calls itself, over a set of them). Collected now, so that a caller which then
            # drops the module's tensors (a tensor-parallel rank keeping its shards) frees them
            # at once, not whenever the garbage collector next runs.
            gc.collect()
    except Exception as export_error:
        if _is_data_dependent(export_error):
            raise _data_dependent_error(export_error, module, inputs) from export_error
        if loss is not None:  # the fallback traces the forward alone: its graph would lack the loss
            raise _capture_error(export_error, module, inputs, "torch.export of the model with its loss failed",
                                 hint="fix what the message names (the chained error shows the whole trace): a "
                                 "training graph holds the loss, which the torch.fx fallback cannot capture"
                                 ) from export_error
        constants = {}
        gm, method = _symbolic_trace(module, args, mode, export_error, inputs, stack_traces)
        attrs = {n.name: str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
        param_names = set(dict(module.named_parameters(remove_duplicate=False)))
        param_targets = {k: v for k, v in attrs.items() if v in param_names}
        buffer_targets = {k: v for k, v in attrs.items() if v not in param_names}

    check_input_dtypes(gm, inputs)
    params = {k: (tuple(p.shape), p.dtype) for k, p in module.named_parameters()}
    buffers = {k: (tuple(b.shape), b.dtype) for k, b in module.named_buffers()}
    canonical = {**_canonical_names(module.named_parameters(remove_duplicate=False)),
                 **_canonical_names(module.named_buffers(remove_duplicate=False))}
    if loss is not None:
        check_trainable(module, gm, {k: canonical.get(v, v) for k, v in param_targets.items()},
                         name or _name_of(model))
    keep(key, captured := CapturedModel(
        graph_module=gm,
        constants=constants,
        method=method,
        inputs=inputs,
        params=params,
        buffers=buffers,
        name=name or type(module).__name__,
        seconds=time.perf_counter() - start,
        targets=targets if loss is not None else None,
        loss=getattr(loss, "__name__", type(loss).__name__) if loss is not None else None,
        param_nodes={k: canonical.get(v, v) for k, v in param_targets.items()},
        buffer_nodes={k: canonical.get(v, v) for k, v in buffer_targets.items()},
    ))
    return captured


@contextlib.contextmanager
def _fx_config(**values: Any) -> Iterator[None]:
    """torch.fx.config's ``values`` for the block, restored after; a setting this torch does not have
    is left out (torch 2.11 has no ``do_not_emit_stack_traces``: it records them, which costs time only)."""
    import torch.fx.config as fx_config

    values = {k: v for k, v in values.items() if hasattr(fx_config, k)}
    saved = {k: getattr(fx_config, k) for k in values}
    try:
        for k, v in values.items():
            setattr(fx_config, k, v)
        yield
    finally:
        for k, v in saved.items():
            setattr(fx_config, k, v)


def _build_fake(factory: Callable[[], Any], mode: FakeTensorMode) -> Any:
    """``factory()`` with fake parameters and buffers (no memory for the weights). Built under
    ``mode``; a model whose initialisation reads values (``trunc_normal_`` in Hugging Face's ViT
    asks a tensor for a Python number, which a fake tensor cannot answer) is built on the meta
    device instead, and each parameter and buffer is then replaced by a fake tensor of its shape
    and dtype: the values never matter to capture, only the shapes."""
    try:
        with mode:
            return uncompiled(factory())
    except Exception as e:
        if not _is_data_dependent(e):
            raise
    with torch.device("meta"):
        module = uncompiled(factory())
    if isinstance(module, torch.nn.Module):
        fakes: dict[int, torch.Tensor] = {}  # by the meta tensor's id: a tied parameter stays one
        with mode:
            for sub in module.modules():
                for table, make in ((sub._parameters, lambda t: torch.nn.Parameter(
                        torch.empty(t.shape, dtype=t.dtype), requires_grad=t.requires_grad)),
                                    (sub._buffers, lambda t: torch.empty(t.shape, dtype=t.dtype))):
                    for name, t in list(table.items()):
                        if t is not None:
                            if id(t) not in fakes:
                                fakes[id(t)] = make(t)
                            table[name] = fakes[id(t)]
    return module


def _canonical_names(named: Iterator[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """Every qualified name -> the first name of the same tensor (tied weights share one)."""
    first: dict[int, str] = {}
    return {name: first.setdefault(id(t), name) for name, t in named}


@contextlib.contextmanager
def _held_output(what: str) -> Iterator[None]:
    """Hold back what torch logs and what is written to stderr while ``what`` is captured.

    A failed capture makes torch log a traceback (a fake tensor's failed meta kernel) and print a
    partial graph: the ``CaptureError`` raised from it says it in one message, and all of it goes
    to the ``partita.capture`` logger at DEBUG (``partita compile --verbose`` shows it). On
    success what the model itself wrote to stderr is written out as it was; torch's log still
    goes to DEBUG only.
    """
    logs, err = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(logs)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    swapped = {logger: logger.handlers for name, logger in list(logging.Logger.manager.loggerDict.items())
               if isinstance(logger, logging.Logger) and logger.handlers and name.split(".")[0] == "torch"}
    shapes = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = shapes.level
    shapes.setLevel(logging.ERROR)
    succeeded = False
    try:
        for logger in swapped:
            logger.handlers = [handler]
        with contextlib.redirect_stderr(err):
            yield
        succeeded = True
    finally:
        for logger, handlers in swapped.items():
            logger.handlers = handlers
        shapes.setLevel(level)
        if succeeded:
            sys.stderr.write(err.getvalue())
        held = logs.getvalue() + ("" if succeeded else err.getvalue())
        if held:
            LOG.debug("what torch logged while capturing %s:\n%s", what, held.rstrip())


def _infer_targets(module: torch.nn.Module, args: tuple[torch.Tensor, ...], mode: FakeTensorMode,
                   loss: Any, inputs: tuple[InputSpec, ...]) -> InputSpec:
    """Class-index targets for the model's output: int64 of ``output.shape[:-1]``, of the tensor the
    loss attaches to (core/model/losses.py); with the model's own loss, labels of the first input's shape."""
    try:  # buffers the forward updates in place (batch norm's count) are put back: planning changes nothing
        with buffers_kept(module), mode, torch.no_grad(), _held_output(type(module).__name__):
            out = module(*args)
    except Exception as e:
        if _is_data_dependent(e):
            raise _data_dependent_error(e, module, None) from e
        raise _capture_error(e, module, None, "running the model on fake inputs to find its output shape failed") from e
    select = getattr(loss, "select", select_output)
    out = select(out)
    if not (out.is_floating_point() or out.is_complex()) and not getattr(loss, "uses_labels", False):
        raise CaptureError(f"the output of {type(module).__name__} the loss attaches to is {dtype_name(out.dtype)}: "
                           "a loss of it has no gradient", hint="return the floating-point scores (logits), not "
                           "their argmax or another integer; the loss takes them")
    if out.dim() < 1:
        raise CaptureError(
            "cannot infer the loss targets: the model's output is a scalar, not a tensor of logits",
            hint="pass the targets' shape explicitly (e.g. --target targets=int64[16,64])",
        )
    name = "labels" if getattr(loss, "uses_labels", False) else "targets"  # the model's own loss takes labels=
    return InputSpec(name, torch.int64, tuple(out.shape[:-1]) or (1,))


@contextlib.contextmanager
def _forward_with_loss(module: torch.nn.Module, loss: Callable[[Any, torch.Tensor], torch.Tensor] | None,
                       n_inputs: int) -> Iterator[None]:
    """Make ``module.forward(*inputs, targets)`` return the training loss of ``inputs`` (the first
    ``n_inputs`` arguments; the rest keep their defaults) while exporting, so parameter names and
    module paths stay the model's own; restored afterwards. Without a loss, a forward that takes
    ``use_cache`` (a Hugging Face causal LM) is called with ``use_cache=False``: its KV cache object
    is no tensor a graph can return, and an inference plan prices the cache itself."""
    inner = module.forward
    params = [p.replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD, default=inspect.Parameter.empty)
              for p in inspect.signature(inner).parameters.values()
              if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)][:n_inputs]
    if loss is None:
        if "use_cache" not in inspect.signature(inner).parameters:
            yield
            return

        def forward(*args: Any) -> Any:
            return inner(*args, use_cache=False)
    else:
        def forward(*args: Any) -> Any:
            *inputs, targets = args
            return training_loss(loss, inner, inputs, targets)

        # Keep the model's argument names (placeholders are named after them), plus ``targets``.
        names = {p.name for p in params}
        params.append(inspect.Parameter("targets" if "targets" not in names else "loss_targets",
                                        inspect.Parameter.POSITIONAL_OR_KEYWORD))
    forward.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    module.forward = forward  # an instance attribute shadows the class's forward
    try:
        yield
    finally:
        del module.forward


def _example(spec: InputSpec) -> torch.Tensor:
    # Zeros are valid token ids and valid floats; under fake mode no memory is used.
    return torch.zeros(spec.shape, dtype=spec.dtype)


class _InlineAllModules(torch.fx.Tracer):
    """Trace through every module, so the graph holds functions (F.linear, ...) rather than
    opaque ``call_module`` nodes, and ``nn_module_stack`` names the innermost module."""

    def __init__(self, stack_traces: bool) -> None:
        super().__init__(autowrap_functions=(), param_shapes_constant=False)
        self.record_stack_traces = stack_traces

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        return False


def _symbolic_trace(
    module: torch.nn.Module,
    args: tuple[torch.Tensor, ...],
    mode: FakeTensorMode,
    export_error: Exception,
    inputs: tuple[InputSpec, ...],
    stack_traces: bool,
) -> tuple[torch.fx.GraphModule, str]:
    try:
        tracer = _InlineAllModules(stack_traces)
        graph = tracer.trace(module)
        gm = torch.fx.GraphModule(tracer.root, graph, type(module).__name__)
        with mode, _held_output(type(module).__name__):
            ShapeProp(gm, fake_mode=mode).propagate(*args)
    except Exception as trace_error:
        # The export error is the one that names the cause best; the fallback's is chained under it.
        err = _capture_error(export_error, module, inputs, "torch.export failed and torch.fx.symbolic_trace "
                             f"could not take over ({type(trace_error).__name__}: {_first_line(trace_error)})")
        raise err from export_error
    for node in gm.graph.nodes:  # give fallback nodes export's `val` key, so passes read one key
        meta = node.meta.get("tensor_meta")
        if meta is not None and "val" not in node.meta:
            node.meta["val"] = _fake_from_meta(meta, mode)
    return gm, SYMBOLIC_TRACE


def _fake_from_meta(meta: object, mode: FakeTensorMode) -> object:
    if isinstance(meta, TensorMetadata):
        with mode:
            return torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype)
    if isinstance(meta, (tuple, list)):
        return type(meta)(_fake_from_meta(m, mode) for m in meta)
    if isinstance(meta, dict):
        return {k: _fake_from_meta(v, mode) for k, v in meta.items()}
    return meta


def _is_data_dependent(e: BaseException) -> bool:
    while e is not None:
        text = f"{type(e).__name__}: {e}"
        if any(marker in text for marker in _DATA_DEPENDENT):
            return True
        e = e.__cause__ or e.__context__
    return False


def _data_dependent_error(e: BaseException, module: torch.nn.Module,
                          inputs: tuple[InputSpec, ...] | None) -> CaptureError:
    return _capture_error(
        e, module, inputs, "data-dependent Python control flow",
        hint="remove data-dependent Python control flow (e.g. `if torch.rand([]) < p:`) or mark the module as a leaf",
    )


def _capture_error(
    e: BaseException,
    model: object,
    inputs: tuple[InputSpec, ...] | None,
    what: str,
    hint: str | None = None,
) -> CaptureError:
    """One message: which module, which user line, what went wrong; the trace stays in __cause__."""
    module_path, source = _locate(e, model)
    where = f"in module {module_path!r}" if module_path is not None else f"in {_name_of(model)}"
    where += f" at {source}" if source else ""
    shapes = f" with inputs {', '.join(map(str, inputs))}" if inputs else ""
    return CaptureError(
        f"cannot capture {_name_of(model)}{shapes}: {what} {where}: {type(e).__name__}: {_first_line(e)}",
        hint=hint or (DTYPE_HINT if "scalar type" in str(e) or "dtype" in str(e) else SHAPE_HINT
                      if any(w in str(e) for w in ("shape", "size", "reduction dim", "dimension")) else
                      "make the forward traceable by torch.export (see the chained error) or mark the module as "
                      "a leaf"),
    )


def _locate(e: BaseException, model: object) -> tuple[str | None, str | None]:
    """The innermost module executing when ``e`` was raised and the deepest non-torch source line."""
    names = {id(m): n for n, m in model.named_modules()} if isinstance(model, torch.nn.Module) else {}
    module_path: str | None = None
    source: str | None = None
    for frame, lineno in _frames(e):
        owner = frame.f_locals.get("self")
        if isinstance(owner, torch.nn.Module) and id(owner) in names:
            module_path = names[id(owner)] or "<root>"
            module_path = f"{module_path} ({type(owner).__name__})"
        filename = frame.f_code.co_filename
        if not filename.startswith(_TORCH_DIR) and not filename.startswith("<"):
            source = f"{filename}:{lineno}"
            line = _source_line(filename, lineno)
            if line:
                source += f" `{line}`"
    return module_path, source


def _frames(e: BaseException) -> Iterator[tuple[FrameType, int]]:
    """(frame, line) pairs from outermost to where ``e`` was raised."""
    tb: TracebackType | None = e.__traceback__
    while tb is not None:
        yield tb.tb_frame, tb.tb_lineno
        tb = tb.tb_next


def _source_line(filename: str, lineno: int) -> str:
    return linecache.getline(filename, lineno).strip()


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


def _name_of(model: object) -> str:
    if isinstance(model, torch.nn.Module):
        return type(model).__name__
    return getattr(model, "__qualname__", None) or getattr(model, "__name__", None) or repr(model)
