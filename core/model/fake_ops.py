"""What capturing on fake tensors needs beyond torch: wider fake kernels, and no side effects.

A model is captured on fake tensors (core/model/capture.py), so an op can be captured only if its fake
(meta) kernel accepts what its real kernel does. ``capturable()`` widens those that do not (once
per process: a meta kernel serves only fake and meta tensors, no real kernel is touched):

- ``aten._grouped_mm`` (the default experts of Hugging Face's Mixtral, OLMoE and Qwen2-MoE): its
  fake kernel checks the CUDA kernel's bf16-only rule, while the CPU kernel (and autocast's bf16 on a
  GPU) takes any floating dtype the two operands share; the shapes are the same either way.

- ``transformers::grouped_mm_fallback`` (what those experts run where torch has no usable
  ``_grouped_mm``: torch 2.11 on CPU): its backward reads the token counts per expert
  (``offs.tolist()``), which fake tensors do not hold, so the planner's backward on fake tensors
  (passes/activations.py) could not run. On fake tensors its backward allocates the two
  gradients the real one allocates and fills, with their shapes; on real tensors it is the
  real one.

``buffers_kept(module)`` puts the real buffers of a user's module back after a probe forward (the
output shape, before the export): batch norm counts batches in place, and planning must not change
the user's model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch


def _grouped_mm_fake(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None = None,
                     bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    from torch._meta_registrations import _create_grouped_mm_output_tensor

    torch._check(mat_a.dtype == mat_b.dtype and mat_a.is_floating_point(),
                 lambda: f"grouped_mm needs two floating operands of one dtype, got {mat_a.dtype} and {mat_b.dtype}")
    torch._check(mat_a.dim() in (2, 3) and mat_b.dim() in (2, 3), lambda: "grouped_mm multiplicands are 2-D or 3-D")
    return _create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype)


_LIBRARY: list[torch.library.Library] = []  # the registration lives as long as the process


_PATCHED: set[str] = set()
_FALLBACK = "transformers::grouped_mm_fallback"


def _shape_only_backward(real: Callable[..., Any]) -> Callable[..., Any]:
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        from torch._subclasses.fake_tensor import is_fake

        if is_fake(grad):
            inputs, weights = ctx.saved_tensors
            return torch.zeros_like(inputs), torch.zeros_like(weights), None
        return real(ctx, grad)

    return backward


def _fallback_backward_on_fakes() -> None:
    """The grouped-matmul fallback's backward on fake tensors (module docstring), once its op exists."""
    import sys

    moe = sys.modules.get("transformers.integrations.moe")
    real = getattr(moe, "_grouped_mm_fallback_backward", None)
    setup = getattr(moe, "_grouped_mm_fallback_setup_context", None)
    if _FALLBACK in _PATCHED or real is None or setup is None:
        return
    try:
        torch.library.register_autograd(_FALLBACK, _shape_only_backward(real), setup_context=setup)
    except (RuntimeError, ValueError, AttributeError):
        return  # another transformers' op: its own backward stays
    _PATCHED.add(_FALLBACK)


@contextlib.contextmanager
def capturable() -> Iterator[None]:
    """Inside the block (and from then on), the widened fake kernels (module docstring) serve fake
    tensors; on a torch whose registry refuses the override, its own fake kernels stay."""
    if not _LIBRARY:
        lib = torch.library.Library("aten", "IMPL")
        try:
            lib.impl("_grouped_mm", _grouped_mm_fake, "Meta", allow_override=True)
        except (RuntimeError, TypeError, AttributeError):
            pass
        _LIBRARY.append(lib)
    _fallback_backward_on_fakes()
    yield


@contextlib.contextmanager
def buffers_kept(module: torch.nn.Module) -> Iterator[None]:
    """The module's real buffers as they were before the block (module docstring)."""
    from torch._subclasses.fake_tensor import FakeTensor

    saved = [(b, b.detach().clone()) for b in module.buffers()
             if not isinstance(b, FakeTensor) and b.device.type != "meta"]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)
