"""A graph captured in fp32 run under a low-precision policy (bf16, fp16): what changes in its nodes.

``Recast`` rewrites the arguments of the casts that were no-ops at capture and of the captured
dtype's limits, so the rank's program (runtime/tp/program.py) computes as an eager forward in the
compute dtype would; ``NORMS`` and ``as_dtype_of`` bring a norm's activation to its weight's dtype.
"""

from __future__ import annotations

import torch
import torch.fx

from partita.core.precision import PrecisionPolicy

# norms and the index of their weight: under a low-precision policy the activation is brought to the
# weight's dtype, as an eager forward in that dtype would have it (autocast leaves norms alone)
NORMS = {"layer_norm": 2, "group_norm": 2, "rms_norm": 2}


class Recast:
    """A graph captured in ``captured`` (the model's floating dtype, fp32) run under a policy that
    computes in ``compute`` (bf16, fp16): its constants follow the compute dtype as an eager forward
    in it would make them. A cast that was a no-op at capture (``x.to(w.dtype)``, a device move
    ``x.to(y.device)``, both recorded with the captured dtype) casts to the compute dtype; the
    captured dtype's limits (``finfo(fp32).min``, the masks' fill) become the compute dtype's,
    which a bf16 tensor can hold. An explicit ``x.float()`` of an fp32 value at capture is such a
    no-op too, and computes in the compute dtype (autocast still runs losses and softmaxes in fp32)."""

    def __init__(self, captured: torch.dtype, compute: torch.dtype) -> None:
        self.captured, self.compute = captured, compute
        lo, hi = torch.finfo(captured), torch.finfo(compute)
        self.limits = {lo.min: hi.min, lo.max: hi.max}

    @classmethod
    def of(cls, graph_module: torch.fx.GraphModule, precision: PrecisionPolicy) -> Recast | None:
        """The recast of ``graph_module``'s program under ``precision``; None where nothing changes."""
        if not precision.low:
            return None
        dtypes = [n.meta["val"].dtype for n in graph_module.graph.nodes
                  if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)
                  and n.meta["val"].is_floating_point()]
        captured = max(set(dtypes), key=dtypes.count) if dtypes else torch.float32
        return cls(captured, precision.param_dtype) if captured != precision.param_dtype else None

    def args(self, n: torch.fx.Node, name: str, args: list, kwargs: dict) -> tuple[list, dict]:
        if name in ("to", "_to_copy") and self._follows(n):
            # a cast that changed nothing at capture (``x.to(w.dtype)``, ``x.to(y.device)``): it follows
            # the compute dtype now, as the eager forward in it would
            if kwargs.get("dtype") == self.captured:
                kwargs = {**kwargs, "dtype": self.compute}
            args = [self.compute if a == self.captured else a for a in args]
        args = [self.limits.get(a, a) if isinstance(a, float) else a for a in args]
        kwargs = {k: self.limits.get(v, v) if isinstance(v, float) else v for k, v in kwargs.items()}
        return args, kwargs

    def _follows(self, n: torch.fx.Node) -> bool:
        """Whether ``n`` casts a tensor of the captured dtype to the captured dtype (a no-op there)."""
        source = n.args[0].meta.get("val") if n.args and isinstance(n.args[0], torch.fx.Node) else None
        out = n.meta.get("val")
        return (isinstance(source, torch.Tensor) and isinstance(out, torch.Tensor)
                and source.dtype == out.dtype == self.captured)


def as_dtype_of(x: torch.Tensor, like: torch.Tensor | None) -> torch.Tensor:
    """``x`` in ``like``'s floating dtype: a norm's activation in its weight's (``NORMS``)."""
    if like is None or not x.is_floating_point() or x.dtype == like.dtype:
        return x
    return x.to(like.dtype)
