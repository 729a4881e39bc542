"""The pipeline axis's planner: the order and costs (``costs``), the exact cut solver (``cuts``),
the bound that prunes the search (``bounds``), the decision and its explanation (``decision``)
and the search over stages, micro-batches and schedules (``stages``)."""
