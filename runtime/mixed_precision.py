"""Where a plan's precision policy (core/precision.py) lands in the runtime.

``apply_mixed_precision`` is compose's precision step (runtime/compose.py): the
parameters cast to the policy's ``param_dtype`` once tensor and pipeline
parallelism have made them this rank's, before data parallelism or ZeRO lay
out their gradient buckets in that dtype; it returns fp16's loss scaler. The
forward's autocast is the policy's too: the TP program and the pipeline stage
are built with the policy (their forward runs under ``policy.autocast``,
activations cross stages in ``policy.wire``), the eager loss is wrapped in it
by compose; gradients are reduced in ``policy.reduce_dtype``
(runtime/dp/buckets.py).

``MasterWeights`` is the one optimizer a plan's rank steps. Under a mixed policy
it holds an fp32 master copy of each parameter it updates (a plain parameter,
a ZeRO flat shard or a parameter tied across stages) and builds the user's
optimizer on the masters, so the optimizer's state is fp32 too; ``step``
upcasts each low-precision gradient into its master's ``.grad`` (unscaled
under fp16), steps, and casts the masters back into the parameters, a bucket
of masters at a time (no fp32 gradient of the whole model is held). Under
``fp32`` (and pure ``bf16``) the masters are the parameters themselves and
``step`` is the optimizer's. With ``offload`` (the plan's ``training.offload``, ZeRO-Offload's
split) the masters, and so the optimizer's state, live in host memory whatever the policy: each
chunk's gradients go down to them, the host steps, and the parameters take the masters' values.

``LossScaler`` is fp16's dynamic loss scale: the loss is multiplied by it
before backward; a step whose global gradient norm (runtime/grad_norm.py, one
all-reduce over the world) is inf or nan is skipped on every rank alike; the scale halves on such a
step and doubles after
``growth_interval`` clean ones, as ``torch.amp.GradScaler`` does. Under every other policy it is
a fixed scale of 1 that skips nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn
from torch.optim import Optimizer

from partita.core.buckets import DEFAULT_BUCKET_BYTES, pack_buckets
from partita.core.precision import PrecisionPolicy

# the user's optimizer, built on what it updates (the one definition)
OptimizerFactory = Callable[[Iterable[nn.Parameter]], Optimizer]


def kept_whole(module: nn.Module) -> set[str]:
    """The parameters a low-precision policy leaves in their own dtype: those of modules that hold
    floating buffers (batch norm's weight and bias beside its running statistics, which keep their
    dtype: batch norm then runs in mixed type, a low-precision input against full-precision
    statistics and affine parameters, as apex's ``keep_batchnorm_fp32`` does)."""
    out = set()
    for prefix, m in module.named_modules():
        if any(b is not None and b.is_floating_point() for b in m.buffers(recurse=False)):
            out |= {f"{prefix}.{n}" if prefix else n for n, _ in m.named_parameters(recurse=False)}
    return out


def cast_parameters(params: Iterable[tuple[str, nn.Parameter]], policy: PrecisionPolicy,
                    keep: set[str] = frozenset()) -> None:
    """The floating parameters in the policy's ``param_dtype``, in place (the same Parameter
    objects, so hooks and tied names stay), but those named in ``keep`` (``kept_whole``). Buffers
    keep their dtype, as FSDP2's."""
    with torch.no_grad():
        for name, p in params:
            if p.is_floating_point() and p.dtype != policy.param_dtype and name not in keep:
                p.data = p.data.to(policy.param_dtype)


def apply_mixed_precision(params: Iterable[tuple[str, nn.Parameter]], policy: PrecisionPolicy, *, training: bool,
                          keep: set[str] = frozenset()) -> LossScaler:
    """Compose's precision step: the parameters (by their names in the model) in the policy's dtype
    (``cast_parameters``); the loss scaler, dynamic for a training step under fp16."""
    cast_parameters(params, policy, keep)
    return LossScaler(policy, dynamic=training)


class MasterWeights:
    """The user's optimizer on fp32 masters of ``params`` (module docstring)."""

    def __init__(self, params: Iterable[nn.Parameter], factory: OptimizerFactory, policy: PrecisionPolicy, *,
                 chunk_bytes: int = DEFAULT_BUCKET_BYTES, offload: bool = False) -> None:
        self.params = list(params)
        self.policy = policy
        self.chunk_bytes = chunk_bytes  # the most fp32 master gradient ``step`` holds at once (a gradient bucket's cap)
        self.offload = offload
        self.separate = offload or any(p.dtype != policy.master_dtype for p in self.params)
        if self.separate:
            self.masters = [nn.Parameter(_master(p, policy.master_dtype, offload)) for p in self.params]
        else:
            self.masters = self.params
        self._master_of = {id(p): m for p, m in zip(self.params, self.masters)}
        self.optimizer = factory(self.masters)

    def master_of(self, p: torch.Tensor) -> torch.Tensor:
        """The tensor the optimizer updates for ``p`` (``p`` itself unless mixed)."""
        return self._master_of.get(id(p), p)

    def grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params if p.grad is not None]

    @torch.no_grad()
    def step(self, inv_scale: float = 1.0, reduced: Mapping[int, torch.Tensor] | None = None) -> None:
        """One optimizer step from the parameters' gradients (times ``inv_scale``); ``reduced``:
        a parameter's mean gradient by ``id`` where the reducer kept it (in the masters' dtype, it
        is the master's gradient as it is)."""
        if not self.separate:
            for p in self.params:  # a mean kept in another dtype (fp32 parameters reduced in bf16)
                if reduced and id(p) in reduced:
                    p.grad.copy_(reduced[id(p)])
            if inv_scale != 1.0:
                torch._foreach_mul_(self.grads(), inv_scale)
            self.optimizer.step()
            return
        reduced = reduced or {}
        # The masters' fp32 gradients are made a chunk at a time (the gradient buckets' rule and
        # cap), each chunk stepped and freed before the next: the cost model's 16 bytes a
        # parameter hold no fp32 gradient of the whole model (made at once, they added 4 bytes a
        # parameter at the step's peak: 2 under ZeRO-1 at dp=2). The optimizer steps only the
        # masters whose ``.grad`` is set, each once per step, and is elementwise (AdamW, Adam,
        # SGD), so stepping by chunks is the same update as one step over all; the optimizer's
        # ``step`` (and a hook on it) runs once per chunk.
        for chunk in pack_buckets([m.numel() * m.element_size() for m in self.masters], self.chunk_bytes):
            self._step_chunk(chunk, inv_scale, reduced)

    def _step_chunk(self, chunk: list[int], inv_scale: float, reduced: Mapping[int, torch.Tensor]) -> None:
        """The optimizer's step on the masters ``chunk`` indexes, their fp32 gradients held only
        for it (no reference outlives the call), then the parameters take the masters' values."""
        grads = []
        for i in chunk:
            g = reduced.get(id(self.params[i]), self.params[i].grad)
            m = self.masters[i]
            self.masters[i].grad = None if g is None else g.to(device=m.device, dtype=m.dtype)  # down to the host
            if g is not None:
                grads.append(self.masters[i].grad)
        if not grads:
            return
        if inv_scale != 1.0:  # a loss scale to undo (fp16); bf16's 1.0 costs no pass over the gradients
            torch._foreach_mul_(grads, inv_scale)
        self.optimizer.step()
        for i in chunk:
            self.masters[i].grad = None
        self._refresh([self.params[i] for i in chunk], [self.masters[i] for i in chunk])

    def _refresh(self, params: list[torch.Tensor], masters: list[torch.Tensor]) -> None:
        """The parameters take the masters' values: in one foreach copy on the device (not a kernel a
        parameter); up from the host one by one, without waiting for each copy to land."""
        if not self.offload:
            torch._foreach_copy_(params, masters)
            return
        for p, m in zip(params, masters):
            p.copy_(m, non_blocking=True)

    @torch.no_grad()
    def masters_to_params(self) -> None:
        """After loading into the masters: the parameters take their values."""
        if self.separate:
            self._refresh(self.params, self.masters)

    def master_bytes(self) -> int:
        """Bytes of the fp32 masters (0 when they are the parameters)."""
        return sum(m.numel() * m.element_size() for m in self.masters) if self.separate else 0


def _master(p: torch.Tensor, dtype: torch.dtype, offload: bool) -> torch.Tensor:
    """A master copy of ``p`` in ``dtype``: on its device, or in host memory (page-locked where the
    device is a GPU, so the copies up run without staging)."""
    if not offload:
        return p.detach().to(dtype, copy=True)
    host = p.detach().to(device="cpu", dtype=dtype, copy=True)
    return host.pin_memory() if p.device.type == "cuda" else host


class LossScaler:
    """fp16's dynamic loss scale, or (``dynamic`` off, or another policy) a fixed 1 (module docstring)."""

    def __init__(self, policy: PrecisionPolicy, *, dynamic: bool = True) -> None:
        self.dynamic = dynamic and policy.loss_scaling
        self.scale = policy.init_scale if self.dynamic else 1.0
        self.growth_interval = policy.growth_interval
        self.clean = 0
        self.skipped = 0

    def overflowed(self, grad_norm: float) -> bool:
        """Whether a step with this global gradient norm is skipped (fp16: inf or nan)."""
        return self.dynamic and not math.isfinite(grad_norm)

    def update(self, found_inf: bool) -> None:
        if not self.dynamic:
            return
        if found_inf:
            self.scale /= 2.0
            self.clean = 0
            self.skipped += 1
            return
        self.clean += 1
        if self.clean >= self.growth_interval:
            self.scale *= 2.0
            self.clean = 0
