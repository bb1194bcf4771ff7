"""Fine-tuning on variable-length text: one pipeline, a new sequence length every step.

Each sample is one paragraph of Python's reference documentation (shipped with every CPython: no
downloads), at most 256 bytes. Each step takes samples of similar length (as Hugging Face's
``group_by_length`` does) and pads them to the longest, so the sequence length changes from step
to step: the pipeline is compiled with that dimension (and the batch's) dynamic, and trains each
step at the step's own length.

    autopipe compile examples/finetune.py:build --stages 2 --out out/finetune_2 \\
        --dynamic "seq[16:256]=input_ids:1,attention_mask:1,labels:1" \\
        --dynamic "batch[2:8]=input_ids:0,attention_mask:0,labels:0"
    torchrun --nproc-per-node=2 out/finetune_2/train.py --data examples/finetune.py:batches \\
        --steps 100 --microbatches 4 --lr 1e-3

Padding does not change the loss: padded positions are masked out of attention (zeros in
``attention_mask``) and ignored by it (``-100`` in ``labels``).
"""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging

logging.set_verbosity_error()

MAX_LENGTH, SHORTEST = 256, 16
SAMPLES_PER_STEP = 16  # 4 microbatches of 4 samples
IGNORE = -100  # the label Hugging Face's loss skips


def documents() -> list[bytes]:
    """The paragraphs of Python's reference documentation of SHORTEST to MAX_LENGTH bytes
    (longer ones cut), shortest first."""
    from pydoc_data.topics import topics

    paragraphs = [
        paragraph.strip().encode("utf-8")[:MAX_LENGTH]
        for name in sorted(topics)
        for paragraph in topics[name].split("\n\n")
    ]
    return sorted((p for p in paragraphs if len(p) >= SHORTEST), key=len)


def padded(samples: list[bytes]) -> dict[str, torch.Tensor]:
    """``samples`` as one batch padded to the longest: byte ids, attention mask and labels."""
    length = max(len(s) for s in samples)
    input_ids = torch.zeros(len(samples), length, dtype=torch.long)
    attention_mask = torch.zeros(len(samples), length, dtype=torch.long)
    for row, sample in enumerate(samples):
        input_ids[row, : len(sample)] = torch.frombuffer(bytearray(sample), dtype=torch.uint8)
        attention_mask[row, : len(sample)] = 1
    labels = input_ids.masked_fill(attention_mask == 0, IGNORE)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def batches(step: int, samples: int = SAMPLES_PER_STEP):
    """For `train.py --data`: step ``step``'s samples, padded to the longest of them: a seeded
    draw of ``samples`` neighbours in length, in random order."""
    corpus = documents()
    generator = torch.Generator().manual_seed(step)
    start = int(torch.randint(0, len(corpus) - samples + 1, (1,), generator=generator))
    order = torch.randperm(samples, generator=generator).tolist()
    return (), padded([corpus[start + i] for i in order])


def build():
    """GPT-2 over the 256 byte values and one example microbatch of 4 padded samples."""
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=256,
        n_positions=MAX_LENGTH,
        n_layer=4,
        n_embd=128,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
    )
    example = padded([text[:64] for text in documents()[:4]])
    return GPT2LMHeadModel(config), (), example
