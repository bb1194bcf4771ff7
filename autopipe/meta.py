"""Build big models without their weights."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


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
            kind = type(module._parameters[name])
            module._parameters[name] = kind(
                param.detach().to("meta"), requires_grad=param.requires_grad
            )

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


@contextlib.contextmanager
def buffers_on_meta(model: nn.Module) -> Iterator[None]:
    """Temporarily move a model's real buffers to meta (to trace it beside meta parameters)."""
    moved: list[tuple[nn.Module, str, torch.Tensor]] = []
    for module in model.modules():
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and not buffer.is_meta:
                moved.append((module, name, buffer))
                module._buffers[name] = buffer.to("meta")
    try:
        yield
    finally:
        for module, name, buffer in moved:
            module._buffers[name] = buffer
