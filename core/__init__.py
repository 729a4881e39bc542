"""The bottom layer: what planning and running share, importing neither.

The plan's types and schema (plan.py), errors, input specs, the precision
policy and dtype sizes, the capture of a model as an FX graph with its loss,
and the rules every layer applies alike: the mesh's rank layout and node
crossing (mesh.py), the pipeline schedules (schedule.py), placements and their
parser (placement.py), the gradient-bucket rule (buckets.py) and the dtype sizes
(precision.py). ``compiler``, ``passes`` and ``runtime``
import from here; nothing here imports them (tests/test_layers.py checks it).
"""
