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

from .graph import COND, FUNCTION_TARGET, Graph, Node, map_refs

_OPS: dict[str, Callable] = {"getitem": operator.getitem}


def resolve_target(target: str) -> Callable:
    """The callable an operator name denotes: ``"aten.addmm.default"`` -> ``torch.ops.aten.addmm.default``."""
    fn = _OPS.get(target)
    if fn is None and target == COND:  # run by run_node; resolved for its schema
        from .cond import SCHEMA

        fn = _OPS[target] = _Cond(SCHEMA)
    if fn is None and target == FUNCTION_TARGET:
        from . import autograd_function  # noqa: F401 - registers the operator (for its schema)
    if fn is None:
        namespace, name, overload = target.split(".")
        fn = getattr(getattr(getattr(torch.ops, namespace), name), overload)
        _OPS[target] = fn
    return fn


class _Cond:
    """``torch.ops.higher_order.cond`` as :func:`resolve_target` gives it: its schema says it
    writes and aliases none of its arguments; :func:`run_node` runs cond nodes itself."""

    def __init__(self, schema: torch._C.FunctionSchema):
        self._schema = schema

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("a cond node runs through autopipe.interpreter.run_node")


def replace_devices(value: Any, device: torch.device) -> Any:
    """Every ``torch.device`` in an argument replaced by the device the graph runs on."""
    if isinstance(value, torch.device):
        return device
    if isinstance(value, (list, tuple)):
        return type(value)(replace_devices(v, device) for v in value)
    if isinstance(value, dict):
        return {k: replace_devices(v, device) for k, v in value.items()}
    return value


def node_context(context: tuple, device: torch.device) -> contextlib.AbstractContextManager:
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
    node: Node, env: Mapping[str, Any], device: torch.device, functions: Mapping | None = None
) -> Any:
    """Execute one call node with its inputs taken from ``env``; ``functions`` are the custom
    autograd functions of its graph (``Graph.functions``)."""
    if node.target == COND:
        from .cond import run_cond

        return run_cond(node, env, device)
    fn = resolve_target(node.target)
    args = replace_devices(map_refs(node.args, lambda r: env[r.name]), device)
    kwargs = replace_devices(map_refs(node.kwargs, lambda r: env[r.name]), device)
    if node.target == FUNCTION_TARGET:  # its traced forward, and backward for autograd
        from .autograd_function import call_function

        name, inputs = args
        fn, args = call_function, ((functions or {})[name], inputs, device)
    try:
        if node.context:
            with node_context(node.context, device):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)
    except DynamicOutputShapeException:
        # on fake tensors, an operator whose output size depends on values (nonzero) has the
        # size the graph was specialised to at trace time
        meta = node.tensor_meta
        if meta is None:
            raise
        return torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device=device)


def run_nodes(
    nodes: Iterable[Node],
    env: dict[str, Any],
    device: torch.device,
    functions: Mapping | None = None,
) -> dict[str, Any]:
    """Execute call nodes in order, adding their values to ``env``."""
    for node in nodes:
        env[node.name] = run_node(node, env, device, functions)
    return env


def empty_placeholder(graph: Graph, node: Node, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor for a placeholder, with the autograd flag the model gives it."""
    meta = node.tensor_meta
    requires_grad = meta.requires_grad
    if node.kind == "param":
        requires_grad = graph.param_of(node.target).requires_grad
    tensor = torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device=device)
    return tensor.requires_grad_(requires_grad and meta.dtype.is_floating_point)
