"""An operator registered outside torch, as libraries register theirs (transformers' MoE)."""

import torch


@torch.library.custom_op("autopipe_test::twice", mutates_args=())
def twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@twice.register_fake
def _(x):
    return torch.empty_like(x)


twice.register_autograd(lambda ctx, grad: grad * 2)
