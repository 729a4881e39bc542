"""The bottom layer: what planning and running share, importing neither.

The plan's types and schema (plan.py), errors, input specs, the precision
policy and dtype sizes, the capture of a model as an FX graph with its loss,
and the rules every layer applies alike: the mesh's rank layout (mesh.py) and
the pipeline schedules (schedule.py). ``compiler``, ``passes`` and ``runtime``
import from here; nothing here imports them (tests/test_layers.py checks it).
"""
