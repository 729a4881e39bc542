"""The one optimizer step of a training step, the same call whatever the plan: the global gradient norm
(runtime/grad_norm.py), clipping by it, fp16's loss scale and its skipped steps
(runtime/mixed_precision.py ``LossScaler``), the update through the gradient sync
(runtime/step/sync.py) and the user's LR scheduler.
"""

from __future__ import annotations

from partita.runtime.grad_norm import clip_coefficient, global_grad_norm
from partita.runtime.program import Program


class OptimizerStep:
    """The one optimizer's step on every rank, or on none, and what it measured (``grad_norm``, ``lr``)."""

    def __init__(self, program: Program) -> None:
        self.program = program
        self.scaler = program.scaler
        self.grad_norm = float("nan")  # the last step's global gradient norm (before clipping)
        self.lr = float("nan")  # the learning rate the last step's update used

    @property
    def loss_scale(self) -> float:
        """What the loss is multiplied by before backward (fp16's dynamic scale, else 1)."""
        return self.scaler.scale

    def __call__(self, *, skip: bool = False) -> None:
        """The step, or none (``skip``: a loss that was not finite; fp16: an inf or nan gradient on
        any rank); clipped to the plan's ``max_grad_norm`` by the global gradient norm, whose
        all-reduce also tells every rank whether any gradient overflowed or was never reached. The
        gradients are dropped either way."""
        p, sync = self.program, self.program.sync
        inv_scale = 1.0 / self.loss_scale
        reduced = sync.reduced_grads()
        norm = global_grad_norm(p, p.plan.mesh.tp, p.ctx.device, inv_scale, reduced,
                                unreached_here=sync.unreached_here())
        self.grad_norm = norm.norm
        # a parameter no rank's backward reached keeps no gradient, as in one process (runtime/dp/buckets.py)
        frozen = sync.leave_unreached(reduced) if norm.unreached else []
        skip = skip or self.scaler.overflowed(self.grad_norm)
        self.lr = float(p.optimizer.param_groups[0]["lr"])
        inv_scale *= clip_coefficient(self.grad_norm, p.plan.training.max_grad_norm)
        if not skip:
            sync.step(inv_scale, reduced, frozen)
        sync.zero_grad()
        if p.scheduler is not None and not skip:  # a step left out leaves the schedule where it was
            p.scheduler.step()
        self.scaler.update(skip)

    @property
    def skipped_steps(self) -> int:
        """fp16: steps skipped for an inf or nan gradient (the loss scale halved)."""
        return self.scaler.skipped
