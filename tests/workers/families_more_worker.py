"""More Hugging Face families as users write them (issue 12), run by tests/integration/test_hf_families.py on the
harness's 2-rank group: ViT image classification (``pixel_values``, a model whose initialisation
reads tensor values, so it is built for capture on the meta device), T5 encoder-decoder (three
inputs: ``input_ids``, ``attention_mask``, ``decoder_input_ids``) and Llama with an
``attention_mask`` as a second input (padded rows); Gemma (one KV head, tied head) and Phi
(partial rotary, parallel attention and MLP) on one axis each. Each of the first three runs two
of the axes, the four axes covered between them; the single-process reference (``reference``) is the plain loop of
tests/harness.py on the same batches.
"""

from __future__ import annotations

from pathlib import Path

import torch

import partita
from tests.harness import plain_training
from tests.workers.families_script import optimizer

STEPS, BATCH, SEQ, VOCAB, CLASSES = 2, 4, 16, 256, 10


def vit():
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(ViTConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=64,
                                               num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                               num_labels=CLASSES, hidden_dropout_prob=0.0,
                                               attention_probs_dropout_prob=0.0))


def t5():
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                               num_heads=4, dropout_rate=0.0, decoder_start_token_id=0))


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def gemma():
    from transformers import GemmaConfig, GemmaForCausalLM

    return GemmaForCausalLM(GemmaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                                        max_position_embeddings=64))


def phi():
    from transformers import PhiConfig, PhiForCausalLM

    return PhiForCausalLM(PhiConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, max_position_embeddings=64, resid_pdrop=0.0,
                                    embd_pdrop=0.0, attention_dropout=0.0))


def _tokens(g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def _mask(g: torch.Generator) -> torch.Tensor:
    """Right padding: each row keeps a random number of its first tokens (at least half)."""
    keep = torch.randint(SEQ // 2, SEQ + 1, (BATCH, 1), generator=g)
    return (torch.arange(SEQ) < keep).long()


def _vit_batch(g):
    return (torch.randn(BATCH, 3, 32, 32, generator=g),), torch.randint(0, CLASSES, (BATCH,), generator=g)


def _t5_batch(g):
    return (_tokens(g), _mask(g), _tokens(g)), _tokens(g)


def _llama_batch(g):
    return (_tokens(g), _mask(g)), _tokens(g)


def _lm_batch(g):
    return (_tokens(g),), _tokens(g)


# name -> (factory, input specs, batch(generator) -> (inputs, targets), the meshes it runs)
MODELS = {
    "vit": (vit, [f"pixel_values=float32[{BATCH},3,32,32]"], _vit_batch, ("dp2", "tp2")),
    "t5": (t5, [f"input_ids=int64[{BATCH},{SEQ}]", f"attention_mask=int64[{BATCH},{SEQ}]",
                f"decoder_input_ids=int64[{BATCH},{SEQ}]"], _t5_batch, ("pp2", "zero3")),
    "llama-mask": (llama, [f"input_ids=int64[{BATCH},{SEQ}]", f"attention_mask=int64[{BATCH},{SEQ}]"], _llama_batch,
                   ("tp2", "pp2")),
    # Gemma: multi-query attention (one KV head), tied embedding and head, a scaled embedding
    "gemma": (gemma, [f"input_ids=int64[{BATCH},{SEQ}]"], _lm_batch, ("tp2",)),
    # Phi: partial rotary embedding, parallel attention and MLP from one layer norm, biased head
    "phi": (phi, [f"input_ids=int64[{BATCH},{SEQ}]"], _lm_batch, ("pp2",)),
}


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return MODELS[name][0]()


def batches(name: str):
    g = torch.Generator().manual_seed(7)
    return [MODELS[name][2](g) for _ in range(STEPS)]


def reference(name: str) -> tuple[list[float], dict]:
    model = build(name)
    return plain_training(model, optimizer(model.parameters()), batches(name))


def run(ctx, outdir: str, runs: list[str]) -> None:
    """Each ``NAME=PLAN`` trained through the decorator; rank 0 writes the losses and the full state
    beside the plan (``PLAN-STEM.out.json`` / ``.out.pt``)."""
    import json

    for spec in runs:
        name, plan = spec.split("=", 1)
        model = partita.parallelize(build(name), plan=plan, optimizer=optimizer)
        losses = [float(model.train_step(*xs, targets=y)) for xs, y in batches(name)]
        state = model.full_state_dict()
        if ctx.rank == 0:
            tag = Path(plan).stem
            Path(outdir, f"{tag}.out.json").write_text(json.dumps({"losses": losses}))
            torch.save(state, Path(outdir, f"{tag}.out.pt"))
