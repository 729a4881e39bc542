"""The bottom layer: what planning and running share, importing neither.

The plan's types (plan.py), its file read back against the schema (plan_file.py) and its
verification (verify.py), errors, the options (options.py, pins.py), input specs, the precision
policy and dtype sizes (precision.py), the capture of a model as an FX graph with its loss
(capture.py) and that graph as networkx (graph.py), the cluster's description and presets
(cluster.py), and the rules every layer applies alike: the mesh's rank layout and node crossing
(mesh.py), the pipeline schedules (schedule.py), placements (placement.py), the gradient-bucket
rule (buckets.py) and the tensor-parallel rules (tp/).
``compiler``, ``passes`` and ``runtime`` import from here; nothing here imports them
(tests/unit/test_layers.py checks it).
"""
