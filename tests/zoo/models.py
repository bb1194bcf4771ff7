"""The architecture zoo: one spec function per architecture, each returning (model, args, kwargs).

Every model but one is a Hugging Face model built from a tiny config with its own random init
(no downloads; the recurrent one is plain torch.nn): 2 layers (encoder-decoders: 2 + 2), hidden
size 32, 4 heads, a vocabulary of ~100 tokens, sequences of 8-16, a microbatch of 2. The
configs keep transformers' defaults otherwise (caches on: autopipe traces with ``use_cache=False``
as transformers trains, issue 42), and every model whose class takes labels returns its training
loss. Labels that equal the inputs (causal and masked LMs) are a clone of the input
ids, never the same tensor.

Every dropout the config has is the spec's ``dropout`` argument, ``DROPOUT`` (0.1) by default:
the pipeline must match the model in training (the same seed draws the same masks) and in eval
mode (dropout off; issue 41). ``NAME_no_dropout`` builds the models that train through train.py
against one PyTorch process, whose ranks draw other masks. Layer drop, stochastic depth and
router jitter stay off: the model decides them in Python (``if self.training``), which no traced
argument records, so generated stages would keep them in eval mode (the compile summary names
them).

``<name>_batch(step, microbatches=4)`` returns ``(args, kwargs)`` for a whole training step
(batch ``2 * microbatches``), fresh random values seeded by the step, for train.py ``--data``.

``ZOO`` maps each architecture's name to its spec function, ``FAMILIES`` to its family.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

BATCH = 2
DROPOUT = 0.1
SEQ = 12  # token sequences
VOCAB = 100


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _example_generator() -> torch.Generator:
    """The example microbatch's inputs are drawn apart from the model's init (seed 0)."""
    return _generator(1)


def _step_generator(name: str, step: int) -> torch.Generator:
    offset = sum(ord(c) for c in name) * 1000  # a different stream per architecture
    return _generator(100_000 + offset + step)


# -- inputs, shared by the specs (batch 2) and the data functions (batch 2 x microbatches) ------


def _causal_lm_inputs(batch: int, g: torch.Generator, vocab: int = VOCAB, seq: int = SEQ):
    """Token ids (no special tokens: ids >= 3) and labels = a clone of them."""
    ids = torch.randint(3, vocab, (batch, seq), generator=g)
    return (ids,), {"labels": ids.clone()}


def _masked_lm_inputs(batch: int, g: torch.Generator, vocab: int = VOCAB, seq: int = SEQ):
    """Token ids with an attention mask (the last sequence padded), labels on every third token."""
    ids = torch.randint(3, vocab, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[-1, seq - 3 :] = 0
    labels = torch.full((batch, seq), -100)
    labels[:, ::3] = ids[:, ::3]
    return (ids,), {"attention_mask": mask, "labels": labels}


def _classifier_inputs(
    batch: int, g: torch.Generator, vocab: int = VOCAB, seq: int = SEQ, classes: int = 3
):
    """Token ids with an attention mask (the last sequence padded) and one class label each."""
    ids = torch.randint(3, vocab, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[-1, seq - 3 :] = 0
    labels = torch.randint(0, classes, (batch,), generator=g)
    return (ids,), {"attention_mask": mask, "labels": labels}


def _seq2seq_inputs(
    batch: int, g: torch.Generator, vocab: int = VOCAB, seq: int = SEQ, target: int = 8
):
    """Source ids and target labels (the model shifts them into its decoder inputs)."""
    ids = torch.randint(3, vocab, (batch, seq), generator=g)
    labels = torch.randint(3, vocab, (batch, target), generator=g)
    return (ids,), {"labels": labels}


def _image_inputs(batch: int, g: torch.Generator, size: int = 32, classes: int = 3):
    pixels = torch.randn(batch, 3, size, size, generator=g)
    labels = torch.randint(0, classes, (batch,), generator=g)
    return (pixels,), {"labels": labels}


WHISPER_MELS, WHISPER_FRAMES, WHISPER_TARGET = 16, 32, 8


def _whisper_inputs(batch: int, g: torch.Generator):
    features = torch.randn(batch, WHISPER_MELS, WHISPER_FRAMES, generator=g)
    labels = torch.randint(3, VOCAB, (batch, WHISPER_TARGET), generator=g)
    return (features,), {"labels": labels}


def _clip_inputs(batch: int, g: torch.Generator):
    ids = torch.randint(3, VOCAB, (batch, SEQ), generator=g)
    ids[:, -1] = 2  # the end-of-text token the text model pools at
    pixels = torch.randn(batch, 3, 32, 32, generator=g)
    return (ids, pixels), {"return_loss": True}


LLAVA_IMAGE, LLAVA_PATCH = 8, 4
LLAVA_IMAGE_TOKENS = (LLAVA_IMAGE // LLAVA_PATCH) ** 2  # the vision tower's CLS is dropped
LLAVA_IMAGE_TOKEN = VOCAB - 1


def _llava_inputs(batch: int, g: torch.Generator):
    """Token ids with one image's placeholder tokens after the first, its pixels, and labels
    for the text tokens (-100 on the image's)."""
    ids = torch.randint(3, LLAVA_IMAGE_TOKEN, (batch, SEQ), generator=g)
    ids[:, 1 : 1 + LLAVA_IMAGE_TOKENS] = LLAVA_IMAGE_TOKEN
    pixels = torch.randn(batch, 3, LLAVA_IMAGE, LLAVA_IMAGE, generator=g)
    labels = ids.clone()
    labels[ids == LLAVA_IMAGE_TOKEN] = -100
    return (ids, pixels), {"labels": labels}


def _packed_lm_inputs(batch: int, g: torch.Generator):
    """Token ids padded after sequences of unequal lengths (unsorted), the lengths, and labels
    for the real tokens (-100 on the padding)."""
    ids = torch.randint(3, VOCAB, (batch, SEQ), generator=g)
    lengths = torch.randint(2, SEQ + 1, (batch,), generator=g)
    labels = ids.clone()
    labels[torch.arange(SEQ)[None, :] >= lengths[:, None]] = -100
    return (ids, lengths), {"labels": labels}


WAV2VEC2_SAMPLES = 400


def _wav2vec2_inputs(batch: int, g: torch.Generator):
    audio = torch.randn(batch, WAV2VEC2_SAMPLES, generator=g)
    labels = torch.randint(0, 3, (batch,), generator=g)
    return (audio,), {"labels": labels}


# -- decoder LLMs -------------------------------------------------------------------------------


def _decoder_config(config_cls, dropout: float, **extra):
    """A tiny Llama-style config: 2 layers, hidden 32, 4 heads (2 key-value heads)."""
    defaults = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attention_dropout=dropout,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return config_cls(**(defaults | extra))


def _causal_lm(model, vocab: int = VOCAB):
    args, kwargs = _causal_lm_inputs(BATCH, _example_generator(), vocab)
    return model, args, kwargs


def llama(dropout: float = DROPOUT):
    """Llama: RMSNorm, rotary positions, grouped-query attention, SwiGLU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return _causal_lm(LlamaForCausalLM(_decoder_config(LlamaConfig, dropout)))


def pipe_split_llama(dropout: float = DROPOUT):
    """Llama as a torch.distributed.pipelining user brings it: a pipe_split() marker before
    its second decoder layer (a forward pre-hook, as torch's split_spec inserts one)."""
    from torch.distributed.pipelining import pipe_split
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_decoder_config(LlamaConfig, dropout))
    model.model.layers[1].register_forward_pre_hook(lambda module, args: pipe_split())
    return _causal_lm(model)


def mistral(dropout: float = DROPOUT):
    """Mistral: Llama with sliding-window attention (a window shorter than the sequence)."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    return _causal_lm(MistralForCausalLM(_decoder_config(MistralConfig, dropout, sliding_window=8)))


def qwen2(dropout: float = DROPOUT):
    """Qwen2: Llama with biases on the query, key and value projections."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return _causal_lm(Qwen2ForCausalLM(_decoder_config(Qwen2Config, dropout)))


def gemma(dropout: float = DROPOUT):
    """Gemma: tied embedding and LM head, scaled embeddings, (1 + weight) RMSNorm, GeGLU."""
    from transformers import GemmaConfig, GemmaForCausalLM

    torch.manual_seed(0)
    model = GemmaForCausalLM(_decoder_config(GemmaConfig, dropout, head_dim=8))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return _causal_lm(model)


def phi3(dropout: float = DROPOUT):
    """Phi-3: fused QKV and gate-up projections."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    config = _decoder_config(Phi3Config, dropout, resid_pdrop=dropout, embd_pdrop=dropout)
    return _causal_lm(Phi3ForCausalLM(config))


def opt(dropout: float = DROPOUT):
    """OPT: learned positions computed from the attention mask, ReLU MLP, LayerNorm."""
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    config = OPTConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        word_embed_proj_dim=32,
        ffn_dim=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        dropout=dropout,
        attention_dropout=dropout,
        layerdrop=0.0,
        pad_token_id=1,
        bos_token_id=2,
        eos_token_id=2,
    )
    return _causal_lm(OPTForCausalLM(config))


def bloom(dropout: float = DROPOUT):
    """BLOOM: ALiBi position biases, an embedding LayerNorm, tied embedding and LM head."""
    from transformers import BloomConfig, BloomForCausalLM

    torch.manual_seed(0)
    config = BloomConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        n_layer=2,
        n_head=4,
        hidden_dropout=dropout,
        attention_dropout=dropout,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return _causal_lm(BloomForCausalLM(config))


def falcon(dropout: float = DROPOUT):
    """Falcon (7B layout): parallel attention and MLP, multi-query attention, rotary positions."""
    from transformers import FalconConfig, FalconForCausalLM

    torch.manual_seed(0)
    config = FalconConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        hidden_dropout=dropout,
        attention_dropout=dropout,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return _causal_lm(FalconForCausalLM(config))


def gpt_neox(dropout: float = DROPOUT):
    """GPT-NeoX: parallel residual, partial rotary embeddings, fused QKV."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    config = GPTNeoXConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        attention_dropout=dropout,
        hidden_dropout=dropout,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return _causal_lm(GPTNeoXForCausalLM(config))


def gpt_j(dropout: float = DROPOUT):
    """GPT-J: parallel attention and MLP, interleaved rotary embeddings on part of each head."""
    from transformers import GPTJConfig, GPTJForCausalLM

    torch.manual_seed(0)
    config = GPTJConfig(
        vocab_size=VOCAB,
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=4,
        rotary_dim=4,
        n_inner=64,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return _causal_lm(GPTJForCausalLM(config))


# -- encoder-decoders ---------------------------------------------------------------------------


def _seq2seq(model):
    args, kwargs = _seq2seq_inputs(BATCH, _example_generator())
    return model, args, kwargs


def t5(dropout: float = DROPOUT):
    """T5: relative position buckets, the encoder output read by every decoder layer."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        dropout_rate=dropout,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    return _seq2seq(T5ForConditionalGeneration(config))


def mt5(dropout: float = DROPOUT):
    """mT5: T5 with gated-GELU feed-forward and an untied LM head."""
    from transformers import MT5Config, MT5ForConditionalGeneration

    torch.manual_seed(0)
    config = MT5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        dropout_rate=dropout,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    return _seq2seq(MT5ForConditionalGeneration(config))


def _bart_like(config_cls, dropout: float, **extra):
    return config_cls(
        **(
            dict(
                vocab_size=VOCAB,
                max_position_embeddings=64,
                d_model=32,
                encoder_layers=2,
                decoder_layers=2,
                encoder_attention_heads=4,
                decoder_attention_heads=4,
                encoder_ffn_dim=64,
                decoder_ffn_dim=64,
                dropout=dropout,
                attention_dropout=dropout,
                activation_dropout=dropout,
                encoder_layerdrop=0.0,
                decoder_layerdrop=0.0,
            )
            | extra
        )
    )


def bart(dropout: float = DROPOUT):
    """BART: learned positions, the shared embedding tied to both stacks and the LM head."""
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    config = _bart_like(
        BartConfig,
        dropout,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
    )
    return _seq2seq(BartForConditionalGeneration(config))


def pegasus(dropout: float = DROPOUT):
    """Pegasus: frozen sinusoidal position embeddings, pre-LayerNorm."""
    from transformers import PegasusConfig, PegasusForConditionalGeneration

    torch.manual_seed(0)
    config = _bart_like(
        PegasusConfig, dropout, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0
    )
    return _seq2seq(PegasusForConditionalGeneration(config))


def whisper(dropout: float = DROPOUT):
    """Whisper: a convolutional audio encoder with frozen sinusoidal positions, a text decoder."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(0)
    config = WhisperConfig(
        vocab_size=VOCAB,
        num_mel_bins=WHISPER_MELS,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_source_positions=WHISPER_FRAMES // 2,
        max_target_positions=32,
        dropout=dropout,
        attention_dropout=dropout,
        activation_dropout=dropout,
        encoder_layerdrop=0.0,
        decoder_layerdrop=0.0,
        apply_spec_augment=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
        suppress_tokens=None,
        begin_suppress_tokens=None,
    )
    model = WhisperForConditionalGeneration(config)
    args, kwargs = _whisper_inputs(BATCH, _example_generator())
    return model, args, kwargs


# -- encoders -----------------------------------------------------------------------------------


def _bert_like(dropout: float) -> dict:
    return dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )


def _classifier(model):
    args, kwargs = _classifier_inputs(BATCH, _example_generator())
    return model, args, kwargs


def _masked_lm(model):
    args, kwargs = _masked_lm_inputs(BATCH, _example_generator())
    return model, args, kwargs


def bert(dropout: float = DROPOUT):
    """BERT sequence classification: a pooler (tanh) over the first token, an attention mask."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(**_bert_like(dropout), num_labels=3, classifier_dropout=dropout)
    return _classifier(BertForSequenceClassification(config))


def roberta(dropout: float = DROPOUT):
    """RoBERTa masked LM: positions counted from the padding (a cumsum of the mask)."""
    from transformers import RobertaConfig, RobertaForMaskedLM

    torch.manual_seed(0)
    config = RobertaConfig(**_bert_like(dropout), pad_token_id=1, bos_token_id=0, eos_token_id=2)
    return _masked_lm(RobertaForMaskedLM(config))


def deberta_v2(dropout: float = DROPOUT):
    """DeBERTa-v2 sequence classification: disentangled relative-position attention."""
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

    torch.manual_seed(0)
    config = DebertaV2Config(
        **_bert_like(dropout),
        relative_attention=True,
        pos_att_type=["p2c", "c2p"],
        max_relative_positions=-1,
        position_biased_input=False,
        pooler_dropout=dropout,
        num_labels=3,
        pad_token_id=0,
    )
    return _classifier(DebertaV2ForSequenceClassification(config))


def deberta_v2_mlm(dropout: float = DROPOUT):
    """DeBERTa-v2 masked LM: the same encoder without the classifier head's nonzero()."""
    from transformers import DebertaV2Config, DebertaV2ForMaskedLM

    torch.manual_seed(0)
    config = DebertaV2Config(
        **_bert_like(dropout),
        relative_attention=True,
        pos_att_type=["p2c", "c2p"],
        max_relative_positions=-1,
        position_biased_input=False,
        pad_token_id=0,
    )
    return _masked_lm(DebertaV2ForMaskedLM(config))


def albert(dropout: float = DROPOUT):
    """ALBERT masked LM: one layer's weights shared by both layers, factorised embeddings."""
    from transformers import AlbertConfig, AlbertForMaskedLM

    torch.manual_seed(0)
    config = AlbertConfig(
        **_bert_like(dropout),
        embedding_size=16,
        num_hidden_groups=1,
        inner_group_num=1,
        classifier_dropout_prob=dropout,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return _masked_lm(AlbertForMaskedLM(config))


def distilbert(dropout: float = DROPOUT):
    """DistilBERT sequence classification: no token types, a pre-classifier layer."""
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    torch.manual_seed(0)
    config = DistilBertConfig(
        vocab_size=VOCAB,
        dim=32,
        n_layers=2,
        n_heads=4,
        hidden_dim=64,
        max_position_embeddings=64,
        dropout=dropout,
        attention_dropout=dropout,
        seq_classif_dropout=dropout,
        num_labels=3,
        pad_token_id=0,
    )
    return _classifier(DistilBertForSequenceClassification(config))


# -- vision -------------------------------------------------------------------------------------


def _image_classifier(model):
    args, kwargs = _image_inputs(BATCH, _example_generator())
    return model, args, kwargs


def vit(dropout: float = DROPOUT):
    """ViT image classification: patch embedding, a class token, learned positions."""
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    config = ViTConfig(
        image_size=32,
        patch_size=8,
        num_channels=3,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        num_labels=3,
    )
    return _image_classifier(ViTForImageClassification(config))


def swin(dropout: float = DROPOUT):
    """Swin image classification: shifted windows, relative position bias tables, patch merging."""
    from transformers import SwinConfig, SwinForImageClassification

    torch.manual_seed(0)
    config = SwinConfig(
        image_size=32,
        patch_size=4,
        num_channels=3,
        embed_dim=16,
        depths=[2, 2],
        num_heads=[2, 4],
        window_size=4,
        mlp_ratio=2.0,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        drop_path_rate=0.0,
        num_labels=3,
    )
    return _image_classifier(SwinForImageClassification(config))


def convnext():
    """ConvNeXt image classification: depthwise convolutions, channels-last LayerNorm, layer scale."""
    from transformers import ConvNextConfig, ConvNextForImageClassification

    torch.manual_seed(0)
    config = ConvNextConfig(
        num_channels=3,
        patch_size=4,
        num_stages=2,
        hidden_sizes=[16, 32],
        depths=[1, 1],
        drop_path_rate=0.0,
        image_size=32,
        num_labels=3,
    )
    return _image_classifier(ConvNextForImageClassification(config))


# -- multi-modal, audio -------------------------------------------------------------------------


def clip(dropout: float = DROPOUT):
    """CLIP: a text and a vision tower, projections, a learned temperature, the contrastive loss."""
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(0)
    text = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=32,
        attention_dropout=dropout,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
        attention_dropout=dropout,
    )
    config = CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    model = CLIPModel(config)
    args, kwargs = _clip_inputs(BATCH, _example_generator())
    return model, args, kwargs


def llava(dropout: float = DROPOUT):
    """LLaVA: a CLIP vision tower, a projector and a Llama; the image features are scattered
    into the token embeddings after the model checks that the image tokens number the
    features (a check on tensor values, kept as a run-time check)."""
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    torch.manual_seed(0)
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=LLAVA_IMAGE,
        patch_size=LLAVA_PATCH,
        attention_dropout=dropout,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=_decoder_config(LlamaConfig, dropout),
        image_token_id=LLAVA_IMAGE_TOKEN,
        projector_hidden_act="gelu",
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
    )
    model = LlavaForConditionalGeneration(config)
    args, kwargs = _llava_inputs(BATCH, _example_generator())
    return model, args, kwargs


def wav2vec2(dropout: float = DROPOUT):
    """Wav2Vec2 audio classification: a convolutional feature extractor with group norm, a
    weight-normed positional convolution, mean pooling."""
    from transformers import Wav2Vec2Config, Wav2Vec2ForSequenceClassification

    torch.manual_seed(0)
    config = Wav2Vec2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        conv_dim=(32, 32),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
        hidden_dropout=dropout,
        activation_dropout=dropout,
        attention_dropout=dropout,
        feat_proj_dropout=dropout,
        final_dropout=dropout,
        layerdrop=0.0,
        apply_spec_augment=False,
        classifier_proj_size=16,
        num_labels=3,
    )
    model = Wav2Vec2ForSequenceClassification(config)
    args, kwargs = _wav2vec2_inputs(BATCH, _example_generator())
    return model, args, kwargs


# -- mixture of experts, state space ------------------------------------------------------------


def mixtral(dropout: float = DROPOUT):
    """Mixtral: top-2 routing over 4 experts in every layer."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = _decoder_config(
        MixtralConfig, dropout, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0
    )
    return _causal_lm(MixtralForCausalLM(config))


def qwen2_moe(dropout: float = DROPOUT):
    """Qwen2-MoE: top-2 routing over 4 experts plus a gated shared expert."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    config = _decoder_config(
        Qwen2MoeConfig,
        dropout,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        decoder_sparse_step=1,
    )
    return _causal_lm(Qwen2MoeForCausalLM(config))


def mamba():
    """Mamba: selective state-space scan (the sequential PyTorch path), depthwise causal conv."""
    from transformers import MambaConfig, MambaForCausalLM

    torch.manual_seed(0)
    config = MambaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        state_size=8,
        num_hidden_layers=2,
        expand=2,
        conv_kernel=4,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return _causal_lm(MambaForCausalLM(config))


class LMOutput(NamedTuple):
    """What the recurrent LM returns (a named tuple: torch.export flattens it)."""

    loss: torch.Tensor | None
    logits: torch.Tensor


class PackedLSTMLM(torch.nn.Module):
    """A recurrent language model as speech and older NLP code writes one: token embeddings
    packed by length (pack_padded_sequence), a 2-layer LSTM over the packed sequence, unpacked
    (pad_packed_sequence), an output layer tied to the embedding and the loss on real tokens."""

    def __init__(self, hidden: int = 32, dropout: float = DROPOUT):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, hidden)
        self.lstm = torch.nn.LSTM(hidden, hidden, num_layers=2, batch_first=True, dropout=dropout)
        self.head = torch.nn.Linear(hidden, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, input_ids, lengths, labels=None):
        packed = pack_padded_sequence(
            self.embed(input_ids), lengths, batch_first=True, enforce_sorted=False
        )
        hidden, _ = self.lstm(packed)
        hidden, _ = pad_packed_sequence(hidden, batch_first=True, total_length=input_ids.size(1))
        logits = self.head(hidden)
        loss = None
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return LMOutput(loss, logits)


def packed_lstm(dropout: float = DROPOUT):
    """An LSTM language model over packed sequences (torch.nn, no Hugging Face model): the
    LSTM is kept whole, as one call of nn.LSTM in the generated stage."""
    torch.manual_seed(0)
    model = PackedLSTMLM(dropout=dropout)
    args, kwargs = _packed_lm_inputs(BATCH, _example_generator())
    return model, args, kwargs


# -- data functions: a whole step's batch (2 x microbatches) ------------------------------------

_INPUTS = {
    "decoder": _causal_lm_inputs,
    "seq2seq": _seq2seq_inputs,
    "classifier": _classifier_inputs,
    "masked_lm": _masked_lm_inputs,
    "image": _image_inputs,
    "whisper": _whisper_inputs,
    "clip": _clip_inputs,
    "wav2vec2": _wav2vec2_inputs,
    "llava": _llava_inputs,
    "packed_lm": _packed_lm_inputs,
}


def _batch(name: str, inputs: str, step: int, microbatches: int):
    return _INPUTS[inputs](BATCH * microbatches, _step_generator(name, step))


def llama_batch(step: int, microbatches: int = 4):
    return _batch("llama", "decoder", step, microbatches)


def pipe_split_llama_batch(step: int, microbatches: int = 4):
    return _batch("pipe_split_llama", "decoder", step, microbatches)


def mistral_batch(step: int, microbatches: int = 4):
    return _batch("mistral", "decoder", step, microbatches)


def qwen2_batch(step: int, microbatches: int = 4):
    return _batch("qwen2", "decoder", step, microbatches)


def gemma_batch(step: int, microbatches: int = 4):
    return _batch("gemma", "decoder", step, microbatches)


def phi3_batch(step: int, microbatches: int = 4):
    return _batch("phi3", "decoder", step, microbatches)


def opt_batch(step: int, microbatches: int = 4):
    return _batch("opt", "decoder", step, microbatches)


def bloom_batch(step: int, microbatches: int = 4):
    return _batch("bloom", "decoder", step, microbatches)


def falcon_batch(step: int, microbatches: int = 4):
    return _batch("falcon", "decoder", step, microbatches)


def gpt_neox_batch(step: int, microbatches: int = 4):
    return _batch("gpt_neox", "decoder", step, microbatches)


def gpt_j_batch(step: int, microbatches: int = 4):
    return _batch("gpt_j", "decoder", step, microbatches)


def t5_batch(step: int, microbatches: int = 4):
    return _batch("t5", "seq2seq", step, microbatches)


def mt5_batch(step: int, microbatches: int = 4):
    return _batch("mt5", "seq2seq", step, microbatches)


def bart_batch(step: int, microbatches: int = 4):
    return _batch("bart", "seq2seq", step, microbatches)


def pegasus_batch(step: int, microbatches: int = 4):
    return _batch("pegasus", "seq2seq", step, microbatches)


def whisper_batch(step: int, microbatches: int = 4):
    return _batch("whisper", "whisper", step, microbatches)


def bert_batch(step: int, microbatches: int = 4):
    return _batch("bert", "classifier", step, microbatches)


def roberta_batch(step: int, microbatches: int = 4):
    return _batch("roberta", "masked_lm", step, microbatches)


def deberta_v2_batch(step: int, microbatches: int = 4):
    return _batch("deberta_v2", "classifier", step, microbatches)


def deberta_v2_mlm_batch(step: int, microbatches: int = 4):
    return _batch("deberta_v2_mlm", "masked_lm", step, microbatches)


def albert_batch(step: int, microbatches: int = 4):
    return _batch("albert", "masked_lm", step, microbatches)


def distilbert_batch(step: int, microbatches: int = 4):
    return _batch("distilbert", "classifier", step, microbatches)


def vit_batch(step: int, microbatches: int = 4):
    return _batch("vit", "image", step, microbatches)


def swin_batch(step: int, microbatches: int = 4):
    return _batch("swin", "image", step, microbatches)


def convnext_batch(step: int, microbatches: int = 4):
    return _batch("convnext", "image", step, microbatches)


def clip_batch(step: int, microbatches: int = 4):
    return _batch("clip", "clip", step, microbatches)


def llava_batch(step: int, microbatches: int = 4):
    return _batch("llava", "llava", step, microbatches)


def wav2vec2_batch(step: int, microbatches: int = 4):
    return _batch("wav2vec2", "wav2vec2", step, microbatches)


def packed_lstm_batch(step: int, microbatches: int = 4):
    return _batch("packed_lstm", "packed_lm", step, microbatches)


def mixtral_meta():
    """Mixtral built on the meta device (no weights at compile time), without dropout. Its
    experts take a device-dependent branch (histc on floats on the CPU, on integers elsewhere)."""
    import autopipe

    with autopipe.empty_weights():
        return mixtral(dropout=0.0)


# -- without dropout: trained through train.py against one PyTorch process ----------------------


def llama_no_dropout():
    return llama(dropout=0.0)


def albert_no_dropout():
    return albert(dropout=0.0)


def mixtral_no_dropout():
    return mixtral(dropout=0.0)


def llava_no_dropout():
    return llava(dropout=0.0)


def packed_lstm_no_dropout():
    return packed_lstm(dropout=0.0)


def mixtral_batch(step: int, microbatches: int = 4):
    return _batch("mixtral", "decoder", step, microbatches)


def qwen2_moe_batch(step: int, microbatches: int = 4):
    return _batch("qwen2_moe", "decoder", step, microbatches)


def mamba_batch(step: int, microbatches: int = 4):
    return _batch("mamba", "decoder", step, microbatches)


# -- registry -----------------------------------------------------------------------------------

ZOO = {
    "llama": llama,
    "mistral": mistral,
    "qwen2": qwen2,
    "gemma": gemma,
    "phi3": phi3,
    "opt": opt,
    "bloom": bloom,
    "falcon": falcon,
    "gpt_neox": gpt_neox,
    "gpt_j": gpt_j,
    "t5": t5,
    "mt5": mt5,
    "bart": bart,
    "pegasus": pegasus,
    "whisper": whisper,
    "bert": bert,
    "roberta": roberta,
    "deberta_v2": deberta_v2,
    "deberta_v2_mlm": deberta_v2_mlm,
    "albert": albert,
    "distilbert": distilbert,
    "vit": vit,
    "swin": swin,
    "convnext": convnext,
    "clip": clip,
    "llava": llava,
    "wav2vec2": wav2vec2,
    "mixtral": mixtral,
    "qwen2_moe": qwen2_moe,
    "mamba": mamba,
    "pipe_split_llama": pipe_split_llama,
    "packed_lstm": packed_lstm,
}

FAMILIES = {
    "llama": "decoder",
    "mistral": "decoder",
    "qwen2": "decoder",
    "gemma": "decoder",
    "phi3": "decoder",
    "opt": "decoder",
    "bloom": "decoder",
    "falcon": "decoder",
    "gpt_neox": "decoder",
    "gpt_j": "decoder",
    "t5": "encoder-decoder",
    "mt5": "encoder-decoder",
    "bart": "encoder-decoder",
    "pegasus": "encoder-decoder",
    "whisper": "encoder-decoder",
    "bert": "encoder",
    "roberta": "encoder",
    "deberta_v2": "encoder",
    "deberta_v2_mlm": "encoder",
    "albert": "encoder",
    "distilbert": "encoder",
    "vit": "vision",
    "swin": "vision",
    "convnext": "vision",
    "clip": "multi-modal",
    "llava": "vision-language",
    "wav2vec2": "audio",
    "mixtral": "moe",
    "qwen2_moe": "moe",
    "mamba": "state-space",
    "pipe_split_llama": "torch pipelining",
    "packed_lstm": "recurrent",
}

BATCHES = {name: globals()[f"{name}_batch"] for name in ZOO}
