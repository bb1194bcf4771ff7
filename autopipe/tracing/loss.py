"""Trace a user loss function ``FN(output, target)`` into a small graph of its own.

The generated pipeline then computes the loss with generated code on the last stage, so the
package still needs only torch.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Callable

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..errors import TraceError
from ..ir import COND, Graph
from ..spec import Example
from .export import trace


class _LossOfLeaves(nn.Module):
    """``loss_fn(output, target)`` taking the output's tensor leaves as separate arguments."""

    def __init__(self, loss_fn: Callable, output: Any):
        super().__init__()
        self.loss_fn = loss_fn
        self.leaves, self.spec = pytree.tree_flatten(output)
        self.tensor_positions = [
            i for i, leaf in enumerate(self.leaves) if isinstance(leaf, torch.Tensor)
        ]

    def forward(self, *tensors_and_target):
        *tensors, target = tensors_and_target
        leaves = list(self.leaves)
        for position, tensor in zip(self.tensor_positions, tensors):
            leaves[position] = tensor
        return self.loss_fn(pytree.tree_unflatten(leaves, self.spec), target)


def trace_loss(example: Example, loss_fn: Callable) -> Graph:
    """The graph of ``loss_fn(model(*args, **kwargs), target)`` from the model output to the loss."""
    if example.target is None or not isinstance(example.target, torch.Tensor):
        raise TraceError(
            "--loss needs an example target: the model function must return "
            "(model, args, kwargs, target) with target a tensor"
        )
    model = example.model
    on_meta = any(p.is_meta for p in model.parameters())
    move = (lambda t: t.to("meta")) if on_meta else (lambda t: t)
    args, kwargs = pytree.tree_map_only(torch.Tensor, move, (example.args, example.kwargs))
    was_training = model.training
    model.train()
    try:
        with torch.no_grad():
            output = model(*args, **kwargs)
    finally:
        model.train(was_training)
    wrapper = _LossOfLeaves(loss_fn, output)
    tensors = [leaf for leaf in wrapper.leaves if isinstance(leaf, torch.Tensor)]
    target = move(example.target)
    try:
        value = wrapper(*tensors, target)
    except Exception as exc:
        raise TraceError(
            f"the loss function failed on the model's output: {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise TraceError(
            f"the loss function must return a scalar tensor, got {type(value).__name__} {getattr(value, 'shape', '')}"
        )
    graph = trace(Example(wrapper, (*tensors, target)))
    if graph.params:
        raise TraceError(
            "the loss function has parameters; autopipe supports loss functions without trainable state"
        )
    if any(node.target == COND for node in graph.calls):
        raise TraceError(
            "the loss function calls torch.cond; autopipe supports torch.cond in the model's "
            "forward only. Select with torch.where in the loss function instead."
        )
    target_value = example.target
    if not target_value.is_meta and not target_value.is_floating_point() and target_value.numel():
        graph.model = graph.model.updated(input_ranges={"target": int(target_value.max())})
    return graph
