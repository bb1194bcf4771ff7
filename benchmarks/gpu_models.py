"""The models and batches of the one-GPU kit (benchmarks/gpu.py): Hugging Face GPT-2 and Llama
built from configs (nothing downloaded), with their labels, and ``FN(step)`` batch functions for
``train.py --data``.

Exactness models are small and fp32 with dropout off, so that a pipeline and the original model
compute the same operators on the same numbers. Speed models are Llamas in bf16 weights (what the
analytic profile plans for a bf16 model), large enough that a GPU's compute, not Python, is what
is timed: about 1.1 B parameters at sequence 2048, or 0.2 B at 1024 for ``--quick``.
"""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers.utils import logging

logging.set_verbosity_error()

#: microbatches per optimizer step in every run of the kit
MICROBATCHES = 8

GPT2_BATCH, GPT2_SEQ, GPT2_VOCAB = 2, 64, 1024
LLAMA_BATCH, LLAMA_SEQ, LLAMA_VOCAB = 2, 64, 1024
SPEED_VOCAB = 32000
SPEED_SEQ = {"full": 2048, "quick": 1024, "rehearsal": 128}
#: hidden size, intermediate size, layers of the speed Llamas
SPEED_SHAPE = {"full": (2048, 5632, 16), "quick": (1024, 2816, 8), "rehearsal": (256, 704, 2)}


def gpt2():
    """GPT-2, 4 layers, width 128, tied embedding and LM head, microbatch 2 x 64, fp32."""
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=4,
        n_embd=128,
        n_head=4,
        vocab_size=GPT2_VOCAB,
        n_positions=GPT2_SEQ,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    ids = torch.randint(0, GPT2_VOCAB, (GPT2_BATCH, GPT2_SEQ))
    return GPT2LMHeadModel(config), (ids,), {"labels": ids.clone()}


def llama():
    """Llama, 4 layers, width 128, grouped-query attention (4 heads, 2 key/value heads),
    microbatch 2 x 64, fp32."""
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=LLAMA_VOCAB,
        max_position_embeddings=LLAMA_SEQ,
        use_cache=False,
    )
    ids = torch.randint(0, LLAMA_VOCAB, (LLAMA_BATCH, LLAMA_SEQ))
    return LlamaForCausalLM(config), (ids,), {"labels": ids.clone()}


def _counting(step: int, rows: int, seq: int, vocab: int):
    """Sequences counting up from a random start with a random stride: learnable, so the loss
    falls over the steps and a wrong gradient shows."""
    generator = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, vocab, (rows, 1), generator=generator)
    stride = torch.randint(1, 4, (rows, 1), generator=generator)
    ids = (start + stride * torch.arange(seq)) % vocab
    return (ids,), {"labels": ids.clone()}


def gpt2_batches(step: int):
    """A step's batch for :func:`gpt2`: MICROBATCHES microbatches."""
    return _counting(step, GPT2_BATCH * MICROBATCHES, GPT2_SEQ, GPT2_VOCAB)


def llama_batches(step: int):
    """A step's batch for :func:`llama`: MICROBATCHES microbatches."""
    return _counting(step, LLAMA_BATCH * MICROBATCHES, LLAMA_SEQ, LLAMA_VOCAB)


def _speed_llama(size: str):
    hidden, intermediate, layers = SPEED_SHAPE[size]
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        vocab_size=SPEED_VOCAB,
        max_position_embeddings=SPEED_SEQ[size],
        use_cache=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    ids = torch.randint(0, SPEED_VOCAB, (1, SPEED_SEQ[size]))
    return model, (ids,), {"labels": ids.clone()}


def speed_llama():
    """Llama with TinyLlama's widths (2048, 5632, 16 heads of which 8 key/value) and 16 layers:
    1.1 B parameters in bf16, microbatch 1 x 2048."""
    return _speed_llama("full")


def speed_llama_quick():
    """A smaller speed Llama for --quick: width 1024, 8 layers, 0.2 B parameters, 1 x 1024."""
    return _speed_llama("quick")


def speed_llama_rehearsal():
    """A speed Llama small enough to rehearse the kit on a CPU (``gpu.py --device cpu``)."""
    return _speed_llama("rehearsal")


def speed_batches(step: int):
    """A step's batch for :func:`speed_llama`: MICROBATCHES random microbatches."""
    return _random(step, SPEED_SEQ["full"])


def speed_batches_quick(step: int):
    """A step's batch for :func:`speed_llama_quick`."""
    return _random(step, SPEED_SEQ["quick"])


def speed_batches_rehearsal(step: int):
    """A step's batch for :func:`speed_llama_rehearsal`."""
    return _random(step, SPEED_SEQ["rehearsal"])


def _random(step: int, seq: int):
    generator = torch.Generator().manual_seed(2000 + step)
    ids = torch.randint(0, SPEED_VOCAB, (MICROBATCHES, seq), generator=generator)
    return (ids,), {"labels": ids.clone()}
