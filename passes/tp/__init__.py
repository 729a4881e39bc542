"""The tensor-parallel axis's planner: the ILP's input (``problem``, priced by ``costs``), the ILP
(``ilp``), and the (dp, tp) mesh chosen over its solutions (``mesh``)."""
