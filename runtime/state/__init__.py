"""A run's state on disk: pretrained weights in (``weights``), sharded checkpoints (``sharded``:
the state in the whole tensors' coordinates and its save; ``loading``; ``marker``: the completion
marker and its digests; ``fingerprint``; ``periodic``: checkpoint_dir, retention, resuming;
``checkpoints``: a run's checkpoints as ``ParallelModel`` keeps them; ``lock``: a checkpoint
directory held by one run) and the whole model's state dict gathered from the ranks (``full``)."""
