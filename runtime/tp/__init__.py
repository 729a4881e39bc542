"""Tensor parallelism on a rank: the local program over parameter shards (``module``), its
collectives (``collectives``), the ops with local rules (``local_ops``), activation
recomputation (``recompute``) and the per-rank program generated from the plan (``program``)."""
