"""FLOPs as torch counts them (``torch.utils.flop_counter.FlopCounterMode``: two per
multiply-add), and the kernels its counter does not know.

A graph traced and profiled on the CPU runs ``scaled_dot_product_attention`` as the CPU's flash
attention kernel (``_scaled_dot_product_flash_attention_for_cpu`` and its backward), which
torch's counter leaves at zero although it counts the same attention on a GPU's kernels: the
model's attention would cost no compute and be missing from its FLOPs. It is counted here as
torch counts the GPU's flash attention (no discount for a causal mask, as torch's)."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

__all__ = ["flop_counter"]

aten = torch.ops.aten


def _attention(query: object, key: object, value: object, *_: object, **__: object) -> int:
    """FLOPs of the CPU's flash attention (the shapes of its query, key and value)."""
    return int(sdpa_flop_count(query, key, value))


def _attention_backward(
    grad: object, query: object, key: object, value: object, *_: object, **__: object
) -> int:
    """FLOPs of its backward (the shapes of the output's gradient, the query, key and value)."""
    return int(sdpa_backward_flop_count(grad, query, key, value))


#: operators torch's counter leaves out, with the formulas of their GPU counterparts
MORE_FORMULAS = {
    aten._scaled_dot_product_flash_attention_for_cpu: _attention,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _attention_backward,
}


def flop_counter() -> FlopCounterMode:
    """A silent FLOP counter knowing :data:`MORE_FORMULAS` too."""
    return FlopCounterMode(display=False, custom_mapping=dict(MORE_FORMULAS))
