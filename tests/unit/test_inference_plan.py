"""An inference plan lists the collectives a forward runs, nothing of a backward or a loss."""



from examples.models import gpt_tiny
from partita.compiler.compile import compile_model
from partita.core.cluster import load_cluster
from partita.core.model.inputs import parse_input_spec
from partita.core.options import Options
from tests.harness import fast_cluster


def test_an_inference_plan_lists_forward_collectives_only(tmp_path):
    spec = [parse_input_spec("idx=int64[8,64]")]
    cluster = load_cluster(fast_cluster(tmp_path), devices=4)
    train = compile_model(gpt_tiny, Options(inputs=spec, cluster=cluster, world_size=4, tp=2, pp=2)).plan
    infer = compile_model(gpt_tiny, Options(inputs=spec, cluster=cluster, world_size=4, tp=2, pp=2,
                                            inference=True)).plan
    assert any("backward" in c.purpose for c in train.collectives)  # the training plan has them
    assert not [c for c in infer.collectives
                if "backward" in c.purpose or "gradient" in c.purpose or "loss" in c.purpose]
    (out,) = [c for c in infer.collectives if c.kind == "broadcast"]
    assert out.bytes == 8 * 64 * 256 * 4 and "output" in out.purpose  # the logits, to every stage
