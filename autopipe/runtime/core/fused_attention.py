"""Attention as a GPU computes it, where a GPU is not: ``train.py --dry-run --device cuda`` and the
analytic profile of a GPU's spec.

Copied into every generated pipeline as ``runtime/core/fused_attention.py``; it needs only torch.
``scaled_dot_product_attention`` picks its kernel with a check of the device. On fake CUDA tensors
in a torch built without CUDA it falls back to the math path, and on the CPU it takes the math
path where it drops some of the attention out: the math path materialises the probabilities
(heads x sequence x sequence per sample) and keeps them for the backward, which a GPU's fused
kernels (flash, memory-efficient) never do; a dry run or a plan would count gigabytes the run
never holds. :func:`fused_kernels` routes the call, on tensors of one device type and for its
duration, to the kernel a GPU picks (torch's ``sdp_utils``), whose fake kernels know their outputs:
flash attention for half precision without a mask and with one head size up to 256 (grouped
key/value heads read as they are), keeping the attention and one log-sum-exp per row; else the
memory-efficient kernel (float32, an explicit mask, as an additive bias), keeping the same;
else, where that kernel cannot run (grouped heads, float64, a nested or 3-D input), the math
path, as a GPU falls back to it. Calls on real tensors (not fake: another thread's) keep torch's
own choice.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch._subclasses.fake_tensor import is_fake

from .aten_kernels import aten_kernels

__all__ = ["fused_kernels"]

#: the largest head size torch's flash kernel takes (larger ones go to the memory-efficient one)
FLASH_HEAD_SIZE = 256
_SDPA = torch.ops.aten.scaled_dot_product_attention.default


def _attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    arguments = (query, key, value, attn_mask, dropout_p, is_causal)
    out: torch.Tensor
    if not is_fake(query):  # a real tensor (another thread's, say): torch's own choice
        out = _SDPA.decompose(*arguments, scale=scale, enable_gqa=enable_gqa)
        return out
    dense = not query.is_nested and query.dim() == 4
    grouped = dense and key.size(-3) != query.size(-3)
    one_size = dense and query.size(-1) == key.size(-1) == value.size(-1) <= FLASH_HEAD_SIZE
    half = query.dtype in (torch.float16, torch.bfloat16)
    if dense and half and attn_mask is None and one_size and (enable_gqa or not grouped):
        # flash attention reads grouped key/value heads as they are
        out = torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, False, scale=scale
        )[0]
        return out
    if not dense or grouped or query.dtype == torch.float64:
        # the memory-efficient kernel takes no grouped heads (nor these): a GPU falls back to
        # the math path, which repeats the heads and keeps the probabilities
        out = torch.ops.aten._scaled_dot_product_attention_math(
            *arguments, None, scale=scale, enable_gqa=enable_gqa
        )[0]
        return out
    bias = attn_mask
    if bias is not None and bias.dtype == torch.bool:
        bias = torch.zeros(bias.shape, dtype=query.dtype, device=query.device).masked_fill(
            bias.logical_not(), -math.inf
        )
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    out = torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, bias, grad, dropout_p, is_causal, scale=scale
    )[0]
    return out


@contextmanager
def fused_kernels(device_type: str = "cuda") -> Iterator[None]:
    """Within it, ``scaled_dot_product_attention`` on fake tensors of ``device_type`` (cuda, or
    cpu for fake CPU tensors standing for a GPU's) runs the kernel a GPU picks (see the module's
    docstring): an implementation for the device's autograd key, ahead of the composite one,
    removed on exit."""
    with aten_kernels(
        [("scaled_dot_product_attention", _attention, f"Autograd{device_type.upper()}")]
    ):
        yield
