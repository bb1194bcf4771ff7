"""A small GPT-2 (Hugging Face transformers, built from a config: no download) with labels.

    autopipe compile examples/gpt2.py:build --stages 4 --out generated/gpt2_4
"""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

BATCH, SEQ = 2, 64


def build():
    """The model and one example microbatch: (model, args, kwargs)."""
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=4,
        n_embd=128,
        n_head=4,
        vocab_size=1024,
        n_positions=SEQ,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    input_ids = torch.randint(0, config.vocab_size, (BATCH, SEQ))
    return model, (input_ids,), {"labels": input_ids.clone()}
