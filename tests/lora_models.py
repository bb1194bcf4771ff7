"""Models with parameters that do not train, for tests/test_adapters.py: a PEFT LoRA over a tiny
Llama (a frozen base, adapters on q_proj and v_proj), GPT-2 with frozen (tied) embeddings, and a
frozen tower under a trained head. Built from tiny configs, no downloads, dropout off."""

from __future__ import annotations

import torch
from torch import nn

VOCAB, SEQ, BATCH = 128, 16, 2


def llama():
    """A 2-layer Llama of hidden size 32, untied LM head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        use_cache=False,
        attention_dropout=0.0,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def lora_llama():
    """PEFT's LoRA (r=4) on the Llama's q_proj and v_proj: only the adapters train. PEFT's
    ``PeftModel.forward(*args, **kwargs)`` takes the ids by position, as the Llama does."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = get_peft_model(llama(), config)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return model, (ids,), {"labels": ids.clone()}


def lora_batch(step: int, microbatches: int = 4):
    g = torch.Generator().manual_seed(2000 + step)
    ids = torch.randint(0, VOCAB, (BATCH * microbatches, SEQ), generator=g)
    return (ids,), {"labels": ids.clone()}


def gpt2_frozen_embeddings():
    """The test GPT-2 (2 layers) with its token and position embeddings frozen: the token
    embedding is tied to the LM head, which is frozen with it."""
    from models import gpt2

    model, args, kwargs = gpt2(layers=2)
    model.transformer.wte.requires_grad_(False)
    model.transformer.wpe.requires_grad_(False)
    return model, args, kwargs


class FrozenTower(nn.Module):
    """A frozen embedding and tower of 24 linear layers (one whole stage of a 2-stage
    partition), then a trained head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 64)
        self.tower = nn.Sequential(*[m for _ in range(24) for m in (nn.Linear(64, 64), nn.ReLU())])
        self.head = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
        self.embed.requires_grad_(False)
        self.tower.requires_grad_(False)

    def forward(self, ids, target):
        x = self.tower(self.embed(ids)).mean(1)
        return {"loss": ((self.head(x) - target) ** 2).mean()}


def frozen_tower():
    torch.manual_seed(0)
    return FrozenTower(), (torch.randint(0, 50, (8, 16)), torch.randn(8, 64))
