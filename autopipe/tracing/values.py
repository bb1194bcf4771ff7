"""What a node of an exported program holds, as the graph IR records it: its module scope, the
metadata of its value, tensor constants as literals, and the error for a value whose size
depends on tensor values."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from ..errors import TraceError
from ..ir import Scope, TensorMeta
from ..ir.codec import encode_tensor
from ..ir.types import value_meta
from .user_line import at_node

__all__ = [
    "MAX_CONSTANT_ELEMENTS",
    "constant_literal",
    "data_dependent_error",
    "is_symbolic",
    "scope_of",
    "symbolic_size_error",
    "tensor_meta_of",
    "value_meta_of",
]

#: Constants larger than this are not embedded in the graph (they would bloat the generated code).
MAX_CONSTANT_ELEMENTS = 1 << 16


def tensor_meta_of(node: fx.Node) -> TensorMeta | None:
    """The metadata of ``node``'s value if it is a tensor (no autograd flag yet), else None."""
    value = node.meta.get("val")
    return TensorMeta.of(value, requires_grad=False) if isinstance(value, torch.Tensor) else None


def value_meta_of(node: fx.Node) -> Any:
    """The metadata of ``node``'s value as the IR records it (see :func:`value_meta`)."""
    return value_meta(node.meta.get("val"))


def scope_of(node: fx.Node) -> tuple[Scope, ...]:
    """The module calls ``node`` was traced in, outermost first (the model itself left out)."""
    stack = node.meta.get("nn_module_stack") or {}
    scopes = []
    for key, (fqn, cls) in stack.items():
        if not fqn:
            continue  # the model itself
        cls_name = cls if isinstance(cls, str) else f"{cls.__module__}.{cls.__qualname__}"
        suffix = key.rpartition("@")[2] if "@" in key else ""
        scopes.append(Scope(f"{fqn}@{suffix}" if suffix else fqn, fqn, cls_name))
    return tuple(scopes)


def constant_literal(name: str, value: Any) -> dict:
    """A tensor constant of the model, encoded for the graph (refused when it is not a tensor,
    unknown (on meta) or too large to embed in generated code)."""
    if not isinstance(value, torch.Tensor):
        raise TraceError(
            f"constant {name} is a {type(value).__name__}; only tensor constants are supported"
        )
    if value.is_meta:
        raise TraceError(
            f"the value of {name} is unknown because the model was built on the meta device; "
            "create this tensor on a real device (it is not a parameter, so it is not loaded from "
            "a checkpoint), or build the model on CPU"
        )
    if value.numel() > MAX_CONSTANT_ELEMENTS:
        raise TraceError(
            f"constant {name} has {value.numel()} elements; autopipe embeds constants in the "
            f"generated code and allows at most {MAX_CONSTANT_ELEMENTS}. Make it a buffer of the model."
        )
    return encode_tensor(value)


def is_symbolic(value: Any, known: Any = frozenset()) -> bool:
    """A number, or a tensor size, that torch.export only knows as a symbol other than the
    ``known`` ones (dynamic dimensions)."""
    if isinstance(value, torch.Tensor):
        return any(is_symbolic(size, known) for size in value.shape)
    if isinstance(value, torch.SymInt):  # (one of known symbols alone is a dynamic size)
        free = value.node.expr.free_symbols
        return not (free and free <= known)
    return isinstance(value, (torch.SymFloat, torch.SymBool))


def data_dependent_error(what: str, where: str, code: str, detail: str) -> TraceError:
    """The error for control flow or shapes that depend on tensor values, at the user's line."""
    cond = (
        "write the branch as torch.cond(pred, true_fn, false_fn, (operands,)) with a tensor "
        "predicate: autopipe compiles both branches and runs the one pred picks (each branch "
        "returning tensors of the same shapes); "
        if what == "control flow"
        else ""
    )
    return TraceError(
        f"the model has data-dependent {what} at {where}:{code}\n"
        "autopipe captures one graph for all inputs, so a Python branch or size cannot depend "
        "on tensor values. Options: compute both sides and select with torch.where (a mask "
        f"instead of nonzero or boolean indexing); {cond}pass the value that decides the branch "
        "or size as a fixed (non-tensor) input of the example; or move the code out of the "
        "model's forward. --basic-blocks only groups traced operators: it cannot hide a branch "
        f"from the tracer. ({detail})"
    )


def symbolic_size_error(node: fx.Node, known: Any = frozenset()) -> TraceError | None:
    """A :class:`TraceError` naming the user's line if ``node`` produces a value whose size
    depends on tensor values (``nonzero``, boolean indexing, ``.item()``), else None. Sizes of
    the ``known`` symbols (dynamic dimensions) are no such size."""
    value = node.meta.get("val")
    values = value if isinstance(value, (list, tuple)) else [value]
    if not any(is_symbolic(v, known) for v in values):
        return None
    where, code = at_node(node)
    detail = (
        f"the size or value {node.target} returns depends on the input's values; with real "
        "weights (not a model built on meta) autopipe compiles it for the example's value"
    )
    return data_dependent_error("shapes", where, code, detail)
