"""Hand-built plans with everything today's planner does not decide yet: TP node decisions with col/row/vocab/
heads strategies and reshards, several pipeline stages, ZeRO, 1F1B with micro-batches, many alternatives.

The numbers are plausible, not predictions: the view and diff tests read them back, they do not judge them.
"""

from __future__ import annotations

from partita.core.cluster import PRESETS
from partita.core.mesh import Mesh
from partita.core.plans.plan import (
    Alternative,
    Collective,
    InputLayout,
    MemoryBreakdown,
    ModelInfo,
    NodeDecision,
    ParamDecision,
    Plan,
    Prediction,
    SolverReport,
    Stage,
    Training,
)
from partita.core.plans.verify import verified_plan

R, P = "replicate", "partial"


def synthetic_plan(*, name: str = "llama-70b-synthetic", layers: int = 80, hidden: int = 8192, ffn: int = 28672,
                   vocab: int = 32000, seq: int = 4096, dp: int = 2, tp: int = 8, pp: int = 8,
                   micro_batches: int = 32, zero: int = 1, schedule: str = "1f1b", gpus_per_node: int = 8,
                   rotary_ops: int = 60, alternatives: int = 40, fingerprint: str = "5e7a1c0ffee12345",
                   capacity: int = 72_000_000_000, validate: bool = True) -> Plan:
    """A Llama-like decoder planned over dp x tp x pp; about (17 + rotary_ops) nodes per layer."""
    act = seq * hidden * 2  # one micro-batch's (T, C) activation in bf16
    nodes: list[NodeDecision] = []
    params: list[ParamDecision] = []
    # At tp=1 one rank holds every tensor whole, which a validated plan must say; unvalidated, the
    # tp>1 layouts stay (a baseline that differs from its tp>1 twin in one module only).
    flat = tp == 1 and validate
    layer_stage = [i * pp // layers for i in range(layers)]

    def node(name_: str, op: str, module: str, strategy: str, out: str, ins: list[InputLayout], *,
             layer: str = "", stage: int = 0, flops: int = 0, internal: tuple[str, ...] = ()) -> str:
        if flat:
            strategy, out, internal = R, R, ()
        nodes.append(NodeDecision(name_, op, module, strategy, (out,), tuple(ins), internal, layer, stage, flops,
                                  flops * 3 / 200e12 / tp))
        return name_

    def edge(src: str, have: str, need: str, grad: str = R, grad_need: str = R, nbytes: int = act) -> InputLayout:
        if flat:
            have = need = grad = grad_need = R
        fwd = {(R, R): "none", (P, R): "all_reduce"}.get((have, need), "none" if have == need else
                                                         "slice" if have == R else "all_gather")
        bwd = "all_reduce" if (grad, grad_need) == (P, R) else "none"
        return InputLayout(src, 0, have, need, grad, grad_need, fwd, bwd, nbytes)

    def param(pname: str, shape: tuple[int, ...], tp_layout: str, stage: int) -> None:
        layout = {"tp": R if flat else tp_layout, "dp": "shard(0)" if zero == 3 else R}
        params.append(ParamDecision(pname, shape, "bfloat16", layout, stage))

    param("model.embed_tokens.weight", (vocab, hidden), "shard(0)", 0)
    x = node("embedding", "aten.embedding.default", "model.embed_tokens", "vocab", P, [], stage=0,
             internal=(f"all_reduce:{act}",))
    x = node("embedding_out", "aten.add.Tensor", "model", R, R, [edge(x, P, R)], stage=0)
    cos = node("rotary_cos", "aten.cos.default", "model.rotary_emb", R, R, [], stage=0)
    k = 0
    for i in range(layers):
        L, s = f"model.layers.{i}", layer_stage[i]
        kw = dict(layer=L, stage=s)
        mm = 2 * seq * hidden * hidden

        def n(op: str, mod: str, strategy: str, out: str, ins: list[InputLayout], flops: int = 0,
              L: str = L, kw: dict = kw) -> str:
            nonlocal k
            k += 1
            return node(f"{op.split('.')[1]}_{k}", op, f"{L}.{mod}" if mod else L, strategy, out, ins,
                        flops=flops, **kw)

        for pn in ("input_layernorm", "post_attention_layernorm"):
            param(f"{L}.{pn}.weight", (hidden,), R, s)
        for pn, shape, lay in (("self_attn.q_proj", (hidden, hidden), "shard(0)"),
                               ("self_attn.k_proj", (hidden // 8, hidden), "shard(0)"),
                               ("self_attn.v_proj", (hidden // 8, hidden), "shard(0)"),
                               ("self_attn.o_proj", (hidden, hidden), "shard(1)"),
                               ("mlp.gate_proj", (ffn, hidden), "shard(0)"),
                               ("mlp.up_proj", (ffn, hidden), "shard(0)"),
                               ("mlp.down_proj", (hidden, ffn), "shard(1)")):
            param(f"{L}.{pn}.weight", shape, lay, s)
        # the stage boundary: activations arrive from the previous stage by send/recv (replicated over TP)
        h = n("aten.rms_norm.default", "input_layernorm", R, R, [edge(x, R, R)])
        q = n("aten.linear.default", "self_attn.q_proj", "col", "shard(2)", [edge(h, R, R, P, R)], mm)
        kk = n("aten.linear.default", "self_attn.k_proj", "col", "shard(2)", [edge(h, R, R, P, R)], mm // 8)
        v = n("aten.linear.default", "self_attn.v_proj", "col", "shard(2)", [edge(h, R, R, P, R)], mm // 8)
        for j in range(rotary_ops):  # rotary embedding, casts and views on the heads
            src = q if j % 2 == 0 else kk
            r = n("aten.mul.Tensor", "self_attn", "heads", "shard(2)",
                  [edge(src, "shard(2)", "shard(2)", "shard(2)", "shard(2)"),
                   edge(cos, R, R, "none", "none", seq * 128 * 2)])
            if j % 2 == 0:
                q = r
            else:
                kk = r
        a = n("aten.scaled_dot_product_attention.default", "self_attn", "heads", "shard(2)",
              [edge(q, "shard(2)", "shard(2)", "shard(2)", "shard(2)"),
               edge(kk, "shard(2)", "shard(2)", "shard(2)", "shard(2)"),
               edge(v, "shard(2)", "shard(2)", "shard(2)", "shard(2)")], 4 * seq * seq * hidden)
        o = n("aten.linear.default", "self_attn.o_proj", "row", P,
              [edge(a, "shard(2)", "shard(2)", "shard(2)", "shard(2)")], mm)
        x1 = n("aten.add.Tensor", "", R, R, [edge(x, R, R), edge(o, P, R)])
        h2 = n("aten.rms_norm.default", "post_attention_layernorm", R, R, [edge(x1, R, R)])
        g = n("aten.linear.default", "mlp.gate_proj", "col", "shard(2)", [edge(h2, R, R, P, R)], 2 * seq * hidden * ffn)
        u = n("aten.linear.default", "mlp.up_proj", "col", "shard(2)", [edge(h2, R, R, P, R)], 2 * seq * hidden * ffn)
        g = n("aten.silu.default", "mlp", "shard(2)", "shard(2)",
              [edge(g, "shard(2)", "shard(2)", "shard(2)", "shard(2)")])
        m = n("aten.mul.Tensor", "mlp", "shard(2)", "shard(2)",
              [edge(g, "shard(2)", "shard(2)", "shard(2)", "shard(2)"),
               edge(u, "shard(2)", "shard(2)", "shard(2)", "shard(2)")])
        d = n("aten.linear.default", "mlp.down_proj", "row", P,
              [edge(m, "shard(2)", "shard(2)", "shard(2)", "shard(2)")], 2 * seq * hidden * ffn)
        x = n("aten.add.Tensor", "", R, R, [edge(x1, R, R), edge(d, P, R)])
    last = pp - 1
    param("model.norm.weight", (hidden,), R, last)
    param("lm_head.weight", (vocab, hidden), "shard(0)", last)
    h = node("rms_norm_final", "aten.rms_norm.default", "model.norm", R, R, [edge(x, R, R)], stage=last)
    logits = node("lm_head_linear", "aten.linear.default", "lm_head", "vocab", "shard(2)",
                  [edge(h, R, R, P, R)], stage=last, flops=2 * seq * hidden * vocab)
    node("cross_entropy_loss", "aten.cross_entropy_loss.default", "", "vocab", R,
         [edge(logits, "shard(2)", "shard(2)", "shard(2)", "shard(2)", seq * vocab * 2)], stage=last,
         internal=(f"all_reduce:{seq * 4}", f"all_reduce:{seq * 4}", f"all_reduce:{seq * 4}"))

    n_params = sum(_numel(p.shape) for p in params)
    stage_params = [sum(_numel(p.shape) for p in params if p.stage == s) for s in range(pp)]
    stage_nodes = [[nd for nd in nodes if nd.stage == s] for s in range(pp)]
    per_dev = [sp // tp for sp in stage_params]
    tflops = 200e12
    stages = []
    mems = []
    for s in range(pp):
        fl = sum(nd.flops_fwd for nd in stage_nodes[s])
        fwd = fl / tp / tflops
        state = per_dev[s] * (2 + 2 + (12 // dp if zero >= 1 else 12))
        acts = act * 34 // tp * sum(1 for i in range(layers) if layer_stage[i] == s) * min(pp - s, micro_batches) // 8
        mems.append(MemoryBreakdown(per_dev[s] * 2, per_dev[s] * 2, state - per_dev[s] * 4, acts, capacity))
        stages.append(Stage(
            index=s, nodes=len(stage_nodes[s]), first_node=stage_nodes[s][0].name, last_node=stage_nodes[s][-1].name,
            params=stage_params[s], predicted_time_s=micro_batches * 3 * fwd, memory_bytes=mems[-1].total,
            forward_s=fwd, backward_s=2 * fwd, ranks=tuple(range(s * dp * tp, (s + 1) * dp * tp)),
            modules=_stage_modules(layer_stage, s, layers, pp), send_bytes=act if s < pp - 1 else 0))
    worst = max(mems, key=lambda mb: mb.total)
    fb = max(st.forward_s + st.backward_s for st in stages)
    step = (micro_batches + pp - 1) * fb + 0.05
    B = dp * micro_batches
    total_flops = 6 * n_params * seq * B
    achieved = total_flops / step / (dp * tp * pp)
    predicted = Prediction(step, micro_batches * fb, {"tp_all_reduce": 0.4 * step / 10, "dp_reduce_scatter": 0.02,
                                                       "pp_send_recv": 0.01}, 0.03, worst,
                           {"tp_all_reduce": 4 * act * layers // pp * micro_batches,
                            "dp_reduce_scatter": 2 * max(per_dev) * 2},
                           B / step, B * seq / step, achieved / 1e12, achieved / 312e12)
    training = Training(global_batch=B, micro_batch_size=1, grad_accum_steps=micro_batches, precision="bf16-mixed",
                        optimizer="adamw", zero_stage=zero, schedule=schedule)
    mesh = Mesh(dp=dp, tp=tp, pp=pp)
    alts = [Alternative(mesh, 1, micro_batches, zero, step, worst.total, True, True,
                        "chosen: fastest predicted step that fits")]
    for j in range(alternatives - 1):
        t2, p2 = (1, 2, 4, 8)[j % 4], (1, 2, 4, 8, 16)[(j // 4) % 5]
        d2 = max(1, dp * tp * pp // (t2 * p2))
        fits = j % 3 != 0
        mem = int(worst.total * (1.0 + 0.15 * (j % 7)) if fits else capacity * (1.1 + 0.05 * (j % 5)))
        alts.append(Alternative(Mesh(d2, t2, p2), 1, max(1, B // d2), (0, 1, 2, 3)[j % 4],
                                step * (1.05 + 0.07 * j) if fits else None, mem, fits, False,
                                f"{1.05 + 0.07 * j:.2f}x slower: more pipeline bubble" if fits else
                                f"does not fit: {mem / 1e9:.1f} GB per device > {capacity / 1e9:.1f} GB usable"))
    plan = Plan(
        model=ModelInfo(name, fingerprint, n_params, n_params * 2, (f"idx=int64[{B},{seq}]",), "torch.export",
                        len(nodes), (f"model.layers x{layers} (LlamaDecoderLayer)",), f"targets=int64[{B},{seq}]",
                        "default_loss"),
        cluster=PRESETS["dgx-a100"].with_devices(gpus_per_node).with_nodes(-(-dp * tp * pp // gpus_per_node)).to_dict(),
        mesh=mesh, training=training, predicted=predicted,
        solver=SolverReport("CP-SAT", "OPTIMAL", step, 12.5, alternatives, 0.0, ("synthetic plan for tests",)),
        params=tuple(params), nodes=tuple(nodes),
        collectives=(
            Collective("all_reduce", "tp", act, 4 * layers // pp * micro_batches, tp,
                       "tensor-parallel activations", 0.04),
            Collective("reduce_scatter", "dp", max(per_dev) * 2, 1, dp, "gradient reduce-scatter (ZeRO)", 0.02),
            Collective("all_gather", "dp", max(per_dev) * 2, 1, dp, "parameter all-gather after the step (ZeRO)", 0.02),
            Collective("send_recv", "pp", act, 2 * micro_batches, 2, "activations and gradients between stages", 0.01),
        ),
        stages=tuple(stages), alternatives=tuple(alts),
    )
    # Everything the view reads must survive the file format (checking it takes seconds on a 70B plan).
    return verified_plan(plan.to_dict(), source="synthetic plan") if validate else plan


def _stage_modules(layer_stage: list[int], s: int, layers: int, pp: int) -> tuple[str, ...]:
    idx = [i for i in range(layers) if layer_stage[i] == s]
    mods = [f"model.layers.{idx[0]}-{idx[-1]}"] if idx else []
    if s == 0:
        mods.insert(0, "model.embed_tokens")
    if s == pp - 1:
        mods += ["model.norm", "lm_head"]
    return tuple(mods)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def llama70b_plan(**kw) -> Plan:
    """The size the view must handle: 80 layers, ~6,000 nodes, ~12,000 input edges, 723 params."""
    return synthetic_plan(**kw)


def gpt3_175b_plan(**kw) -> Plan:
    """GPT-3-175B-like on 128 GPUs: tp=8, pp=8, dp=2, 1F1B with 32 micro-batches, ZeRO-1."""
    args = dict(name="gpt3-175b-synthetic", layers=96, hidden=12288, ffn=49152, vocab=50304, seq=2048,
                dp=2, tp=8, pp=8, micro_batches=32, rotary_ops=8, fingerprint="175b175b175b175b")
    return synthetic_plan(**{**args, **kw})


def small_plan(**kw) -> Plan:
    """Four layers over dp=2 x tp=2 x pp=2 on 2 nodes of 4 GPUs: small enough to read every number back."""
    args = dict(name="llama-tiny-synthetic", layers=4, hidden=256, ffn=688, vocab=1000, seq=128, dp=2, tp=2, pp=2,
                micro_batches=4, gpus_per_node=4, rotary_ops=2, alternatives=6, fingerprint="abcdefabcdef0001",
                capacity=8_000_000_000)
    return synthetic_plan(**{**args, **kw})
