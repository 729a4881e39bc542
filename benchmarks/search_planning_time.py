"""Planning time end to end: ``compile_model`` from the model factory to the plan file written.

Run: ``.venv/bin/python benchmarks/search_planning_time.py [CASE ...]`` (case indices; all by
default). Each model is a fake-tensor capture (no memory), bf16 mixed precision, AdamW (none
for inference), on DGX A100 nodes (Mixtral on DGX H100 nodes). Every figure is the process's CPU
time (``time.process_time``: what the planner costs, whatever else the machine runs), imports
excluded: the model's own (transformers) and the capture's (torch.export, dynamo) are done before
the clock starts; the last column also gives the wall time. Columns: the captures (seconds, count:
a batch above 1 needs a second one for each tensor's shape as a function of the batch), the
analysis (``profile_model``), the joint search (``plan_search``: every TP ILP, every cut DP, every
ZeRO stage weighed; "solved / pruned groups" counts the candidates costed and the pipeline (p,
micro-batch) groups branch and bound left uncut), and, of the solvers alone, one TP ILP and one
cut DP at the chosen plan's settings (timed after the run, wall).

Results and the figures before this version are in the README's "Planning time" section.
"""

from __future__ import annotations

import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import partita.compiler.compile as compile_module
from examples.models import GPT, GPTConfig, LogitsOnly, hf_llama, llama2_70b
from partita.compiler.compile import compile_model
from partita.core.cluster import PRESETS
from partita.core.model.inputs import parse_input_spec
from partita.core.options import Options
from partita.passes.cost_model import state_bytes_per_param
from partita.passes.pipeline.costs import kv_ratio
from partita.passes.pipeline.cuts import Partition, StageSetup, solve_cuts
from partita.passes.pipeline.stages import stage_links
from partita.passes.tp.ilp import solve_tp
from partita.passes.tp.layout_costs import tp_node_costs
from partita.passes.tp.problem import TPSetting, build_problem


def llama2_7b():
    return hf_llama(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, intermediate_size=11008,
                    vocab_size=32000)


def gpt3_175b():
    return GPT(GPTConfig(vocab_size=50257, block_size=2048, n_layer=96, n_head=96, n_embd=12288))


def mixtral_8x7b():
    """Mixtral 8x7B's shape (Jiang et al. 2024): 32 layers, hidden 4096, 32 heads (8 KV), 8 experts of FFN
    14336 each, 2 per token, vocab 32000: 46.7B parameters. Built under fake tensors only."""
    import transformers as tf

    return LogitsOnly(tf.MixtralForCausalLM(tf.MixtralConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, use_cache=False)))


CASES = [  # name, factory, input, GPUs, global batch (sequences), inference, new tokens, preset
    ("Llama-2-7B", llama2_7b, "input_ids=int64[1,4096]", 8, 64),
    ("Llama-2-70B", llama2_70b, "input_ids=int64[1,4096]", 64, 512),
    ("GPT-3 175B", gpt3_175b, "idx=int64[1,2048]", 1024, 1536),
    ("Llama-2-7B", llama2_7b, "input_ids=int64[16,2048]", 4, 16, True, 128),  # inference, 128 new tokens
    ("Mixtral 8x7B", mixtral_8x7b, "input_ids=int64[1,4096]", 32, 256, False, 0, "dgx-h100"),
]


def run(name, factory, spec, gpus, batch, inference=False, generate=0, preset="dgx-a100"):
    spec = parse_input_spec(spec)
    cluster = PRESETS[preset].with_nodes(max(gpus // 8, 1))
    if gpus < 8:
        cluster = cluster.with_devices(gpus)
    cpu: dict[str, list[float]] = {"capture": [], "analysis": [], "search": []}
    counted = {k: getattr(compile_module, f) for k, f in (("capture", "capture"), ("analysis", "profile_model"),
                                                         ("search", "plan_search"))}

    def counting(part):
        def timed(*args, **kwargs):
            t = time.process_time()
            try:
                return counted[part](*args, **kwargs)
            finally:
                cpu[part].append(time.process_time() - t)
        return timed

    for part, f in (("capture", "capture"), ("analysis", "profile_model"), ("search", "plan_search")):
        setattr(compile_module, f, counting(part))
    t, wall = time.process_time(), time.perf_counter()
    options = Options(inputs=[spec], cluster=cluster, batch=batch, precision="bf16-mixed", inference=inference,
                      generate=generate)
    try:
        result = compile_model(factory, options, name=name)
        with tempfile.TemporaryDirectory() as tmp:
            result.plan.save(Path(tmp) / "plan.json")
    finally:
        for part, f in (("capture", "capture"), ("analysis", "profile_model"), ("search", "plan_search")):
            setattr(compile_module, f, counted[part])
    total, wall = time.process_time() - t, time.perf_counter() - wall
    captures = cpu["capture"]
    d, profile, request = result.decision, result.profile, result.request
    tp, pp, dp = d.mesh.tp, d.mesh.pp, d.mesh.dp
    mb, m = d.micro_batch_size, d.grad_accum_steps
    t = time.perf_counter()
    setting = TPSetting(tp, mb, profile.batch_size, request.precision, request.optimizer, inference,
                        memory_budget=cluster.usable_memory if pp == 1 else math.inf, dp=dp, grad_accum=m,
                        zero_stage=d.zero_stage, kv_ratio=kv_ratio(profile, request),
                        captured_dtype=profile.param_dtype)
    ilp = solve_tp(build_problem(profile.graph, setting, cluster, repeated=profile.repeated))
    one_ilp = time.perf_counter() - t
    one_dp = "-"
    if pp > 1:
        costs = tp_node_costs(profile, cluster, request, mb, tp)
        v = d.chunks
        setup = StageSetup(pp * v, m, d.schedule, stage_links(cluster, pp, dp, tp, v),
                           cluster.usable_memory // v, state_bytes_per_param(request.precision, request.optimizer),
                           d.zero_stage, dp, chunks=v)
        t = time.perf_counter()
        solve_cuts(Partition(costs, setup, cluster))
        one_dp = f"{(time.perf_counter() - t) * 1e3:.0f} ms"
    shape = "x".join(str(x) for x in spec.shape)
    return [
        f"{name}{' inference' if inference else ''} [{shape}]", str(gpus), str(batch), str(profile.num_nodes),
        f"{sum(captures):.1f} s ({len(captures)})",
        f"{sum(cpu['analysis']):.1f} s", f"{sum(cpu['search']):.1f} s", f"{d.candidates} / {d.pruned}",
        (f"{one_ilp * 1e3:.0f} ms ({ilp.report.variables} vars)" if ilp.report.variables
         else "no solve (one choice per node)"), one_dp, f"{total:.1f} s ({wall:.1f} s wall)",
        f"dp={dp} tp={tp} pp={pp} ZeRO-{d.zero_stage}, mb={mb} x {m} {d.schedule}, "
        f"step {d.step_s:.2f} s",
    ]


def warm_model_imports() -> None:
    """Import the models' own code (transformers' Llama and Mixtral) and the capture's (torch.export,
    dynamo) before timing: the issue's figures are of planning, imports excluded."""
    import torch._dynamo
    import torch.export  # noqa: F401
    import transformers.models.llama.modeling_llama
    import transformers.models.mixtral.modeling_mixtral  # noqa: F401


def main() -> None:
    warm_model_imports()
    head = ["model", "GPUs", "batch", "graph nodes", "captures (count)", "analysis", "joint search",
            "solved / pruned groups", "one TP ILP", "one cut DP", "capture to plan file (CPU)", "chosen"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    picked = [int(a) for a in sys.argv[1:]] or range(len(CASES))
    for i in picked:
        print("| " + " | ".join(run(*CASES[i])) + " |", flush=True)


if __name__ == "__main__":
    main()
