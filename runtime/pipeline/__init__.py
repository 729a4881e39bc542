"""Pipeline parallelism on a rank: its stage of the training graph and the schedule (``stage``)."""
