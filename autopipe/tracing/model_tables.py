"""Tables of the model a trace records: its parameters and buffers (with every name each has),
and its forward's inputs (their names, the example's values by name, integer ranges, the
arguments holding no tensor that torch.export fixes to their values)."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..errors import TraceError
from ..ir import BufferInfo, Graph, ParamInfo
from ..ir.codec import encode_tensor
from ..runtime.core.fixed_inputs import FixedInput
from ..spec import Example

__all__ = [
    "bound_inputs",
    "buffer_table",
    "check_state_known",
    "fixed_inputs",
    "forward_signature",
    "integer_input_ranges",
    "parameter_table",
    "state_tensors",
]


def state_tensors(model: torch.nn.Module) -> Iterator[torch.Tensor]:
    """The model's parameters, then its buffers."""
    yield from model.parameters()
    yield from model.buffers()


def _owner_class(model: torch.nn.Module, fqn: str) -> str:
    owner = model.get_submodule(fqn.rpartition(".")[0])
    return f"{type(owner).__module__}.{type(owner).__qualname__}"


def parameter_table(model: torch.nn.Module) -> dict[str, ParamInfo]:
    """The model's parameters by their first name, each with every name it has (tied ones)."""
    groups: dict[int, list[str]] = {}
    tensors: dict[int, torch.nn.Parameter] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
        tensors[id(param)] = param
    table = {}
    for key, names in groups.items():
        p = tensors[key]
        table[names[0]] = ParamInfo(
            tuple(names), tuple(p.shape), p.dtype, p.requires_grad, _owner_class(model, names[0])
        )
    return table


def buffer_table(model: torch.nn.Module) -> dict[str, BufferInfo]:
    """The model's buffers by their first name; a non-persistent buffer with its value (not
    saved in checkpoints, the generated pipeline rebuilds it from this)."""
    persistent = set(model.state_dict().keys())
    groups: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, buf in model.named_buffers(remove_duplicate=False):
        groups.setdefault(id(buf), []).append(name)
        tensors[id(buf)] = buf
    table = {}
    for key, names in groups.items():
        buf = tensors[key]
        is_persistent = names[0] in persistent
        value = None
        if not is_persistent and not buf.is_meta:
            value = encode_tensor(buf)
        table[names[0]] = BufferInfo(
            tuple(names),
            tuple(buf.shape),
            buf.dtype,
            is_persistent,
            _owner_class(model, names[0]),
            value,
        )
    return table


def check_state_known(graph: Graph) -> None:
    """Check that every parameter and buffer the graph reads is in its tables, and that a
    non-persistent buffer has its value."""
    for node in graph.nodes:
        if node.kind == "param":
            graph.param_of(node.target)
        elif node.kind == "buffer":
            info = next((b for b in graph.buffers.values() if node.target in b.names), None)
            if info is None:
                raise TraceError(
                    f"buffer {node.target} is used by the graph but not found in the model"
                )
            if not info.persistent and info.value is None:
                raise TraceError(
                    f"non-persistent buffer {node.target} has no value because the model was built "
                    "on the meta device, and it is not saved in checkpoints, so the generated "
                    "pipeline could not rebuild it. Build the model inside `with "
                    "autopipe.empty_weights():` instead of `torch.device('meta')` (parameters stay "
                    "on meta, buffers keep their values), or build it on CPU."
                )


def forward_signature(model: torch.nn.Module, positional: int = 0) -> list[str]:
    """The names of the forward's parameters (``**kwargs`` left out). A ``*args`` parameter
    stands for the ``positional`` example arguments past the named ones, each named as
    torch.export names its input: ``args_0``, ``args_1``, ... (a wrapper such as PEFT's
    ``PeftModel.forward(*args, **kwargs)`` then takes its inputs by position, as the model it
    wraps does)."""
    names: list[str] = []
    for p in inspect.signature(model.forward).parameters.values():
        if p.kind == p.VAR_POSITIONAL:
            names += [f"{p.name}_{i}" for i in range(max(positional - len(names), 0))]
        elif p.kind != p.VAR_KEYWORD:
            names.append(p.name)
    return names


def bound_inputs(example: Example) -> dict[str, Any]:
    """The example's inputs by the name of the forward parameter each one is (``*args`` and
    ``**kwargs`` spread out under the names :func:`forward_signature` and torch.export give
    them)."""
    sig = inspect.signature(example.model.forward)
    try:
        arguments = sig.bind(*example.args, **example.kwargs).arguments
    except TypeError as exc:
        raise TraceError(
            f"the example inputs do not match {type(example.model).__name__}.forward: {exc}"
        ) from None
    bound: dict[str, Any] = {}
    for name, value in arguments.items():
        kind = sig.parameters[name].kind
        if kind == inspect.Parameter.VAR_POSITIONAL:
            bound |= {f"{name}_{i}": v for i, v in enumerate(value)}
        elif kind == inspect.Parameter.VAR_KEYWORD:
            bound |= value
        else:
            bound[name] = value
    return bound


def fixed_inputs(model: torch.nn.Module, bound: dict[str, Any]) -> dict[str, FixedInput]:
    """The example's inputs (by name, :func:`bound_inputs`) that hold no tensor, and the
    forward's arguments the example leaves at a default that is no tensor: torch.export fixes
    them to these values, which a batch may not change (a value :meth:`.FixedInput.of` cannot
    record is left out). A batch may leave one out where the value is the forward's default;
    the record of a value passed otherwise (another value than the default, an argument without
    one, or one ``**kwargs`` takes) holds the default, and a batch must pass it."""
    parameters = inspect.signature(model.forward).parameters
    defaults = {
        name: parameter.default
        for name, parameter in parameters.items()
        if parameter.default is not inspect.Parameter.empty and name not in bound
    }
    fixed = {}
    for name, value in (bound | defaults).items():
        if any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(value)):
            continue
        record = FixedInput.of(name, value)
        if record is None:
            continue
        if name not in defaults:  # passed by the example: beside the forward's default
            parameter = parameters.get(name)
            has_default = parameter is not None and parameter.default is not parameter.empty
            default = parameter.default if parameter is not None and has_default else None
            record = record.beside_default(default, has_default)
        fixed[name] = record
    return fixed


def integer_input_ranges(bound: dict[str, Any]) -> dict[str, int]:
    """Largest value of each integer example input, for synthetic data of the same range."""
    ranges = {}
    for name, value in bound.items():
        if (
            isinstance(value, torch.Tensor)
            and not value.is_meta
            and not value.is_floating_point()
            and value.numel()
        ):
            ranges[name] = int(value.max())
    return ranges
