"""Attention as a GPU computes it, where a GPU is not: ``train.py --dry-run --device cuda`` and the
analytic profile of a GPU's spec.

Copied into every generated pipeline as ``runtime/core/fused_attention.py``; it needs only torch.
``scaled_dot_product_attention`` picks its kernel with a check of the device. On fake CUDA tensors
in a torch built without CUDA it falls back to the math path, and on the CPU it takes the math
path where it drops some of the attention out: the math path materialises the probabilities
(heads x sequence x sequence per sample) and keeps them for the backward, which a GPU's fused
kernels (flash, memory-efficient) never do; a dry run or a plan would count gigabytes the run
never holds. :func:`fused_kernels` routes the call, on tensors of one device type and for its
duration, to the fused kernel a GPU picks (whose fake kernels know their outputs: the attention
and one log-sum-exp per row): flash for half precision without a mask, memory-efficient
otherwise (float32, an explicit mask, as an additive bias); grouped key/value heads are repeated
first, as the math path repeats them (a copy a GPU's flash kernel does not make). A nested
tensor keeps the math path.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["fused_kernels"]

#: the head sizes torch's flash kernel takes (larger ones go to the memory-efficient kernel)
FLASH_HEAD_SIZE = 256


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
    out: torch.Tensor
    if query.is_nested or query.dim() != 4:
        out = torch.ops.aten._scaled_dot_product_attention_math(
            query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale,
            enable_gqa=enable_gqa,
        )[0]  # fmt: skip
        return out
    if enable_gqa and key.size(-3) != query.size(-3):
        groups = query.size(-3) // key.size(-3)
        key = key.repeat_interleave(groups, dim=-3)
        value = value.repeat_interleave(groups, dim=-3)
    half = query.dtype in (torch.float16, torch.bfloat16)
    if half and attn_mask is None and query.size(-1) <= FLASH_HEAD_SIZE:
        out = torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, False, scale=scale
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
    """Within it, ``scaled_dot_product_attention`` on tensors of ``device_type`` (cuda, or cpu
    for fake CPU tensors standing for a GPU's) runs a GPU's fused kernel (see the module's
    docstring): an implementation for the device's autograd key, ahead of the composite one,
    removed on exit."""
    library: Any = torch.library.Library("aten", "IMPL")  # type: ignore[no-untyped-call]
    try:
        library.impl("scaled_dot_product_attention", _attention, f"Autograd{device_type.upper()}")
        yield
    finally:
        library._destroy()
