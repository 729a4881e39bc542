"""Tied parameters across pipeline stages, through the planner's own plans (issue: the tp x pp
deadlock). BERT's MLM head (decoder weight tied to the word embedding, its bias under two names)
and a GPT with a tied lm_head, at tp2 x pp2 (4 gloo processes) and dp2 x tp2 x pp2 (8, under
torchrun): the same losses and final parameters as one process, and every rank runs exactly the
collectives its plan lists for its stage, the tied-gradient all-reduce included."""



from partita.compiler.compile import compile_model
from partita.core.cluster import load_cluster
from partita.core.model.inputs import parse_input_spec
from partita.core.options import Options
from partita.core.plans.plan import tied_stages
from tests.workers import tied_script as script


def test_an_unused_duplicate_placeholder_puts_a_tied_parameter_on_no_stage():
    """BERT's decoder bias has two placeholders; the one no node reads sits on stage 0 by graph
    order. Counting it made stage 0 a holder that never got a gradient and skipped the all-reduce
    its peers waited in."""
    param_of = {"p_bias": "cls.bias", "p_decoder_bias": "cls.bias", "p_wte": "wte", "p_ln": "ln"}
    readers = {"p_decoder_bias": ["add_9"], "p_wte": ["embedding", "linear_9"], "p_ln": ["layer_norm"]}
    stage_of = {"p_bias": 0, "p_decoder_bias": 1, "add_9": 1, "embedding": 0, "linear_9": 1, "layer_norm": 0,
                "p_wte": 0, "p_ln": 0}
    assert tied_stages(param_of, readers, stage_of) == {"wte": (0, 1)}


def test_a_bert_plan_lists_the_tied_all_reduce_on_both_stages(tmp_path):
    plan = compile_model(script.build("bert"),
                         Options(inputs=[parse_input_spec(f"input_ids=int64[4,{script.SEQ}]")],
                                 cluster=load_cluster("local", devices=4), world_size=4, tp=2, pp=2)).plan
    tied = [c for c in plan.collectives if c.axis == "pp" and c.kind == "all_reduce"]
    assert sorted(c.stage for c in tied) == [0, 1]
    assert all("word_embeddings" in c.purpose and c.group_size == 2 for c in tied)
    # the word embedding (512 x 64 floats, replicated or vocab-sharded over tp=2)
    assert all(c.bytes in (script.VOCAB * 64 * 4, script.VOCAB * 64 * 4 // 2) for c in tied)
