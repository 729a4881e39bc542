"""A run's state on disk: pretrained weights in (``weights``), sharded checkpoints (``sharded``)
and the whole model's state dict gathered from the ranks (``full``)."""
