"""Tensor parallelism on a rank: the local program over parameter shards (``module``), its
collectives (``collectives``), the ops with local rules (``local_ops``), activation
recomputation (``recompute``) and the node-by-node runner (``interpreter``)."""
