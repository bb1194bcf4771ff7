"""T5-small (Hugging Face transformers, built from its config: no download): every decoder layer
reads the encoder's output, and encoder and decoder blocks differ in cost, which is where
Mixed-Pipe's non-contiguous stages help. Parameters are created without memory.

autopipe compile examples/t5.py:build --stages 6 --devices 3 --out generated/t5_small_6on3
"""

import torch
from transformers import T5Config, T5ForConditionalGeneration
from transformers.utils import logging

import autopipe

logging.set_verbosity_error()

BATCH, SOURCE, TARGET = 8, 128, 32


def build():
    """T5-small and one example microbatch: (model, args, kwargs)."""
    config = T5Config(  # t5-small's shapes
        d_model=512,
        d_kv=64,
        d_ff=2048,
        num_layers=6,
        num_heads=8,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    with autopipe.empty_weights():
        model = T5ForConditionalGeneration(config)
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, config.vocab_size, (BATCH, SOURCE), generator=generator)
    labels = torch.randint(0, config.vocab_size, (BATCH, TARGET), generator=generator)
    return model, (input_ids,), {"labels": labels}
