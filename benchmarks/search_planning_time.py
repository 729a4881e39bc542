"""Planning time of the joint search (dp, tp, pp, ZeRO, micro-batches, schedule, cuts), end to end.

Run: ``.venv/bin/python benchmarks/search_planning_time.py``. Each model is a
fake-tensor capture (no memory), bf16 mixed precision, AdamW, on DGX A100
nodes. Timed parts: capture (torch.export under FakeTensorMode), analysis
(``profile_model``), the joint search (``plan_search``: every TP ILP, every
cut DP, every ZeRO stage weighed), and, of the solvers alone, one TP ILP
(build + CBC solve) and one cut DP at the chosen plan's (tp, micro-batch) and
(p, m) (at pp > 1 the ILP is solved by time alone, as ``tp_choice`` does: the
cut DP checks each stage's memory).

Measured on the 2-core CPU dev machine (torch 2.13 CPU), one run each, ZeRO 0-3
weighed at every tp and pp, while other work shared the machine (upper bounds).
"solved / pruned groups" counts the candidates costed and the pipeline (p,
micro-batch) groups branch and bound left uncut (passes/pipeline_parallel.PipelineBound);
``plan_search(prune=False)`` took 9.7 s, 47.4 s and 107.4 s (155, 331 and 644
candidates) for the same three plans:

| model | GPUs | batch | graph nodes | capture | analysis | joint search | solved / pruned groups | one TP ILP | one cut DP | end to end | chosen |
|---|---|---|---|---|---|---|---|---|---|---|---|
| Llama-2-7B [1,4096] | 8 | 64 | 2192 | 10.5 s | 0.8 s | 7.5 s | 68 / 46 | 48 ms (317 vars) | - | 18.8 s | dp=8 tp=1 pp=1 ZeRO-1, mb=1 x 8 none, step 7.18 s |
| Llama-2-70B [1,4096] | 64 | 512 | 5840 | 11.5 s | 2.0 s | 7.2 s | 131 / 170 | 175 ms (2408 vars) | 10 ms | 20.7 s | dp=1 tp=4 pp=16 ZeRO-0, mb=1 x 512 1f1b, step 79.04 s |
| GPT-3 175B [1,2048] | 1024 | 1536 | 3666 | 5.9 s | 1.3 s | 5.1 s | 120 / 422 | 77 ms (741 vars) | 13 ms | 12.4 s | dp=32 tp=4 pp=8 ZeRO-1, mb=1 x 48 1f1b, step 20.09 s |

With pruning the pipeline side is a few dozen cut DPs; at 7B the pp = 1 mesh search
(one TP ILP per tp, micro-batch and ZeRO stage weighed) is most of what is left.
"""

from __future__ import annotations

import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.models import GPT, GPTConfig, hf_llama, llama2_70b  # noqa: E402
import partita.compiler.compile as compile_module  # noqa: E402
from partita.compiler.compile import compile_model  # noqa: E402
from partita.core.inputs import parse_input_spec  # noqa: E402
from partita.passes.cluster import PRESETS  # noqa: E402
from partita.passes.cost_model import state_bytes_per_param  # noqa: E402
from partita.passes.pipeline_costs import kv_ratio  # noqa: E402
from partita.passes.pipeline_cuts import Partition, StageSetup, solve_cuts  # noqa: E402
from partita.passes.pipeline_parallel import stage_links  # noqa: E402
from partita.passes.search import tp_node_costs  # noqa: E402
from partita.passes.tp_ilp import solve_tp  # noqa: E402
from partita.passes.tp_problem import TPSetting, build_problem  # noqa: E402


def llama2_7b():
    return hf_llama(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, intermediate_size=11008,
                    vocab_size=32000)


def gpt3_175b():
    return GPT(GPTConfig(vocab_size=50257, block_size=2048, n_layer=96, n_head=96, n_embd=12288))


CASES = [  # name, factory, input, GPUs, global batch (sequences)
    ("Llama-2-7B", llama2_7b, "input_ids=int64[1,4096]", 8, 64),
    ("Llama-2-70B", llama2_70b, "input_ids=int64[1,4096]", 64, 512),
    ("GPT-3 175B", gpt3_175b, "idx=int64[1,2048]", 1024, 1536),
    ("Llama-2-7B", llama2_7b, "input_ids=int64[16,2048]", 4, 16, True, 128),  # inference, 128 new tokens
]


def run(name, factory, spec, gpus, batch, inference=False, generate=0):
    spec = parse_input_spec(spec)
    cluster = PRESETS["dgx-a100"].with_nodes(max(gpus // 8, 1))
    if gpus < 8:
        cluster = cluster.with_devices(gpus)
    captures = []
    counted = compile_module.capture

    def counting(*args, **kwargs):
        t = time.perf_counter()
        try:
            return counted(*args, **kwargs)
        finally:
            captures.append(time.perf_counter() - t)

    compile_module.capture = counting
    t = time.perf_counter()
    result = compile_model(factory, [spec], cluster, global_batch=batch, precision="bf16-mixed",
                           inference=inference, generate=generate, name=name)
    with tempfile.TemporaryDirectory() as tmp:
        result.plan.save(Path(tmp) / "plan.json")
    total = time.perf_counter() - t
    compile_module.capture = counted
    timings = result.plan.analysis_seconds
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
        setup = StageSetup(pp, m, d.schedule, stage_links(cluster, pp, dp, tp),
                           cluster.usable_memory, state_bytes_per_param(request.precision, request.optimizer),
                           d.zero_stage, dp)
        t = time.perf_counter()
        solve_cuts(Partition(costs, setup, cluster))
        one_dp = f"{(time.perf_counter() - t) * 1e3:.0f} ms"
    shape = "x".join(str(x) for x in spec.shape)
    return [
        f"{name}{' inference' if inference else ''} [{shape}]", str(gpus), str(batch), str(profile.num_nodes),
        f"{sum(captures):.1f} s ({len(captures)})",
        f"{timings['analysis']:.1f} s", f"{timings['solve']:.1f} s", f"{d.candidates} / {d.pruned}",
        (f"{one_ilp * 1e3:.0f} ms ({ilp.report.variables} vars)" if ilp.report.variables
         else "no solve (one choice per node)"), one_dp, f"{total:.1f} s",
        f"dp={dp} tp={tp} pp={pp} ZeRO-{d.zero_stage}, mb={mb} x {m} {d.schedule}, "
        f"step {d.step_s:.2f} s",
    ]


def warm_model_imports() -> None:
    """Import the models' own code (transformers' Llama) before timing: a user has imported the
    model they plan. partita's own lazy imports (torch.export, dynamo) stay in the timed capture."""
    import transformers.models.llama.modeling_llama  # noqa: F401


def main() -> None:
    warm_model_imports()
    head = ["model", "GPUs", "batch", "graph nodes", "captures (count)", "analysis", "joint search",
            "solved / pruned groups", "one TP ILP", "one cut DP", "capture to plan file", "chosen"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    picked = [int(a) for a in sys.argv[1:]] or range(len(CASES))
    for i in picked:
        print("| " + " | ".join(run(*CASES[i])) + " |", flush=True)


if __name__ == "__main__":
    main()
