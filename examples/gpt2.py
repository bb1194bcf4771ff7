"""A small GPT-2 (Hugging Face transformers, built from a config: no download) with labels.

autopipe compile examples/gpt2.py:build --stages 4 --out generated/gpt2_4
"""

import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging

logging.set_verbosity_error()  # keep the example's output to autopipe's own lines

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
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    input_ids = torch.randint(0, config.vocab_size, (BATCH, SEQ))
    return model, (input_ids,), {"labels": input_ids.clone()}


def batches(step: int, microbatches: int = 8):
    """A learnable toy corpus for `train.py --data examples/gpt2.py:batches`: each sequence counts
    up from a random start with a random stride, so the loss falls within a few dozen steps."""
    generator = torch.Generator().manual_seed(step)
    rows = BATCH * microbatches
    start = torch.randint(0, 1024, (rows, 1), generator=generator)
    stride = torch.randint(1, 4, (rows, 1), generator=generator)
    input_ids = (start + stride * torch.arange(SEQ)) % 1024
    return (input_ids,), {"labels": input_ids.clone()}
