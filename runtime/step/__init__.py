"""A training step's parts: the gradient sync over "dp" (``sync``), the one micro-batch loop over a
stage (``schedule``, ``stages``), the optimizer step (``optimizer``) and the step itself (``training``),
which ``ParallelModel`` (runtime/engine.py) composes. docs/runtime.md, "A training step"."""
