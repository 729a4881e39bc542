"""Capture and profile the Llama-2-70B shape on fake tensors, and report the cost.

Run: ``.venv/bin/python benchmarks/capture_llama70b.py [SEQ]`` (default input idx=int64[1,4096]).

Measured on the 2-core, 23 GiB CPU dev machine (torch 2.13 CPU, transformers 5.24),
input input_ids=int64[1,4096], one run:

    capture: 8.8 s (torch.export), 5836 nodes
    analyses: 1.4 s (graph, FLOPs, saved activations under fake autograd, repeats)
    peak RSS: 0.23 GiB before, 0.44 GiB after capture, 0.45 GiB after analyses
      (/usr/bin/time: 0.47 GiB max RSS, 12.6 s wall for the whole script)
    params: 68,976,648,192 (257.0 GiB at float32)
    forward FLOPs: 6.069e+14 (2 x params x tokens = 5.65e14, plus attention 4 s^2 h l = 4.4e13)
    backward FLOPs: 1.236e+15
    saved activations: 245.5 GiB (batch, fp32, math as captured) + 4.0 MiB (fixed)
    repeated: model.model.layers x80 (LlamaDecoderLayer, 72 nodes/layer)
"""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.models import llama2_70b
from partita.core.model.capture import capture
from partita.core.model.inputs import parse_input_spec
from partita.passes.profile import profile_model


def main(seq: int = 4096) -> None:
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    captured = capture(llama2_70b, [parse_input_spec(f"input_ids=int64[1,{seq}]")], name="Llama-2-70B")
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    start = time.perf_counter()
    profile = profile_model(captured)
    analysis = time.perf_counter() - start
    rss2 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"capture: {captured.seconds:.1f} s ({captured.method}), {profile.num_nodes} nodes")
    print(f"analyses: {analysis:.1f} s")
    print(f"peak RSS: {rss0:.2f} GiB before, {rss1:.2f} GiB after capture, {rss2:.2f} GiB after analyses")
    print(f"params: {profile.num_params:,} ({profile.param_bytes / 2**30:.1f} GiB at {profile.param_dtype})")
    print(f"forward FLOPs: {profile.flops_fwd:.3e}, backward: {profile.flops_bwd:.3e}")
    print(f"saved activations: {profile.saved_bytes_batch / 2**30:.1f} GiB (batch) "
          f"+ {profile.saved_bytes_fixed / 2**20:.1f} MiB (fixed)")
    for block in profile.repeated:
        print(f"repeated: {block.prefix} x{len(block.indices)} ({block.module_type}, "
              f"{block.nodes_per_layer} nodes/layer)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4096)
