"""A small GPT-2 trained on real text built locally: Python's reference documentation (the pydoc
topics every CPython ships), read as bytes. No downloads, no tokenizer files.

    autopipe compile examples/text.py:build --stages 2 --out /tmp/text_2
    torchrun --nproc-per-node=2 /tmp/text_2/train.py --data examples/text.py:dataset \\
        --steps 300 --microbatches 4 --lr 1e-3 --warmup-steps 30 --lr-decay cosine

``dataset()`` is a ``torch.utils.data.Dataset`` factory: train.py reads it in a seeded order, each
step the next samples, and only the ranks that need inputs read it.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging

logging.set_verbosity_error()

SEQ, BATCH = 128, 4


def corpus() -> bytes:
    """Python's reference documentation, every topic in name order, as UTF-8 bytes."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics)).encode("utf-8")


class ByteWindows(Dataset):
    """Consecutive windows of ``length`` bytes; the model predicts each next byte."""

    def __init__(self, data: bytes, length: int = SEQ):
        self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.length = length

    def __len__(self) -> int:
        return len(self.tokens) // self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        window = self.tokens[index * self.length : (index + 1) * self.length]
        return {"input_ids": window, "labels": window.clone()}


def dataset() -> ByteWindows:
    return ByteWindows(corpus())


def build():
    """GPT-2 over the 256 byte values and one example microbatch of the text."""
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=256,
        n_positions=SEQ,
        n_layer=4,
        n_embd=128,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
    )
    windows = ByteWindows(corpus()[: SEQ * BATCH])
    input_ids = torch.stack([windows[i]["input_ids"] for i in range(BATCH)])
    return GPT2LMHeadModel(config), (input_ids,), {"labels": input_ids.clone()}
