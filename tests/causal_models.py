"""Models for tests/test_causal_mask.py and tests/test_grouped_query.py: attention masks a pass recognises as causal (Llama's and
GPT-2's, built from sizes under tracing; hand-written ones) and masks that must stay explicit
(padding, sliding windows shorter than the sequence, a mask that is not causal); keys and values
repeated for grouped-query attention, as Hugging Face repeats them and otherwise."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

BATCH, SEQ, VOCAB = 2, 12, 100
DROPOUT = 0.1


def _ids(seq: int = SEQ) -> torch.Tensor:
    return torch.randint(3, VOCAB, (BATCH, seq), generator=torch.Generator().manual_seed(1))


def _decoder(config_cls, model_cls, **extra):
    torch.manual_seed(0)
    config = config_cls(
        **(
            dict(
                vocab_size=VOCAB,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=64,
                attention_dropout=DROPOUT,
                pad_token_id=0,
                bos_token_id=1,
                eos_token_id=2,
            )
            | extra
        )
    )
    return model_cls(config)


def llama():
    """Llama without an attention mask: its causal mask is built from sizes only."""
    from transformers import LlamaConfig, LlamaForCausalLM

    ids = _ids()
    return _decoder(LlamaConfig, LlamaForCausalLM), (ids,), {"labels": ids.clone()}


def llama_padded():
    """The same Llama given an attention mask with padding (the last sequence's last 3)."""
    model, (ids,), kwargs = llama()
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[-1, SEQ - 3 :] = 0
    labels = ids.clone()
    labels[mask == 0] = -100
    return model, (ids,), {"attention_mask": mask, "labels": labels}


def mistral_window():
    """Mistral with a sliding window (4) shorter than the sequence (12)."""
    from transformers import MistralConfig, MistralForCausalLM

    ids = _ids()
    model = _decoder(MistralConfig, MistralForCausalLM, sliding_window=4)
    return model, (ids,), {"labels": ids.clone()}


def qwen2_window():
    """Qwen2 with sliding-window attention in every layer (window 4, sequence 12)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    ids = _ids()
    model = _decoder(
        Qwen2Config,
        Qwen2ForCausalLM,
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=0,
    )
    assert set(model.config.layer_types) == {"sliding_attention"}
    return model, (ids,), {"labels": ids.clone()}


def _gpt2(dropout: float):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=32,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=0,
        eos_token_id=0,
    )
    ids = _ids()
    return GPT2LMHeadModel(config), (ids,), {"labels": ids.clone()}


def gpt2():
    """GPT-2 with dropout everywhere (attention's too)."""
    return _gpt2(DROPOUT)


def gpt2_plain():
    """GPT-2 without dropout, 2 layers of 4 heads: its fused ``c_attn`` and ``Conv1D``
    projections (weights stored [in, out]) sharded by tensor parallelism
    (tests/test_tensor_parallel_training.py); its head is tied to the embedding."""
    return _gpt2(0.0)


class HandMasked(nn.Module):
    """Self-attention with a mask it builds from the sequence length: ``kind`` "causal" (bool
    ``tril``), "float" (0 / -inf, ``triu(1)``), "full" (all True: masks nothing), "future"
    (``triu``: not causal), "window" (a causal band of 3: not causal either)."""

    def __init__(self, kind: str, width: int = 16, heads: int = 2):
        super().__init__()
        self.kind, self.heads = kind, heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def mask(self, seq: int, device: torch.device) -> torch.Tensor:
        ones = torch.ones(seq, seq, dtype=torch.bool, device=device)
        if self.kind == "causal":
            return ones.tril()
        if self.kind == "float":
            return torch.full((seq, seq), float("-inf"), device=device).triu(1)
        if self.kind == "full":
            return ones
        if self.kind == "future":
            return ones.triu()
        assert self.kind == "window"
        return ones.tril() & ~ones.tril(-3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = (
            t.reshape(batch, seq, self.heads, -1).transpose(1, 2)
            for t in self.qkv(x).chunk(3, dim=-1)
        )
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=self.mask(seq, x.device), dropout_p=DROPOUT if self.training else 0.0
        )
        return self.out(y.transpose(1, 2).reshape(batch, seq, width)).sum()


def _hand(kind: str):
    torch.manual_seed(0)
    x = torch.randn(BATCH, SEQ, 16, generator=torch.Generator().manual_seed(1))
    return HandMasked(kind), (x,), {}


def hand_causal():
    return _hand("causal")


def hand_float():
    return _hand("float")


def hand_full():
    return _hand("full")


def hand_future():
    return _hand("future")


def hand_window():
    return _hand("window")


class HandGrouped(nn.Module):
    """Causal grouped-query attention, 4 query heads over 2 key/value heads, the keys and values
    repeated per query head by ``repeat``: "expand" (Hugging Face's ``repeat_kv``: query head h
    reads key/value head h // 2), "tiled" (expanded before the heads: query head h reads key/value
    head h % 2, which ``enable_gqa`` does not compute), "interleave" (``repeat_interleave``, the
    same heads as "expand")."""

    def __init__(self, repeat: str, width: int = 16, heads: int = 4, groups: int = 2):
        super().__init__()
        self.repeat, self.heads, self.groups = repeat, heads, groups
        self.head = width // heads
        self.q = nn.Linear(width, width)
        self.kv = nn.Linear(width, 2 * groups * self.head)
        self.out = nn.Linear(width, width)

    def repeated(self, x: torch.Tensor) -> torch.Tensor:
        batch, groups, seq, head = x.shape
        n = self.heads // groups
        if self.repeat == "expand":
            return x[:, :, None].expand(batch, groups, n, seq, head).reshape(batch, -1, seq, head)
        if self.repeat == "tiled":
            return x[:, None].expand(batch, n, groups, seq, head).reshape(batch, -1, seq, head)
        assert self.repeat == "interleave"
        return x.repeat_interleave(n, dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q = self.q(x).reshape(batch, seq, self.heads, self.head).transpose(1, 2)
        k, v = (
            t.reshape(batch, seq, self.groups, self.head).transpose(1, 2)
            for t in self.kv(x).chunk(2, dim=-1)
        )
        y = F.scaled_dot_product_attention(
            q,
            self.repeated(k),
            self.repeated(v),
            dropout_p=DROPOUT if self.training else 0.0,
            is_causal=True,
        )
        return self.out(y.transpose(1, 2).reshape(batch, seq, width)).sum()


def _grouped(repeat: str):
    torch.manual_seed(0)
    x = torch.randn(BATCH, SEQ, 16, generator=torch.Generator().manual_seed(1))
    return HandGrouped(repeat), (x,), {}


def grouped_expand():
    return _grouped("expand")


def grouped_tiled():
    return _grouped("tiled")


def grouped_interleave():
    return _grouped("interleave")


def llama_plain():
    """Llama of 4 layers without dropout, its causal mask built from sizes
    (tests/test_data_inputs.py trains it through torchrun against PyTorch)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    ids = _ids()
    model = _decoder(LlamaConfig, LlamaForCausalLM, attention_dropout=0.0, num_hidden_layers=4)
    return model, (ids,), {"labels": ids.clone()}


def llama_unpadded():
    """llama_plain without a padding token: its embedding a plain lookup, which tensor
    parallelism shards by vocabulary rows (tests/test_tensor_parallel_training.py)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    ids = _ids()
    model = _decoder(
        LlamaConfig,
        LlamaForCausalLM,
        attention_dropout=0.0,
        num_hidden_layers=4,
        pad_token_id=None,
    )
    return model, (ids,), {"labels": ids.clone()}


def llama_plain_batch(step: int, microbatches: int = 4):
    """A step's batch of ``microbatches`` example microbatches, labels the ids."""
    generator = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(3, VOCAB, (BATCH * microbatches, SEQ), generator=generator)
    return (ids,), {"labels": ids.clone()}


def llama_unseeded_batch(step: int, microbatches: int = 4):
    """llama_plain_batch drawn from torch's global generator (as many users' functions do)."""
    ids = torch.randint(3, VOCAB, (BATCH * microbatches, SEQ))
    return (ids,), {"labels": ids.clone()}


def llama_seeded_batches(seed: int):
    """The batches train.py's data path gives llama_unseeded_batch at ``--seed seed``."""

    def batches(step: int, microbatches: int = 4):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed * 1_000_003 + step + 7_777_777)
            return llama_unseeded_batch(step, microbatches)

    return batches


class _ExplicitHeads(nn.Module):
    """A decoder block written by hand: biased projections, heads split and merged by views
    that name their sizes (4 heads of 8), a GELU MLP, an untied head (tests/
    test_tensor_parallel_training.py: the sizes become -1 under tensor parallelism)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.norm1, self.norm2 = nn.LayerNorm(32), nn.LayerNorm(32)
        # the keys' bias has no gradient (softmax ignores what it adds to each query's
        # scores): AdamW would turn its rounding noise into updates, so the keys have none
        self.q, self.v, self.o = (nn.Linear(32, 32) for _ in range(3))
        self.k = nn.Linear(32, 32, bias=False)
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        b, s, _ = x.shape
        h = self.norm1(x)
        q, k, v = (p(h).view(b, s, 4, 8).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, 32))
        x = x + self.down(F.gelu(self.up(self.norm2(x))))
        return F.cross_entropy(self.head(x).view(-1, VOCAB), labels.view(-1))


def explicit_heads():
    torch.manual_seed(0)
    ids = _ids()
    return _ExplicitHeads(), (ids, ids.clone()), {}


def explicit_heads_batch(step: int, microbatches: int = 4):
    """A step's batch of ``microbatches`` example microbatches for explicit_heads."""
    generator = torch.Generator().manual_seed(200 + step)
    ids = torch.randint(3, VOCAB, (BATCH * microbatches, SEQ), generator=generator)
    return (ids, ids.clone()), {}


def llama_70b_shaped():
    """Llama-3-70B's layer (width 8192, 64 query / 8 key-value heads, MLP 28672, vocabulary
    128256), 8 of its 80 layers, sequence 1024, bf16, on meta weights (``autopipe.empty_weights``:
    nothing allocated): the fake-CUDA dry run of one rank of TP 8 x PP 4 x FSDP 2
    (tests/test_tensor_parallel_training.py)."""
    import autopipe
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=8,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=1024,
        use_cache=False,
    )
    with autopipe.empty_weights():
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    ids = torch.randint(0, 128256, (1, 1024))
    return model, (ids,), {"labels": ids}
