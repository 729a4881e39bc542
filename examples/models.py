"""Example models for partita's tests, benchmarks and docs.

Small models (``MLP``, ``SmallCNN``, a nanoGPT-style ``GPT``) written here, and
factories for Hugging Face models built from configs (no weights, no network).
Every factory is a zero-argument callable, so ``capture`` can build it under
fake tensors without allocating memory. Each model is deterministic under
``torch.manual_seed``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    """``layers`` Linear layers with ReLU between them: d_in -> hidden -> ... -> d_out."""

    def __init__(self, d_in: int = 64, hidden: int = 256, d_out: int = 10, layers: int = 2) -> None:
        super().__init__()
        widths = [d_in] + [hidden] * (layers - 1) + [d_out]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.relu(x)
        return x


class SmallCNN(nn.Module):
    """Conv-BN-ReLU-pool twice, then a Linear classifier. Input (B, 3, 32, 32)."""

    def __init__(self, num_classes: int = 10, width: int = 16) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(2 * width)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(2 * width * 8 * 8, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.bn1(self.conv1(x))))  # (B, w, 16, 16)
        x = self.pool(F.relu(self.bn2(self.conv2(x))))  # (B, 2w, 8, 8)
        return self.fc(x.flatten(1))


@dataclass
class GPTConfig:
    vocab_size: int = 50304
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True
    flash: bool = True  # fused scaled_dot_product_attention; False: the matmul-softmax-matmul it fuses


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate q, k and v projections.

    Separate rather than nanoGPT's fused ``c_attn``: tensor parallelism splits
    attention by heads, and a fused (C, 3C) projection's output columns hold all
    of q, then all of k, then all of v, so an equal split of them gives rank 0
    the q heads and rank 1 the k and v heads: it cannot be split by heads
    without a strided layout. Three linears each split by heads directly.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.flash = cfg.flash
        self.attn_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        hs = C // self.n_head
        q = self.q_proj(x).view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_proj(x).view(B, T, self.n_head, hs).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_head, hs).transpose(1, 2)
        if self.flash:
            y = F.scaled_dot_product_attention(
                q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
            )
        else:  # what a fused kernel saves memory on: the (T, T) scores, probabilities and mask
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
            causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            att = self.attn_dropout(F.softmax(att.masked_fill(~causal, float("-inf")), dim=-1))
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class FeedForward(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT-style decoder. ``forward(idx)`` with idx (B, T) int64 -> logits (B, T, V).

    The lm_head is untied from the token embedding so that tensor parallelism
    can shard each on its own.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
                wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
                drop=nn.Dropout(cfg.dropout),
                h=nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
                ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
            )
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2's scaled init of residual projections
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))  # (B, T, V)


def gpt_tiny() -> GPT:
    """A 2-layer, 64-wide GPT over a 256-token vocabulary (block 64): for fast tests."""
    return GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64))


def gpt2_small() -> GPT:
    """GPT-2 small's shape (124M parameters with the untied head: 163M)."""
    return GPT(GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768))


class LogitsOnly(nn.Module):
    """Wrap a Hugging Face causal LM so ``forward(input_ids)`` returns the logits tensor.

    Hugging Face models return a ``ModelOutput`` (a dict-like of logits, caches,
    hidden states). The planner wants one tensor output to attach a loss to and
    the pipeline runtime passes tensors between stages, so the wrapper keeps
    only the logits and turns the KV cache off.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


def hf_gpt2(n_layer: int = 2, n_embd: int = 768, n_head: int = 12, vocab_size: int = 50257,
            n_positions: int = 1024) -> LogitsOnly:
    """transformers' GPT2LMHeadModel from a config (random init, no download)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab_size,
                     n_positions=n_positions, attn_implementation="sdpa")
    return LogitsOnly(GPT2LMHeadModel(cfg))


def hf_llama(num_hidden_layers: int = 2, hidden_size: int = 256, num_attention_heads: int = 8,
             num_key_value_heads: int | None = None, intermediate_size: int = 688,
             vocab_size: int = 32000, max_position_embeddings: int = 4096,
             attn_implementation: str = "sdpa") -> LogitsOnly:
    """transformers' LlamaForCausalLM from a config (random init, no download); "eager" attention
    writes out the matmul-softmax-matmul that "sdpa" fuses."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        num_hidden_layers=num_hidden_layers, hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads or num_attention_heads,
        intermediate_size=intermediate_size, vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings, attn_implementation=attn_implementation,
    )
    return LogitsOnly(LlamaForCausalLM(cfg))


def llama2_70b(num_hidden_layers: int = 80) -> LogitsOnly:
    """Llama-2-70B's shape: 80 layers, hidden 8192, 64 heads (8 KV), FFN 28672, vocab 32000.

    Build it only under fake tensors (``capture`` does): real weights need 276 GB.
    """
    return hf_llama(num_hidden_layers=num_hidden_layers, hidden_size=8192, num_attention_heads=64,
                    num_key_value_heads=8, intermediate_size=28672, vocab_size=32000)


class MaskedLMLogits(nn.Module):
    """Wrap a Hugging Face masked LM so ``forward(input_ids)`` returns the logits tensor."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits


def hf_bert_mlm(num_hidden_layers: int = 2, hidden_size: int = 64, num_attention_heads: int = 4,
                intermediate_size: int = 128, vocab_size: int = 512, dropout: float = 0.0) -> MaskedLMLogits:
    """transformers' BertForMaskedLM from a config (random init, no download). Its MLM decoder's
    weight is tied to the word embedding, and its decoder bias appears under two names."""
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(num_hidden_layers=num_hidden_layers, hidden_size=hidden_size,
                     num_attention_heads=num_attention_heads, intermediate_size=intermediate_size,
                     vocab_size=vocab_size, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
                     attn_implementation="sdpa")
    return MaskedLMLogits(BertForMaskedLM(cfg))
