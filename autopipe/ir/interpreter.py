"""Run graph nodes on real, meta or fake tensors.

The tracer uses it to learn which values need gradients, the profilers to time and count each
unit, and ``verify`` never needs it: it checks the generated code itself.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any
from collections.abc import Callable, Iterable, Mapping

import torch
from torch._subclasses.fake_tensor import DynamicOutputShapeException
from torch.utils._pytree import tree_leaves

from .graph import Graph
from .kinds import kind_of
from .types import Node, map_refs

__all__ = [
    "empty_placeholder",
    "node_context",
    "replace_devices",
    "resolve_target",
    "run_node",
    "run_nodes",
]

_OPS: dict[str, Callable[..., Any]] = {"getitem": operator.getitem}


def resolve_target(target: str) -> Callable[..., Any]:
    """The callable an operator name denotes: ``"aten.addmm.default"`` -> ``torch.ops.aten.addmm.default``;
    for a higher-order node kind (:mod:`autopipe.ir.kinds`), the operator it registers (for its
    schema)."""
    fn = _OPS.get(target)
    if fn is None:
        kind = kind_of(target)
        if kind is not None:
            fn = kind.operator
        else:
            namespace, name, overload = target.split(".")
            fn = getattr(getattr(getattr(torch.ops, namespace), name), overload)
        _OPS[target] = fn
    return fn


def replace_devices(value: Any, device: torch.device) -> Any:
    """Every ``torch.device`` in an argument replaced by the device the graph runs on."""
    if isinstance(value, torch.device):
        return device
    if isinstance(value, (list, tuple)):
        return type(value)(replace_devices(v, device) for v in value)
    if isinstance(value, dict):
        return {k: replace_devices(v, device) for k, v in value.items()}
    return value


def node_context(
    context: tuple[Any, ...], device: torch.device
) -> contextlib.ExitStack[bool | None]:
    """The grad / autocast modes a node runs under."""
    stack = contextlib.ExitStack()
    for entry in context:
        if entry[0] == "grad":
            stack.enter_context(torch.set_grad_enabled(entry[1]))
        elif entry[0] == "autocast":
            _, _, dtype_, enabled = entry
            stack.enter_context(torch.autocast(device.type, dtype=dtype_, enabled=enabled))
        else:
            raise ValueError(f"unknown node context {entry!r}")
    return stack


def run_node(
    node: Node,
    env: Mapping[str, Any],
    device: torch.device,
    functions: Mapping[str, Any] | None = None,
) -> Any:
    """Execute one call node with its inputs taken from ``env``; ``functions`` are the custom
    autograd functions of its graph (``Graph.functions``). A higher-order node runs through the
    hook its kind registers (:mod:`autopipe.ir.kinds`)."""
    kind = kind_of(node.target)
    if kind is not None:  # torch.cond, a custom autograd function, ...
        return kind.run(node, env, device, functions)
    fn = resolve_target(node.target)
    args = replace_devices(map_refs(node.args, lambda r: env[r.name]), device)
    kwargs = replace_devices(map_refs(node.kwargs, lambda r: env[r.name]), device)
    try:
        if node.context:
            with node_context(node.context, device):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)
    except DynamicOutputShapeException:
        # on fake tensors, an operator whose output size depends on values (nonzero, a boolean
        # mask's index) has the size the graph was specialised to at trace time
        meta = node.tensor_meta
        if meta is None:
            raise
        inputs = [
            t
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        if meta.dtype.is_floating_point and inputs and torch.is_grad_enabled():
            return _SpecialisedSize.apply(  # type: ignore[no-untyped-call]  # torch: unannotated
                meta.shape, meta.stride, meta.dtype, *inputs
            )
        return torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device=device)


class _SpecialisedSize(torch.autograd.Function):
    """The output of an operator whose size depends on values, at its specialised size, on
    fake tensors: differentiable in the inputs that need gradients as the operator is (its
    backward gives each a gradient of its own shape), so that what reads it needs gradients
    and a backward through it reaches the operator's inputs."""

    @staticmethod
    def forward(
        ctx: Any, shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype,
        *inputs: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        ctx.inputs = [(t.shape, t.dtype, t.device) for t in inputs]
        return torch.empty_strided(shape, stride, dtype=dtype, device=inputs[0].device)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        gradients = [torch.zeros(s, dtype=d, device=v) for s, d, v in ctx.inputs]
        return (None, None, None, *gradients)


def run_nodes(
    nodes: Iterable[Node],
    env: dict[str, Any],
    device: torch.device,
    functions: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Execute call nodes in order, adding their values to ``env``."""
    for node in nodes:
        env[node.name] = run_node(node, env, device, functions)
    return env


def empty_placeholder(
    graph: Graph, node: Node, device: torch.device, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """An uninitialised tensor for a placeholder, with the autograd flag the model gives it
    (in ``dtype`` instead of the traced one, where given)."""
    meta = node.tensor_meta
    assert meta is not None  # lint: a placeholder has tensor metadata
    requires_grad = meta.requires_grad
    if node.kind == "param":
        requires_grad = graph.param_of(node.target).requires_grad
    dtype = dtype or meta.dtype
    tensor = torch.empty_strided(meta.shape, meta.stride, dtype=dtype, device=device)
    return tensor.requires_grad_(requires_grad and dtype.is_floating_point)
