"""A small GPT-2 for the corpus of this folder (``corpus.jsonl``, made by ``make_corpus.py``, with
its 96-token ``tokenizer/``), taking ``position_ids`` and an ``attention_mask`` besides the ids and
labels, so that train.py's packing restarts the positions at each document:

    autopipe compile examples/data/model.py:build --stages 2 --out out/corpus_2
    torchrun --nproc-per-node=2 out/corpus_2/train.py --data examples/data/corpus.jsonl \\
        --tokenizer examples/data/tokenizer --steps 200 --lr 3e-3 --device cpu

or, batched by length (each document a row, up to 128 tokens; a step's rows of similar lengths):

    autopipe compile examples/data/model.py:build --stages 2 --out out/corpus_dyn \\
        --dynamic "seq[8:128]=input_ids:1,position_ids:1,attention_mask:1,labels:1"
"""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging

logging.set_verbosity_error()

#: the tokenizer's vocabulary, the example's rows and tokens per row, the longest position
VOCABULARY, BATCH, SEQ, POSITIONS = 96, 2, 32, 128


def build(layers: int = 2):
    """GPT-2 over the tokenizer's 96 tokens (<unk> 0, <eos> 1, <pad> 2), dropout off, and one
    example microbatch: two rows of 32 tokens, each two documents packed."""
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCABULARY,
        n_positions=POSITIONS,
        n_layer=layers,
        n_embd=32,
        n_head=4,
        use_cache=False,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=1,
        eos_token_id=1,
        pad_token_id=2,
    )
    input_ids = torch.randint(3, VOCABULARY, (BATCH, SEQ))
    position_ids = torch.cat([torch.arange(SEQ // 2), torch.arange(SEQ - SEQ // 2)]).repeat(
        BATCH, 1
    )
    kwargs = {
        "position_ids": position_ids,
        "attention_mask": torch.ones(BATCH, SEQ, dtype=torch.long),
        "labels": input_ids.clone(),
    }
    return GPT2LMHeadModel(config), (input_ids,), kwargs
