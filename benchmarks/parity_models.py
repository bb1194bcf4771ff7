"""The models and batches of the parity ladder (benchmarks/parity.py): Hugging Face GPT-2 and a
grouped-query-attention Llama built from configs (nothing downloaded), at the shapes the ladder
asks for, with their labels, and ``FN(step)`` batch functions for ``train.py --data``.

parity.py writes a small spec file per model into its work directory that calls
:func:`build` and :func:`batches` with the run's shape, so that ``autopipe compile``,
``train.py --data`` and the ladder's own workers build the same model from the same seed and
train on the same batches. Dropout is off (``*_pdrop=0``, Llama has none): a speed benchmark
of modern training, and the CPU's flash attention kernel refuses dropout (it would fall back to
the math kernel on both sides). ``use_cache`` is left at the configs' default.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers.utils import logging

logging.set_verbosity_error()

#: model -> size -> shape. ``cpu`` and ``cpu-quick`` are sized for one CPU thread per process
#: (the whole ladder of one model in a few minutes on 2 cores); ``cuda`` and ``cuda-quick`` for
#: one large GPU in bf16 (the Llama is benchmarks/gpu.py's speed Llama: TinyLlama's widths).
SHAPES: dict[str, dict[str, dict[str, Any]]] = {
    "gpt2": {
        "cpu": {"hidden": 256, "layers": 4, "heads": 4, "vocab": 8192},
        "cpu-quick": {"hidden": 128, "layers": 2, "heads": 2, "vocab": 4096},
        "cuda": {"hidden": 1024, "layers": 24, "heads": 16, "vocab": 50304},
        "cuda-quick": {"hidden": 768, "layers": 12, "heads": 12, "vocab": 50304},
    },
    "llama": {
        "cpu": {
            "hidden": 256,
            "intermediate": 688,
            "layers": 4,
            "heads": 4,
            "kv_heads": 2,
            "vocab": 8192,
        },
        "cpu-quick": {
            "hidden": 128,
            "intermediate": 344,
            "layers": 2,
            "heads": 2,
            "kv_heads": 1,
            "vocab": 4096,
        },
        "cuda": {
            "hidden": 2048,
            "intermediate": 5632,
            "layers": 16,
            "heads": 16,
            "kv_heads": 8,
            "vocab": 32000,
        },
        "cuda-quick": {
            "hidden": 1024,
            "intermediate": 2816,
            "layers": 8,
            "heads": 16,
            "kv_heads": 8,
            "vocab": 32000,
        },
    },
}


def describe(model: str, shape: dict[str, Any]) -> str:
    """One line: the model's widths, as the ladder prints them."""
    gqa = (
        f", {shape['heads']} heads / {shape['kv_heads']} key-value"
        if "kv_heads" in shape
        else f", {shape['heads']} heads"
    )
    return (
        f"{model}: {shape['layers']} layers, hidden {shape['hidden']}{gqa}, "
        f"vocab {shape['vocab']}, microbatch {shape.get('batch', 1)} x {shape['seq']}, "
        f"{shape.get('dtype', 'float32')}"
    )


def build(
    model: str,
    *,
    hidden: int,
    layers: int,
    heads: int,
    vocab: int,
    seq: int,
    intermediate: int | None = None,
    kv_heads: int | None = None,
    batch: int = 1,
    dtype: str = "float32",
):
    """``(model, args, kwargs)``: the model (seeded, in ``dtype``, training mode) and one example
    microbatch of ``batch`` x ``seq`` random tokens with its labels."""
    torch.manual_seed(0)
    if model == "gpt2":
        config = GPT2Config(
            n_layer=layers,
            n_embd=hidden,
            n_head=heads,
            vocab_size=vocab,
            n_positions=seq,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
        module = GPT2LMHeadModel(config)
    elif model == "llama":
        config = LlamaConfig(
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            vocab_size=vocab,
            max_position_embeddings=seq,
        )
        module = LlamaForCausalLM(config)
    else:
        raise ValueError(f"unknown model {model!r}: gpt2 or llama")
    module = module.to(getattr(torch, dtype)).train()
    ids = torch.randint(0, vocab, (batch, seq))
    return module, (ids,), {"labels": ids.clone()}


def batches(step: int, *, rows: int, seq: int, vocab: int):
    """A step's batch: ``rows`` random sequences of ``seq`` tokens (seeded by the step) and
    their labels, ``(args, kwargs)`` as ``train.py --data`` takes it."""
    generator = torch.Generator().manual_seed(2000 + step)
    ids = torch.randint(0, vocab, (rows, seq), generator=generator)
    return (ids,), {"labels": ids.clone()}
