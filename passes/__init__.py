"""Analyses over the captured graph and the solvers that decide a plan. Never touches torch.distributed."""
