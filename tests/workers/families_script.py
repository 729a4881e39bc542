"""Hugging Face models as users write them, unmodified (no wrapper returning logits): a causal LM
from AutoModelForCausalLM (Qwen2 with grouped KV heads, GPT-NeoX), BERT's masked LM trained with
the model's own loss (labels=), and BERT sequence classification. Run by tests/integration/test_hf_families.py
on the harness's group (``run``; under torchrun as a script), and imported by it for the
single-process reference.

usage: families_script.py OUTDIR NAME=PLAN.json [NAME=PLAN.json ...]   (the repository's root on PYTHONPATH)
"""

import json
import sys
from pathlib import Path

import torch

import partita
from tests.harness import plain_training

STEPS, BATCH, SEQ, VOCAB, CLASSES = 2, 4, 16, 256, 3


def qwen2():
    from transformers import AutoModelForCausalLM, Qwen2Config

    return AutoModelForCausalLM.from_config(Qwen2Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                                        num_key_value_heads=2, intermediate_size=128, vocab_size=VOCAB))


def neox():
    from transformers import AutoModelForCausalLM, GPTNeoXConfig

    return AutoModelForCausalLM.from_config(GPTNeoXConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                                          intermediate_size=128, vocab_size=VOCAB,
                                                          hidden_dropout=0.0, attention_dropout=0.0))


def _bert_config(**kw):
    from transformers import BertConfig

    return BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                      vocab_size=VOCAB, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **kw)


def bert_mlm():
    from transformers import BertForMaskedLM

    return BertForMaskedLM(_bert_config())


def bert_cls():
    from transformers import BertForSequenceClassification

    return BertForSequenceClassification(_bert_config(num_labels=CLASSES))


# name -> (factory, loss as the decorator takes it, classes of the targets, targets per sequence?)
MODELS = {
    "qwen2": (qwen2, None, VOCAB, True),
    "neox": (neox, None, VOCAB, True),
    "bert-mlm": (bert_mlm, "model", VOCAB, True),
    "bert-cls": (bert_cls, None, CLASSES, False),
}


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return MODELS[name][0]()


def optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-5)


def batches(name: str):
    _, _, classes, per_token = MODELS[name]
    g = torch.Generator().manual_seed(7)
    for _ in range(STEPS):
        x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        y = torch.randint(0, classes, (BATCH, SEQ) if per_token else (BATCH,), generator=g)
        yield x, y


def reference(name: str) -> tuple[list[float], dict]:
    model = build(name)
    return plain_training(model, optimizer(model.parameters()), batches(name), MODELS[name][1])


def main(outdir: Path, runs: list[str]) -> None:
    for run in runs:
        name, plan = run.split("=", 1)
        model = partita.parallelize(build(name), plan=plan, optimizer=optimizer, loss=MODELS[name][1])
        losses = [model.train_step(x, targets=y) for x, y in batches(name)]
        state = model.full_state_dict()
        tag = Path(plan).stem
        if model.ctx.rank == 0:
            Path(outdir, f"{tag}.json").write_text(json.dumps({"losses": losses}))
            torch.save(state, Path(outdir, f"{tag}.pt"))


def run(ctx, outdir: str, runs: list[str]) -> None:
    """tests/harness.py's entry: ``main`` on a running group."""
    main(Path(outdir), runs)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
