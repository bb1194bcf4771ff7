"""BERT-base (Hugging Face transformers, built from its config: no download) for masked-LM
training, with an attention mask. Parameters are created without memory (autopipe.empty_weights):
compile it, then train from a checkpoint with train.py --load.

autopipe compile examples/bert.py:build --stages 4 --out generated/bert_base_4
"""

import torch
from transformers import BertConfig, BertForMaskedLM
from transformers.utils import logging

import autopipe

logging.set_verbosity_error()

BATCH, SEQ = 8, 128


def build():
    """BERT-base and one example microbatch: (model, args, kwargs)."""
    with autopipe.empty_weights():  # parameters on meta, buffers (position ids) real
        model = BertForMaskedLM(BertConfig())  # bert-base-uncased's shapes
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ), generator=generator)
    attention_mask = torch.ones(BATCH, SEQ, dtype=torch.int64)
    attention_mask[1, SEQ // 2 :] = 0  # a padded sequence
    labels = torch.full((BATCH, SEQ), -100)
    labels[:, ::7] = input_ids[:, ::7]  # predict every 7th token
    return model, (input_ids,), {"attention_mask": attention_mask, "labels": labels}
