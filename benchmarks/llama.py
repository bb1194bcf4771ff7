"""Llama-3 model specs for the planning benchmarks: Hugging Face's ``LlamaForCausalLM`` at the
published sizes, built under ``autopipe.empty_weights()`` (no memory for weights, nothing
downloaded), bf16, one sequence of 4096 tokens per microbatch with its labels.

    autopipe plan benchmarks/llama.py:llama_70b --devices 64 --global-batch 256
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import autopipe

SEQUENCE = 4096
VOCAB = 128256


def _llama(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int):
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=VOCAB,
        max_position_embeddings=SEQUENCE,
        use_cache=False,
    )
    with autopipe.empty_weights():
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    ids = torch.randint(0, VOCAB, (1, SEQUENCE))
    return model, (ids,), {"labels": ids}


def llama_8b():
    """Llama-3-8B: 32 layers, width 4096."""
    return _llama(4096, 14336, 32, 32, 8)


def llama_70b():
    """Llama-3-70B: 80 layers, width 8192."""
    return _llama(8192, 28672, 80, 64, 8)


def llama_405b():
    """Llama-3.1-405B: 126 layers, width 16384."""
    return _llama(16384, 53248, 126, 128, 8)
