"""Models the tests compile, each a spec function returning (model, args[, kwargs[, target]]).

Hugging Face models are built from tiny configs (no downloads) with dropout off, so the pipeline and
the original can be compared exactly. Data functions (``*_batch``) feed train.py with ``--data``.
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.distributed.pipelining import pipe_split
from torch.nn import functional as F
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

BATCH = 2


def gpt2(layers: int = 3):
    """GPT-2 with tied input embedding and LM head, trained on its own loss (labels)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=layers,
        n_embd=32,
        n_head=4,
        vocab_size=97,
        n_positions=32,
        use_cache=False,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight
    ids = torch.randint(0, 97, (BATCH, 16))
    return model, (ids,), {"labels": ids.clone()}


def gpt2_meta():
    """The same GPT-2, built on the meta device: no weights exist at compile time."""
    with torch.device("meta"):
        model, args, kwargs = gpt2()
    return model, args, kwargs


def gpt2_meta_24():
    """GPT-2 with 24 layers on the meta device (how long generated code is)."""
    with torch.device("meta"):
        return gpt2(layers=24)


def gpt2_wide_meta():
    """A GPT-2 whose parameters outweigh its activations (width 512, 4 tokens), on meta: the
    model sharding is for."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=4, n_embd=512, n_head=8, vocab_size=97, n_positions=8, use_cache=False
    )
    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
        ids = torch.zeros((1, 4), dtype=torch.long)
    return model, (ids,), {"labels": ids.clone()}


def gpt2_batch(step: int, microbatches: int = 4):
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, 97, (BATCH * microbatches, 16), generator=g)
    return (ids,), {"labels": ids.clone()}


def gpt2_batch_of_eight(step: int):
    """gpt2_batch of 8 microbatches' rows: 2 microbatches for each of 4 data-parallel ranks."""
    return gpt2_batch(step, 8)


def gpt2_batch_with_ignored_labels(step: int, microbatches: int = 4):
    """gpt2_batch, but step 1's labels are all the ignore index: its loss is 0 / 0 = NaN."""
    args, kwargs = gpt2_batch(step, microbatches)
    if step == 1:
        kwargs["labels"] = torch.full_like(kwargs["labels"], -100)
    return args, kwargs


def gpt2_batch_slowly(step: int, microbatches: int = 4):
    """gpt2_batch, a quarter of a second late: gives a test time to kill a rank mid-run."""
    import time

    time.sleep(0.25)
    return gpt2_batch(step, microbatches)


def gpt2_batch_held_at_step_2(step: int, microbatches: int = 4):
    """gpt2_batch; step 2's batch waits until the file $HOLD_UNTIL exists: a run stays live
    (its checkpoint directory locked) while a test does something beside it."""
    import time

    gate = os.environ["HOLD_UNTIL"]
    deadline = time.monotonic() + 120
    while step == 2 and not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.05)
    return gpt2_batch(step, microbatches)


class TokenWindows(torch.utils.data.Dataset):
    """Windows of 16 tokens of a fixed random sequence, as dicts of the model's inputs."""

    def __init__(self, samples: int = 40):
        self.tokens = torch.randint(
            0, 97, (samples + 16,), generator=torch.Generator().manual_seed(5)
        )
        self.samples = samples

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        window = self.tokens[i : i + 16]
        return {"input_ids": window, "labels": window.clone()}


def gpt2_dataset() -> TokenWindows:
    """A Dataset factory for train.py --data."""
    return TokenWindows()


def bert():
    """BERT masked LM with an attention mask (padding in the second sequence)."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    config = BertConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        intermediate_size=64,
        vocab_size=101,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = BertForMaskedLM(config)
    ids = torch.randint(0, 101, (BATCH, 12))
    mask = torch.ones(BATCH, 12, dtype=torch.long)
    mask[1, 8:] = 0
    labels = torch.full((BATCH, 12), -100)
    labels[:, ::3] = ids[:, ::3]
    return model, (ids,), {"attention_mask": mask, "labels": labels}


def t5():
    """T5: the encoder's output is read by every decoder layer (cross-attention fan-out)."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(
        num_layers=2,
        num_decoder_layers=2,
        d_model=32,
        d_kv=8,
        num_heads=4,
        d_ff=64,
        vocab_size=103,
        dropout_rate=0.0,
        use_cache=False,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    model = T5ForConditionalGeneration(config)
    ids = torch.randint(1, 103, (BATCH, 10))
    labels = torch.randint(1, 103, (BATCH, 7))
    return model, (ids,), {"labels": labels}


def t5_batch(step: int, microbatches: int = 4):
    g = torch.Generator().manual_seed(3000 + step)
    ids = torch.randint(1, 103, (BATCH * microbatches, 10), generator=g)
    return (ids,), {"labels": torch.randint(1, 103, (BATCH * microbatches, 7), generator=g)}


class ConvNet(nn.Module):
    """Convolutions with BatchNorm (running statistics) and in-place ReLU."""

    def __init__(self, classes: int = 5):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(inplace=True),
            nn.Conv2d(8, 16, 3, stride=2, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(inplace=True),
            nn.Conv2d(16, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(inplace=True),
        )
        self.head = nn.Linear(16, classes)

    def forward(self, x):
        return self.head(self.features(x).mean((2, 3)))


def cnn():
    torch.manual_seed(0)
    return ConvNet(), (torch.randn(BATCH, 3, 8, 8),)


def cnn_with_target():
    model, args = cnn()
    return model, args, {}, torch.tensor([1, 3])


def cross_entropy(output, target):
    return F.cross_entropy(output, target)


def cnn_batch(step: int, microbatches: int = 4):
    g = torch.Generator().manual_seed(2000 + step)
    x = torch.randn(BATCH * microbatches, 3, 8, 8, generator=g)
    return (x,), {}, torch.randint(0, 5, (BATCH * microbatches,), generator=g)


def gpt2_labels_are_ids():
    """GPT-2 with the causal-LM tutorial idiom: the example passes one tensor object as both
    input_ids and labels."""
    model, (ids,), _ = gpt2()
    return model, (ids,), {"labels": ids}


def gpt2_batch_other_labels(step: int, microbatches: int = 4):
    """Labels that are not the input ids: a pipeline that merged the two inputs would differ."""
    (ids,), _ = gpt2_batch(step, microbatches)
    g = torch.Generator().manual_seed(5000 + step)
    return (ids,), {"labels": torch.randint(0, 97, ids.shape, generator=g)}


class MaskIgnored(nn.Module):
    """Takes an optional mask it never reads, as many models do for some configurations."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(16, 16)
        self.second = nn.Linear(16, 1)

    def forward(self, x, mask=None):
        return self.second(torch.tanh(self.first(x))).squeeze(-1)


def mask_ignored_with_target():
    torch.manual_seed(0)
    x = torch.randn(BATCH * 2, 16)
    return MaskIgnored(), (x, torch.ones(BATCH * 2, 16)), {}, torch.zeros(BATCH * 2)


def mask_ignored_batch(step: int, microbatches: int = 4):
    (x,), _, target = mlp_batch(step, microbatches)
    return (x, torch.ones_like(x)), {}, target


class SkipMLP(nn.Module):
    """An MLP whose early activations are read by much later layers (long skip connections)."""

    def __init__(self, width: int = 16, depth: int = 6):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.out = nn.Linear(width, 1)

    def forward(self, x):
        first = h = torch.tanh(self.layers[0](x))
        skips = [h]
        for i, layer in enumerate(self.layers[1:], 1):
            h = torch.tanh(layer(h))
            if i % 2 == 0:
                h = h + skips[-2 if len(skips) > 1 else -1]
            skips.append(h)
        return self.out(h + first).squeeze(-1)


def mlp():
    torch.manual_seed(0)
    return SkipMLP(), (torch.randn(BATCH * 2, 16),)


def mlp_with_target():
    model, args = mlp()
    return model, args, {}, torch.zeros(BATCH * 2)


def mse(output, target):
    return F.mse_loss(output, target)


def mlp_batch(step: int, microbatches: int = 4):
    g = torch.Generator().manual_seed(4000 + step)
    x = torch.randn(BATCH * 2 * microbatches, 16, generator=g)
    return (x,), {}, x.sum(-1).sin()


class MultiIO(nn.Module):
    """Several inputs, a keyword argument, and a dict of outputs."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(4, 8)
        self.mix = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x, y, scale=None, flag: bool = True):
        h = torch.relu(self.a(x)) + self.b(y)
        if scale is not None:
            h = h * scale.unsqueeze(-1)
        h = self.mix(h)
        logits = self.head(h)
        return {"logits": logits, "hidden": h, "score": logits.logsumexp(-1).mean()}


def multi_io():
    torch.manual_seed(0)
    x, y = torch.randn(BATCH, 8), torch.randn(BATCH, 4)
    return MultiIO(), (x, y), {"scale": torch.rand(BATCH) + 0.5}


class Branchy(nn.Module):
    """Data-dependent control flow: cannot be traced into one graph."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        if h.sum() > 0:
            return h * 2
        return h


def branchy():
    return Branchy(), (torch.randn(2, 4),)


def not_a_model():
    return "model", (torch.randn(2),)


class ChannelsLastNet(nn.Module):
    """Convolutions in channels-last memory format, as diffusion UNets run them: a stage
    boundary must hand the next stage its activation in that format, or results change in
    the last bits."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.SiLU())
            for _ in range(4)
        )
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        x = x.contiguous(memory_format=torch.channels_last)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x.mean((2, 3)))


def channels_last():
    torch.manual_seed(0)
    return ChannelsLastNet(), (torch.randn(BATCH, 16, 24, 24),)


def channels_last_with_target():
    model, args = channels_last()
    return model, args, {}, torch.zeros(BATCH, dtype=torch.long)


def channels_last_batch(step: int, microbatches: int = 4):
    g = torch.Generator().manual_seed(6000 + step)
    x = torch.randn(BATCH * microbatches, 16, 24, 24, generator=g)
    return (x,), {}, torch.randint(0, 3, (BATCH * microbatches,), generator=g)


class MaskedSum(nn.Module):
    """Sizes computed from tensor values: the rows a mask selects, and a count read with
    .item() and used to slice. For this model's data both are fixed (3 of 4 rows marked)."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 8)

    def forward(self, x):
        h = torch.tanh(self.first(x))
        keep = x[:, 0] > 0
        selected = self.second(h[keep])  # rows: how many marks are positive
        count = int(keep.sum().item())
        return (
            (selected.sum(0) + h[:count].mean(0))
            .sum(-1, keepdim=True)
            .expand(x.shape[0], 1)
            .squeeze(-1)
        )


def _marked(rows: int, generator: torch.Generator | None = None) -> torch.Tensor:
    x = torch.randn(rows, 8, generator=generator)
    x[:, 0] = x[:, 0].abs() + 0.1
    x[3::4, 0] = -x[3::4, 0]  # every fourth row unmarked: 3 of every 4 selected
    return x


def masked_sum():
    torch.manual_seed(0)
    return MaskedSum(), (_marked(4),)


def masked_sum_with_target():
    model, args = masked_sum()
    return model, args, {}, torch.zeros(4)


def masked_sum_batch(step: int, microbatches: int = 4):
    g = torch.Generator().manual_seed(7000 + step)
    x = _marked(4 * microbatches, g)
    return (x,), {}, torch.randn(4 * microbatches, generator=g)


def masked_sum_batch_unlike_the_example(step: int, microbatches: int = 4):
    """masked_sum_batch, but step 1 marks every row: more rows than the pipeline was compiled for."""
    (x,), _, target = masked_sum_batch(step, microbatches)
    if step == 1:
        x[:, 0] = x[:, 0].abs() + 0.1
    return (x,), {}, target


class ValueChecked(nn.Module):
    """A model checking its input's values, as LLaVA checks its image tokens: a branch whose
    other side only raises, an assert and torch._check_tensor_all. Every check holds for this
    model's data (3 of every 4 rows marked, finite values)."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 1)

    def forward(self, x):
        marked = x[:, 0] > 0
        if marked.sum() != 3 * (x.shape[0] // 4):
            raise ValueError(f"3 of every 4 rows must be marked, got {int(marked.sum())}")
        torch._check_tensor_all(x.isfinite(), lambda: "the input holds inf or nan")
        h = torch.tanh(self.first(x))
        assert (h.abs() <= 1).all(), "tanh left its range"
        return self.second(h * marked[:, None]).squeeze(-1)


def value_checked():
    torch.manual_seed(0)
    return ValueChecked(), (_marked(4),)


def value_checked_with_target():
    model, args = value_checked()
    return model, args, {}, torch.zeros(4)


def value_checked_batch(step: int, microbatches: int = 4):
    return masked_sum_batch(step, microbatches)


def value_checked_batch_unlike_the_example(step: int, microbatches: int = 4):
    """value_checked_batch, but step 1 marks every row, which the model's check refuses."""
    return masked_sum_batch_unlike_the_example(step, microbatches)


def expect_rows(cond, message, error_type=KeyError):
    """A library's check wrapper, as transformers' torch_compilable_check: under tracing it
    hands torch the condition alone."""
    torch._check_tensor_all(cond)


def require(cond, msg):
    """A wrapper handing torch its message as a function."""
    torch._check_tensor_all(cond, lambda: msg)


class CheckedThroughHelpers(nn.Module):
    """Checks written other ways: through a wrapper passing on its caller's message, and an
    if whose else alone raises (the example takes the side that works)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        marked = x[:, 0] > 0
        expect_rows(marked.sum() == 3 * (x.shape[0] // 4), f"{marked.sum()} rows marked")
        require(x.isfinite(), "the input holds inf or nan")
        h = self.fc(x)
        if marked.any():
            h = h * 2
        else:
            reason = "no row is marked"
            raise ValueError(reason)
        return h.sum(-1)


def checked_through_helpers():
    torch.manual_seed(0)
    return CheckedThroughHelpers(), (_marked(4),)


class NotChecks(nn.Module):
    """Branches on tensor values that look like checks and are not: two values combined so
    that one can change without raising, and a raise the forward catches."""

    def __init__(self, which: str):
        super().__init__()
        self.which = which
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        if self.which == "and":
            if (x[:, 0] > 0).any() and (x[:, 1] > 5).any():
                raise ValueError("rows marked in both columns")
        else:
            try:
                if (x[:, 1] > 5).any():
                    raise ValueError("too large")
                h = h * 2
            except ValueError:
                h = h * 3
        return h.sum(-1)


def not_a_check_and():
    return NotChecks("and"), (_marked(4),)


def not_a_check_caught():
    return NotChecks("caught"), (_marked(4),)


class GRUSeq2Seq(nn.Module):
    """A 2-layer bidirectional GRU encoder and a GRU decoder started from the encoder's last
    states (through a bridge), over padded tensors."""

    def __init__(self, vocab: int = 50, hidden: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.encoder = nn.GRU(hidden, hidden, num_layers=2, batch_first=True, bidirectional=True)
        self.bridge = nn.Linear(2 * hidden, hidden)
        self.decoder = nn.GRU(hidden, hidden, batch_first=True)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, src, tgt):
        encoded, states = self.encoder(self.embed(src))
        start = torch.tanh(self.bridge(torch.cat([states[-2], states[-1]], -1)))[None]
        decoded, _ = self.decoder(self.embed(tgt), start)
        return self.out(decoded + encoded[:, -1:, : decoded.shape[-1]])


def gru_seq2seq(batch: int = 2, seed: int = 0):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1 + seed)
    return GRUSeq2Seq(), (
        torch.randint(0, 50, (batch, 7), generator=g),
        torch.randint(0, 50, (batch, 5), generator=g),
    )


class StackedRNN(nn.Module):
    """A 3-layer ReLU RNN (time first) started from given initial states."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.RNN(8, 16, num_layers=3, nonlinearity="relu")
        self.head = nn.Linear(16, 1)

    def forward(self, x, h0):
        y, h = self.rnn(x, h0)
        return self.head(y).squeeze(-1).sum(0) + h.sum((0, 2))


def stacked_rnn(batch: int = 2, seed: int = 0):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1 + seed)
    return StackedRNN(), (
        torch.randn(6, batch, 8, generator=g),
        torch.randn(3, batch, 16, generator=g),
    )


class TimeFirstLSTM(nn.Module):
    """A 2-layer LSTM over time-first sequences (time, batch, features), started from given
    initial states (layers, batch, hidden): every input holds its batch along dimension 1; its
    output (batch,) along dimension 0."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(8, 16, num_layers=2)
        self.head = nn.Linear(16, 1)

    def forward(self, x, h0, c0):
        y, (h, c) = self.lstm(x, (h0, c0))
        return self.head(y).squeeze(-1).mean(0) + (h - c).mean((0, 2))


def _time_first(batch: int, seed: int):
    g = torch.Generator().manual_seed(1 + seed)
    x = torch.randn(5, batch, 8, generator=g)
    h0, c0 = torch.randn(2, batch, 16, generator=g), torch.randn(2, batch, 16, generator=g)
    return (x, h0, c0), torch.randn(batch, generator=g)


def time_first_lstm(batch: int = 2, seed: int = 0):
    """TimeFirstLSTM, its example microbatch of ``batch`` sequences and their target."""
    torch.manual_seed(0)
    args, target = _time_first(batch, seed)
    return TimeFirstLSTM(), args, {}, target


def time_first_lstm_batch(step: int, microbatches: int = 4):
    """A step's batch of ``microbatches`` example microbatches, time first: x (5, 2m, 8), h0
    and c0 (2, 2m, 16), the target (2m,)."""
    args, target = _time_first(2 * microbatches, 1000 + step)
    return list(args), {}, target


def time_first_lstm_short_state_batch(step: int, microbatches: int = 4):
    """time_first_lstm_batch with initial states of 6 sequences (dimension 1) instead of 8."""
    (x, h0, c0), kwargs, target = time_first_lstm_batch(step, microbatches)
    return [x, h0[:, :6], c0[:, :6]], kwargs, target


class LSTMLanguageModel(nn.Module):
    """A 2-layer LSTM language model over padded tensors, its output layer tied to its
    embedding."""

    def __init__(self, vocab: int = 40, hidden: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.lstm = nn.LSTM(hidden, hidden, num_layers=2, batch_first=True)
        self.out = nn.Linear(hidden, vocab)
        self.out.weight = self.embed.weight

    def forward(self, ids):
        y, _ = self.lstm(self.embed(ids))
        return self.out(y)


def lstm_lm(batch: int = 3, seed: int = 0):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1 + seed)
    return LSTMLanguageModel(), (torch.randint(0, 40, (batch, 6), generator=g),)


def _lengths(batch: int, steps: int, g: torch.Generator, longest: bool = True) -> torch.Tensor:
    """Unequal sequence lengths in [1, steps], one of them ``steps`` when ``longest``."""
    lengths = torch.randint(1, steps + 1, (batch,), generator=g)
    if longest:
        lengths[torch.randint(0, batch, (1,), generator=g)] = steps
    return lengths


class PackedLSTMLanguageModel(nn.Module):
    """A 2-layer LSTM language model over packed sequences of unequal lengths (unsorted),
    unpacked to the batch's length, its output layer tied to its embedding."""

    def __init__(self, vocab: int = 40, hidden: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.lstm = nn.LSTM(hidden, hidden, num_layers=2, batch_first=True)
        self.out = nn.Linear(hidden, vocab)
        self.out.weight = self.embed.weight

    def forward(self, ids, lengths):
        packed = pack_padded_sequence(
            self.embed(ids), lengths, batch_first=True, enforce_sorted=False
        )
        y, _ = self.lstm(packed)
        y, _ = pad_packed_sequence(y, batch_first=True, total_length=ids.size(1))
        return self.out(y)


def packed_lstm_lm(batch: int = 4, seed: int = 0):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1 + seed)
    ids = torch.randint(0, 40, (batch, 7), generator=g)
    return PackedLSTMLanguageModel(), (ids, _lengths(batch, 7, g, longest=False))


class PackedGRUSeq2Seq(nn.Module):
    """A bidirectional 2-layer GRU encoder over packed sources (unsorted, unpacked to the
    longest source) and a GRU decoder over packed targets started from the encoder's states."""

    def __init__(self, vocab: int = 50, hidden: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.encoder = nn.GRU(hidden, hidden, num_layers=2, batch_first=True, bidirectional=True)
        self.bridge = nn.Linear(2 * hidden, hidden)
        self.decoder = nn.GRU(hidden, hidden, batch_first=True)
        self.out = nn.Linear(hidden + 2 * hidden, vocab)

    def forward(self, src, src_lengths, tgt, tgt_lengths):
        packed = pack_padded_sequence(
            self.embed(src), src_lengths, batch_first=True, enforce_sorted=False
        )
        encoded, states = self.encoder(packed)
        encoded, _ = pad_packed_sequence(encoded, batch_first=True)
        start = torch.tanh(self.bridge(torch.cat([states[-2], states[-1]], -1)))[None]
        packed = pack_padded_sequence(
            self.embed(tgt), tgt_lengths, batch_first=True, enforce_sorted=False
        )
        decoded, _ = self.decoder(packed, start)
        decoded, _ = pad_packed_sequence(decoded, batch_first=True, total_length=tgt.size(1))
        context = encoded.mean(1, keepdim=True).expand(-1, decoded.size(1), -1)
        return self.out(torch.cat([decoded, context], -1))


def packed_gru_seq2seq(batch: int = 3, seed: int = 0):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1 + seed)
    src, tgt = torch.randint(0, 50, (batch, 7), generator=g), torch.randint(
        0, 50, (batch, 5), generator=g
    )
    return PackedGRUSeq2Seq(), (src, _lengths(batch, 7, g), tgt, _lengths(batch, 5, g))


def packed_gru_seq2seq_with_target():
    model, args = packed_gru_seq2seq()
    return model, args, {}, torch.randint(0, 50, (3, 5), generator=torch.Generator().manual_seed(9))


def packed_gru_seq2seq_batch(step: int, microbatches: int = 4):
    """Microbatches of 3 pairs, each with a source of the example's longest length (7)."""
    chunks = [packed_gru_seq2seq(seed=100 * step + i)[1] for i in range(microbatches)]
    args = [torch.cat(parts) for parts in zip(*chunks)]
    g = torch.Generator().manual_seed(5000 + step)
    return args, {}, torch.randint(0, 50, (3 * microbatches, 5), generator=g)


def sequence_cross_entropy(output, target):
    return F.cross_entropy(output.flatten(0, 1), target.flatten())


class PackedStackedRNN(nn.Module):
    """A 3-layer tanh RNN, time first, over packed sequences given sorted (longest first),
    started from given initial states; unpacked with -1 after each sequence's end."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.RNN(8, 16, num_layers=3)
        self.head = nn.Linear(16, 1)

    def forward(self, x, lengths, h0):
        y, h = self.rnn(pack_padded_sequence(x, lengths), h0)
        y, _ = pad_packed_sequence(y, padding_value=-1.0, total_length=x.size(0))
        return self.head(y).squeeze(-1).sum(0) + h.sum((0, 2))


class PackedStackedRNNBatchFirst(PackedStackedRNN):
    """PackedStackedRNN taking its inputs batch first (train.py splits microbatches along
    dimension 0): the time-first batch and the (layers, batch, hidden) initial states are
    transposed in forward."""

    def forward(self, x, lengths, h0):
        return super().forward(x.transpose(0, 1), lengths, h0.transpose(0, 1).contiguous())


def packed_stacked_rnn_with_target():
    _, (x, lengths, h0) = packed_stacked_rnn()
    target = torch.randn(3, generator=torch.Generator().manual_seed(9))
    return (
        PackedStackedRNNBatchFirst(),
        (x.transpose(0, 1), lengths, h0.transpose(0, 1)),
        {},
        target,
    )


def packed_stacked_rnn_batch(step: int, microbatches: int = 4):
    """Microbatches of 3 sequences, each sorted by length (the model packs them sorted)."""
    chunks = []
    for i in range(microbatches):
        _, (x, lengths, h0) = packed_stacked_rnn(seed=100 * step + i)
        chunks.append((x.transpose(0, 1), lengths, h0.transpose(0, 1)))
    args = [torch.cat(parts) for parts in zip(*chunks)]
    g = torch.Generator().manual_seed(6000 + step)
    return args, {}, torch.randn(3 * microbatches, generator=g)


def packed_stacked_rnn(batch: int = 3, seed: int = 0):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1 + seed)
    lengths = _lengths(batch, 6, g).sort(descending=True).values
    return PackedStackedRNN(), (
        torch.randn(6, batch, 8, generator=g),
        lengths,
        torch.randn(3, batch, 16, generator=g),
    )


class PackUnpack(nn.Module):
    """Packs a projected batch and unpacks it again, with no RNN between, to a length between
    the longest sequence and the padded one: zeros after each sequence's end."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x, lengths):
        packed = pack_padded_sequence(self.proj(x), lengths, batch_first=True, enforce_sorted=False)
        y, _ = pad_packed_sequence(packed, batch_first=True, total_length=6)
        return y.tanh()


def pack_unpack(batch: int = 3, seed: int = 0):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1 + seed)
    lengths = torch.randint(1, 6, (batch,), generator=g)
    return PackUnpack(), (torch.randn(batch, 7, 8, generator=g), lengths)


class PackedTokenCount(nn.Module):
    """Divides by the packed data's rows (the batch's tokens): refused, autopipe carries packed
    sequences as padded tensors."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(8, 8, batch_first=True)

    def forward(self, x, lengths):
        y, _ = self.rnn(pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False))
        tokens = y.data.size(0)
        return y.data.sum() / tokens


def packed_token_count():
    g = torch.Generator().manual_seed(1)
    return PackedTokenCount(), (torch.randn(3, 5, 8, generator=g), torch.tensor([5, 2, 4]))


class PackedDataChanged(nn.Module):
    """Applies dropout to a packed sequence's data itself and packs it again: autopipe carries
    packed sequences as padded tensors, so this is refused at that line."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(8, 8, batch_first=True)

    def forward(self, x, lengths):
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        packed = PackedSequence(
            F.dropout(packed.data, 0.1), packed.batch_sizes, packed.sorted_indices, None
        )
        y, _ = self.rnn(packed)
        return pad_packed_sequence(y, batch_first=True, total_length=x.size(1))[0]


def packed_data_changed():
    g = torch.Generator().manual_seed(1)
    return PackedDataChanged(), (torch.randn(3, 5, 8, generator=g), torch.tensor([5, 2, 4]))


class Halve(nn.Module):
    """A module of the user's own (not torch.nn's)."""

    def forward(self, x):
        return x / 2


class PackedDataRead(nn.Module):
    """Reads the packed output's data itself (a head over every real step): refused at that
    line, since autopipe carries packed sequences as padded tensors."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(8, 8, batch_first=True)
        self.head = nn.Linear(8, 1)

    def forward(self, x, lengths):
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        y, _ = self.rnn(packed)
        return self.head(y.data).sum()


def packed_data_read():
    g = torch.Generator().manual_seed(1)
    return PackedDataRead(), (torch.randn(3, 5, 8, generator=g), torch.tensor([5, 2, 4]))


class KeptWhole(nn.Module):
    """An LSTM over padded tensors, a layer norm, a batch norm and a module of the user's own:
    --keep-whole names them."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(8, 16, batch_first=True, bidirectional=True)
        self.norm = nn.LayerNorm(32, elementwise_affine=False)
        self.bn = nn.BatchNorm1d(32)
        self.halve = Halve()
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        y, (h, _) = self.lstm(x)
        y = self.halve(self.norm(y))
        return self.head(y).sum(1) + h.sum(0).sum(-1, keepdim=True), self.bn(y.mean(1))


def kept_whole():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return KeptWhole(), (torch.randn(3, 5, 8, generator=g),)


class ThirdPartyInCond(nn.Module):
    """An operator registered by another module, called in a torch.cond branch."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 1)

    def forward(self, x):
        from custom_ops import twice

        h = torch.tanh(self.first(x))
        h = torch.cond(h.sum() > 0, lambda t: twice(t), lambda t: t - 1, (h,))
        return self.second(h).squeeze(-1)


def third_party_in_cond():
    torch.manual_seed(0)
    return ThirdPartyInCond(), (torch.randn(4, 8),)


# -- batches of another length every step (pipelines compiled with --dynamic) -----------------
#: the sequence length of each step: longer, shorter and equal to the example's 16
LENGTHS = (16, 7, 32, 11)


def gpt2_lengths(step: int, microbatches: int = 4, per_microbatch: int = BATCH):
    """gpt2_batch with another sequence length each step."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, 97, (per_microbatch * microbatches, LENGTHS[step % 4]), generator=g)
    return (ids,), {"labels": ids.clone()}


def gpt2_lengths_smaller_last_batch(step: int, microbatches: int = 4):
    """gpt2_lengths with 4 samples per microbatch, and 2 in the last step's (a smaller batch)."""
    return gpt2_lengths(step, microbatches, per_microbatch=2 if step == 3 else 4)


def gpt2_too_long(step: int, microbatches: int = 4):
    """gpt2_lengths, but step 1's sequences are longer than the pipeline's bound of 32."""
    args, kwargs = gpt2_lengths(step, microbatches)
    if step == 1:
        ids = torch.randint(0, 97, (BATCH * microbatches, 40))
        return (ids,), {"labels": ids.clone()}
    return args, kwargs


def bert_lengths(step: int, microbatches: int = 4):
    """Masked-LM batches padded per step to their longest sequence: another length each step,
    padding masked out and ignored by the loss."""
    g = torch.Generator().manual_seed(2000 + step)
    rows, length = BATCH * microbatches, LENGTHS[step % 4]
    ids = torch.randint(0, 101, (rows, length), generator=g)
    real = torch.randint(max(length // 2, 2), length + 1, (rows, 1), generator=g)
    mask = (torch.arange(length) < real).long()
    labels = torch.where((torch.arange(length) % 3 == 0) & mask.bool(), ids, -100)
    return (ids,), {"attention_mask": mask, "labels": labels}


def t5_lengths(step: int, microbatches: int = 4):
    """t5_batch with other source and target lengths each step (two dynamic dimensions)."""
    g = torch.Generator().manual_seed(3000 + step)
    source, target = (10, 5, 16, 3)[step % 4], (7, 12, 3, 9)[step % 4]
    ids = torch.randint(1, 103, (BATCH * microbatches, source), generator=g)
    return (ids,), {"labels": torch.randint(1, 103, (BATCH * microbatches, target), generator=g)}


class FixedPositions(nn.Module):
    """Adds a position table of 16 rows: the sequence length cannot vary."""

    def __init__(self):
        super().__init__()
        self.positions = nn.Parameter(torch.zeros(16, 8))
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(x + self.positions).sum()


def fixed_positions():
    torch.manual_seed(0)
    return FixedPositions(), (torch.randn(BATCH, 16, 8),)


def gpt2_two_layers():
    """The test GPT-2 with 2 layers instead of 3: another model with a subset of its tensors."""
    return gpt2(layers=2)


def gpt2_batch_failing_at_step_1(step: int, microbatches: int = 4):
    """gpt2_batch, but user code that raises at step 1 (a defect in a --data function)."""
    if step == 1:
        shards = {"train": 0}
        return shards["validation"]
    return gpt2_batch(step, microbatches)


def cnn_batch_failing_on_rank_1(step: int, microbatches: int = 4):
    """cnn_batch, except on rank 1 (which reads the target for the loss): a failure only a
    rank other than 0 finds."""
    if os.environ.get("RANK") == "1":
        raise ValueError(f"no target shard for step {step} on this node")
    return cnn_batch(step, microbatches)


def gpt2_eval_batch(index: int, microbatches: int = 4):
    """Held-out GPT-2 batches whose labels end in a different number of ignored positions per
    row (the index -100): microbatches weigh differently in a token-weighted mean."""
    g = torch.Generator().manual_seed(5000 + index)
    ids = torch.randint(0, 97, (BATCH * microbatches, 16), generator=g)
    labels = ids.clone()
    for row, kept in enumerate(torch.randint(2, 16, (BATCH * microbatches,), generator=g)):
        labels[row, int(kept) :] = -100
    return (ids,), {"labels": labels}


class Residual(nn.Module):
    """``x + tanh(linear(x))``: the block of :class:`BlockStack`."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.linear(x))


class BlockStack(nn.Module):
    """Identical residual blocks of real compute (a 512-wide layer each, on 64 rows): compiled
    with ``basic_blocks=("Residual",)`` each block is one unit, so stage boundaries can move
    block by block and a stage's time follows its block count."""

    def __init__(self, width: int = 512, depth: int = 16):
        super().__init__()
        self.blocks = nn.Sequential(*(Residual(width) for _ in range(depth)))
        self.out = nn.Linear(width, 1)

    def forward(self, x):
        return self.out(self.blocks(x)).squeeze(-1)


def block_stack_with_target():
    torch.manual_seed(0)
    return BlockStack(), (torch.randn(64, 512),), {}, torch.zeros(64)


class PipeSplitMarked(nn.Module):
    """A model written for torch.distributed.pipelining's pipeline(): ``pipe_split()`` markers
    in its forward where its author wants stages to begin (after layers 0 and 3), as PyTorch's
    own pipelining tests write them, and a LayerNorm buffer-free head."""

    def __init__(self, markers: bool = True):
        super().__init__()
        self.markers = markers
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(6)
        )
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        for index, layer in enumerate(self.layers):
            x = x + layer(x)
            if self.markers and index in (0, 3):
                pipe_split()
        return self.head(self.norm(x)).squeeze(-1)


def pipe_split_marked():
    torch.manual_seed(0)
    return PipeSplitMarked(), (torch.randn(BATCH * 2, 16),), {}, torch.zeros(BATCH * 2)


def split_spec_model():
    """The same model without markers: its stages named by a split spec instead."""
    torch.manual_seed(0)
    return PipeSplitMarked(markers=False), (torch.randn(BATCH * 2, 16),), {}, torch.zeros(BATCH * 2)


def pipe_split_batch(step: int, microbatches: int = 4):
    g = torch.Generator().manual_seed(9100 + step)
    x = torch.randn(BATCH * 2 * microbatches, 16, generator=g)
    return (x,), {}, x.sum(-1).cos()


class ListScaled(nn.Module):
    """Two linear layers whose outputs Python values shape: a list of scales, a flag, the name
    of an activation and a mask left None, arguments without tensors that torch.export fixes to
    the example's values (recorded in the pipeline contract, checked in every batch)."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 8)
        self.second = nn.Linear(8, 4)

    def forward(self, x, scales, square=False, activation="relu", mask=None):
        act = torch.relu if activation == "relu" else torch.tanh
        y = self.second(act(self.first(x))) * torch.tensor(scales)
        if square:
            y = y * y
        if mask is not None:
            y = y * mask
        return y


LIST_SCALES = [1.0, 2.0, 3.0, 4.0]


def list_scaled():
    torch.manual_seed(0)
    kwargs = {"square": True, "activation": "relu", "mask": None}
    return ListScaled(), (torch.randn(BATCH, 4), LIST_SCALES), kwargs


def list_scaled_batch(step: int, microbatches: int = 4):
    """The example's values at step 0, other scales at step 1 (refused there)."""
    g = torch.Generator().manual_seed(9200 + step)
    scales = LIST_SCALES if step == 0 else [4.0, 3.0, 2.0, 1.0]
    x = torch.randn(BATCH * microbatches, 4, generator=g)
    return (x, scales), {"square": True, "activation": "relu"}


class LSTMFromState(nn.Module):
    """An LSTM (batch first) started from a given initial state, passed as the pair (h0, c0)."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(8, 16, num_layers=2, batch_first=True)
        self.head = nn.Linear(16, 1)

    def forward(self, x, h0, c0):
        y, (h, c) = self.lstm(x, (h0, c0))
        return self.head(y).squeeze(-1).sum(1) + h.sum((0, 2)) - c.sum((0, 2))


def lstm_from_state(batch: int = 2, seed: int = 0, steps: int = 6):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1 + seed)
    return LSTMFromState(), (
        torch.randn(batch, steps, 8, generator=g),
        torch.randn(2, batch, 16, generator=g),
        torch.randn(2, batch, 16, generator=g),
    )


class AliasedGRU(nn.Module):
    """One GRU under two names (``enc`` and ``dec``): a stage cannot hold it kept whole."""

    def __init__(self):
        super().__init__()
        self.enc = nn.GRU(4, 6, batch_first=True)
        self.dec = self.enc
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        y, _ = self.dec(x)
        return self.head(y)


def aliased_gru():
    torch.manual_seed(0)
    return AliasedGRU(), (torch.randn(BATCH, 5, 4),)


class ModeNet(nn.Module):
    """Every operator whose result depends on the module's mode (issue 41): batch norm with and
    without running statistics, instance norm with them, RReLU, dropout and its variants,
    attention dropout, and F.dropout given ``training=self.training``."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.bn_batch_stats = nn.BatchNorm2d(8, track_running_stats=False)
        self.instance = nn.InstanceNorm2d(8, affine=True, track_running_stats=True)
        self.act = nn.RReLU()
        self.drop2d = nn.Dropout2d(0.2)
        self.alpha = nn.AlphaDropout(0.1)
        self.feature_alpha = nn.FeatureAlphaDropout(0.1)
        self.qkv = nn.Linear(8, 24)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        x = self.act(self.instance(self.bn_batch_stats(self.bn(self.conv(x)))))
        x = self.feature_alpha(self.alpha(self.drop2d(x)))
        tokens = x.flatten(2).transpose(1, 2)  # (batch, 64, 8)
        q, k, v = self.qkv(tokens).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4)
        p = 0.1 if self.training else 0.0
        attended = F.scaled_dot_product_attention(q, k, v, dropout_p=p)
        tokens = attended.transpose(1, 2).flatten(2) + tokens
        tokens = F.dropout(tokens, 0.1, training=self.training)
        return self.head(self.drop(tokens.mean(1)))


def mode_net():
    torch.manual_seed(0)
    return ModeNet(), (torch.randn(BATCH, 3, 8, 8),)


def mode_net_with_target():
    model, args = mode_net()
    return model, args, {}, torch.tensor([1, 3])


def mode_net_batch(step: int, microbatches: int = 4):
    return cnn_batch(step, microbatches)


class PlainLoss(nn.Module):
    """A forward that returns its loss as a plain scalar tensor (no dict, no ``loss`` key)."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 8)
        self.second = nn.Linear(8, 4)

    def forward(self, x, y):
        return F.mse_loss(self.second(torch.tanh(self.first(x))), y)


def plain_loss():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return PlainLoss(), (torch.randn(BATCH, 4, generator=g), torch.randn(BATCH, 4, generator=g))


def plain_loss_batch(step: int, microbatches: int = 4):
    g = torch.Generator().manual_seed(3000 + step)
    rows = BATCH * microbatches
    return (torch.randn(rows, 4, generator=g), torch.randn(rows, 4, generator=g)), {}


def gpt2_dropout():
    """The test GPT-2 (the same tensors, for --load) with dropout 0.1 in its embeddings,
    attention and residuals: a run that draws random numbers in every training step."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=3,
        n_embd=32,
        n_head=4,
        vocab_size=97,
        n_positions=32,
        use_cache=False,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.1,
        bos_token_id=0,
        eos_token_id=0,
    )
    ids = torch.randint(0, 97, (BATCH, 16))
    return GPT2LMHeadModel(config), (ids,), {"labels": ids.clone()}


def gpt2_eval_batch_partly_unlabelled(index: int, microbatches: int = 4):
    """gpt2_eval_batch, but microbatch 1's labels are all the ignore index -100 (a prompt masked
    whole): its loss is 0 / 0, and it weighs nothing in a token-weighted mean."""
    args, kwargs = gpt2_eval_batch(index, microbatches)
    kwargs["labels"][BATCH : 2 * BATCH] = -100
    return args, kwargs


def gpt2_eval_batch_unlabelled(index: int, microbatches: int = 4):
    """gpt2_eval_batch with every label the ignore index -100: no loss to average."""
    args, kwargs = gpt2_eval_batch(index, microbatches)
    kwargs["labels"] = torch.full_like(kwargs["labels"], -100)
    return args, kwargs


def gpt2_tiny_dataset() -> TokenWindows:
    """A Dataset factory of 3 samples: fewer than one batch of held-out data."""
    return TokenWindows(samples=3)


class FusedOperators(nn.Module):
    """A block calling torch's fused operators: layer norm, RMS norm, attention (causal, with
    dropout) and cross entropy (tests/test_fused_operators.py: none is decomposed)."""

    def __init__(self, width: int = 16, heads: int = 2, classes: int = 7):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(width)
        self.rms = nn.RMSNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = (
            t.reshape(batch, seq, self.heads, -1).transpose(1, 2)
            for t in self.qkv(self.norm(x)).chunk(3, dim=-1)
        )
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=0.1 if self.training else 0.0, is_causal=True
        )
        h = self.rms(x + y.transpose(1, 2).reshape(batch, seq, width))
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def fused_operators():
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(4, 6, 16, generator=generator)
    return FusedOperators(), (x, torch.randint(0, 7, (4, 6), generator=generator))


class _Tail(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        time, batch, features = y.shape
        z = self.linear(y.view(time * batch, features)).view(time, batch, features)
        return (z.sum(0) * h).sum(-1)


class TimeFirstTail(nn.Module):
    """``x`` (batch, 8) read by the head, ``y`` time first (5, batch, 8) read only by the tail,
    which views it whole (tests/test_data_inputs.py: a later stage reading an input whose batch
    is not along dimension 0 gets its microbatches contiguous, as the first stage does)."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, 8)
        self.tail = _Tail()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.tail(torch.relu(self.head(x)), y)


def time_first_tail():
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(2, 8, generator=generator), torch.randn(5, 2, 8, generator=generator)
    return TimeFirstTail(), (x, y), {}, torch.randn(2, generator=generator)


def time_first_tail_batch(step: int, microbatches: int = 4):
    generator = torch.Generator().manual_seed(300 + step)
    rows = 2 * microbatches
    x, y = torch.randn(rows, 8, generator=generator), torch.randn(5, rows, 8, generator=generator)
    return (x, y), {}, torch.randn(rows, generator=generator)
