"""FLOPs as torch counts them (``torch.utils.flop_counter.FlopCounterMode``: two per
multiply-add), and the kernels its counter does not know.

A graph traced and profiled on the CPU runs ``scaled_dot_product_attention`` as the CPU's flash
attention kernel (``_scaled_dot_product_flash_attention_for_cpu`` and its backward), which
torch's counter leaves at zero although it counts the same attention on a GPU's kernels: the
model's attention would cost no compute and be missing from its FLOPs. It is counted here as
torch counts the GPU's flash attention (no discount for a causal mask, as torch's). Likewise an
``nn.LSTM`` runs on the CPU as oneDNN's ``mkldnn_rnn_layer``, which the counter does not know:
it is counted as the matrix products of its weights at every step.

Attention with grouped key/value heads (``enable_gqa``: fewer key and value heads than query
heads, each shared by a group) is counted as torch 2.13 counts it, the key and value broadcast to
the query's heads, on every kernel: an older torch's formulas (2.11's, which the lent GPU
machine's image has) refuse the shapes."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

__all__ = ["flop_counter"]

aten = torch.ops.aten


Shape = tuple[int, ...]


def _query_heads(query: Shape, other: Shape) -> Shape:
    """A key's or value's shape ``(batch, heads, sequence, head size)`` with the query's heads
    (grouped heads broadcast, as the kernel reads them)."""
    return (other[0], query[1], *other[2:])


def _attention(query: Shape, key: Shape, value: Shape, *_: object, **__: object) -> int:
    """FLOPs of a fused attention kernel (the shapes of its query, key and value)."""
    return int(sdpa_flop_count(query, _query_heads(query, key), _query_heads(query, value)))


def _attention_backward(
    grad: Shape, query: Shape, key: Shape, value: Shape, *_: object, **__: object
) -> int:
    """FLOPs of its backward (the shapes of the output's gradient, the query, key and value)."""
    key, value = _query_heads(query, key), _query_heads(query, value)
    return int(sdpa_backward_flop_count(grad, query, key, value))


def _steps(shape: Shape) -> int:
    """Time steps x batch of an RNN layer's input (either layout)."""
    return int(shape[0]) * int(shape[1])


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= int(size)
    return count


def _rnn_layer(
    input: tuple[int, ...], w_ih: tuple[int, ...], w_hh: tuple[int, ...], *_: object, **__: object
) -> int:
    """FLOPs of one LSTM layer and direction on the CPU (oneDNN's kernel): a product with the
    input-to-hidden and the hidden-to-hidden weights at every step of every sequence."""
    return 2 * _steps(input) * (_numel(w_ih) + _numel(w_hh))


def _rnn_layer_backward(
    input: tuple[int, ...], w_ih: tuple[int, ...], w_hh: tuple[int, ...], *_: object, **__: object
) -> int:
    """... and its backward: the gradients of the inputs, states and weights, twice that."""
    return 2 * _rnn_layer(input, w_ih, w_hh)


#: operators torch's counter leaves out, with the formulas of their GPU counterparts (or, for
#: the CPU's LSTM kernel, which has none, of the matrix products it makes); a GPU's fused
#: attention with grouped heads broadcast on every torch
MORE_FORMULAS = {
    aten._scaled_dot_product_flash_attention_for_cpu: _attention,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _attention_backward,
    aten._scaled_dot_product_flash_attention: _attention,
    aten._scaled_dot_product_flash_attention_backward: _attention_backward,
    aten._scaled_dot_product_efficient_attention: _attention,
    aten._scaled_dot_product_efficient_attention_backward: _attention_backward,
    aten._scaled_dot_product_cudnn_attention: _attention,
    aten._scaled_dot_product_cudnn_attention_backward: _attention_backward,
    aten.mkldnn_rnn_layer: _rnn_layer,
    aten.mkldnn_rnn_layer_backward: _rnn_layer_backward,
}


def flop_counter() -> FlopCounterMode:
    """A silent FLOP counter knowing :data:`MORE_FORMULAS` too."""
    return FlopCounterMode(display=False, custom_mapping=dict(MORE_FORMULAS))
