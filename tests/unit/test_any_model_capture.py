"""Capturing models as users write them (issue 27), single-process checks; the training matrix is
test_any_model.py: planning leaves the user's module as it was, a bare Hugging Face causal LM plans
for inference and `partita estimate` (its KV cache object is no graph output: captured with
``use_cache=False``), Mixtral with its default experts captures (grouped matmuls on fake tensors),
and a graph captured in fp32 runs its constants in the compute dtype under bf16."""

from __future__ import annotations

import torch

from examples.models import SmallCNN
from partita.compiler.cli import main
from partita.compiler.compile import compile_model
from partita.core.model.capture import capture
from partita.core.model.inputs import parse_input_spec
from partita.core.options import Options
from partita.runtime.tp.recast import Recast


def _causal_lm():
    import transformers as tf

    return tf.AutoModelForCausalLM.from_config(tf.Qwen2Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2))


def test_planning_changes_nothing_of_the_users_module():
    model = SmallCNN()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    compile_model(model, Options(inputs=["x=float32[4,3,32,32]"], cluster="local", devices=2, world_size=2, dp=2))
    after = model.state_dict()
    # batch norm counts the batches a forward sees: the probe of the output's shape ran one
    assert [k for k in before if not torch.equal(before[k], after[k])] == []


def test_a_bare_causal_lm_plans_for_inference_and_estimates(tmp_path, capsys):
    captured = capture(_causal_lm, [parse_input_spec("input_ids=int64[2,8]")])
    outputs = [n for n in captured.graph_module.graph.nodes if n.op == "output"]
    assert outputs and all(isinstance(v, torch.Tensor) for v in _leaves(outputs[0].meta.get("val")))
    plan = compile_model(_causal_lm, Options(inputs=["input_ids=int64[2,8]"], cluster="local", devices=2,
                                             world_size=2, inference=True)).plan
    assert plan.training.inference
    model = tmp_path / "lm.py"
    model.write_text("from tests.unit.test_any_model_capture import _causal_lm as lm\n")
    try:
        main(["estimate", f"{model}:lm", "--input", "input_ids=int64[2,8]", "--dp", "2"])
    except SystemExit as e:
        assert e.code in (0, None), capsys.readouterr().err
    assert "what fits" in capsys.readouterr().out


def test_mixtral_with_its_default_experts_captures():
    import transformers as tf

    def mixtral():
        return tf.MixtralForCausalLM(tf.MixtralConfig(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, use_cache=False))

    captured = capture(mixtral, [parse_input_spec("input_ids=int64[2,8]")])
    ops = {str(n.target) for n in captured.graph_module.graph.nodes if n.op == "call_function"}
    assert any("grouped_mm" in op for op in ops), sorted(ops)


def test_an_fp32_graphs_limits_and_no_op_casts_follow_the_compute_dtype():
    recast = Recast(torch.float32, torch.bfloat16)
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(2, dtype=torch.float32)
    to = graph.call_function(torch.ops.aten.to.dtype, (x, torch.float32))
    to.meta["val"] = torch.empty(2, dtype=torch.float32)
    args, _ = recast.args(to, "to", [x, torch.float32], {})
    assert args[1] == torch.bfloat16  # x.to(w.dtype) at an fp32 capture: bf16 now
    fill = graph.call_function(torch.ops.aten.masked_fill.Scalar, (x, x, torch.finfo(torch.float32).min))
    args, _ = recast.args(fill, "masked_fill", [x, x, torch.finfo(torch.float32).min], {})
    assert args[2] == torch.finfo(torch.bfloat16).min  # fp32's min overflows bf16
    torch.tensor([0.0], dtype=torch.bfloat16).fill_(args[2])  # ... this one does not


def _leaves(value):
    if isinstance(value, (tuple, list)):
        return [v for item in value for v in _leaves(item)]
    return [value] if value is not None else []


def test_the_grouped_matmul_fallbacks_backward_runs_on_fake_tensors_and_is_the_real_one_on_real():
    """transformers' fallback for grouped matmuls (what its experts run where torch has no usable
    ``_grouped_mm``, as on torch 2.11) reads its token counts in backward; on fake tensors
    (the planner's backward, passes/activations.py) the shim gives the gradients' shapes."""
    import transformers.integrations.moe  # noqa: F401  registers the op
    from torch._subclasses.fake_tensor import FakeTensorMode

    from partita.core.model.fake_ops import capturable

    op = torch.ops.transformers.grouped_mm_fallback
    with capturable():
        pass
    x, w, offs = torch.randn(6, 4, requires_grad=True), torch.randn(2, 4, 3, requires_grad=True), torch.tensor([2, 6])
    op(x, w, offs).pow(2).sum().backward()
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    torch.cat([xr[:2] @ wr[0], xr[2:] @ wr[1]]).pow(2).sum().backward()  # the same product, expert by expert
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(w.grad, wr.grad)
    mode = FakeTensorMode()
    xf, wf, of = (mode.from_tensor(t) for t in (x.detach(), w.detach(), offs))
    with mode:
        xf.requires_grad_()
        wf.requires_grad_()
        op(xf, wf, of).sum().backward()
        assert xf.grad.shape == (6, 4) and wf.grad.shape == (2, 4, 3)
