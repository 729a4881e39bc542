"""Tensor parallelism's rules, which the planner chooses by and the runtime checks and runs by.

``vocabulary`` (placements, strategies, reshards), ``rules`` and ``view_rules`` (what each
ATen op offers), ``strategies`` (a node's candidates on the graph) and ``layout`` (a choice of
strategy per node made into the plan's node decisions and collectives).
"""
