"""Build big models without their weights."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils import _pytree as pytree


@contextlib.contextmanager
def empty_weights() -> Iterator[None]:
    """Build a model with its parameters on the meta device and its buffers real.

    Like ``torch.device("meta")``, no memory is spent on weights (each parameter is allocated
    uninitialised and moved to meta as it is registered, so initialisers run on meta, for free);
    unlike it, buffers keep their values. Non-persistent buffers (BERT's ``position_ids``, rotary
    ``inv_freq``) are not in checkpoints, so the generated pipeline needs their values::

        with autopipe.empty_weights():
            model = BertForMaskedLM(config)
    """
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            registered = module._parameters[name]
            assert registered is not None  # register just stored param there
            kind = type(registered)
            module._parameters[name] = kind(
                param.detach().to("meta"), requires_grad=param.requires_grad
            )

    # patched on the class for the duration (setattr: mypy refuses assigning to a method)
    setattr(nn.Module, "register_parameter", register_on_meta)
    try:
        yield
    finally:
        setattr(nn.Module, "register_parameter", register)


@contextlib.contextmanager
def state_as_fake(model: nn.Module, device: torch.device) -> Iterator[Callable[[Any], Any]]:
    """Temporarily replace a model's parameters and buffers (meta or real) by fake tensors on
    ``device``, to trace a model built without weights as if it lived there: code that branches
    on ``tensor.device`` takes the branch the pipeline will run. Yields the function that turns
    the example's tensors (a pytree) into fake tensors of the same mode."""
    mode = FakeTensorMode()

    def fake(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_meta:
            return FakeTensor(mode, tensor, device)
        return mode.from_tensor(tensor)

    swapped: list[tuple[dict, str, torch.Tensor]] = []
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                swapped.append((module._parameters, name, param))
                module._parameters[name] = nn.Parameter(
                    fake(param.detach()), requires_grad=param.requires_grad
                )
        for name, buffer in list(module._buffers.items()):
            if buffer is not None:
                swapped.append((module._buffers, name, buffer))
                module._buffers[name] = fake(buffer)
    try:
        yield lambda tree: pytree.tree_map_only(torch.Tensor, fake, tree)
    finally:
        for table, name, tensor in swapped:
            table[name] = tensor
