"""Executes a plan on each rank with torch.distributed. Never imports the solvers."""
