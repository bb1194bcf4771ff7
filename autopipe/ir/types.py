"""The vocabulary of the graph IR: nodes, the values they produce, and the model state they read.

A node is an input, a parameter, a buffer, a constant, an operator call or the output; it carries
the tensor metadata of the value it produces (:class:`TensorMeta`) and the module scope it came
from (:class:`Scope`). Node arguments are Python values with :class:`Ref` for the values of other
nodes and :class:`Size` for sizes computed from dynamic dimensions. Nodes are grouped into
*units* (:class:`Unit`), the pieces a partitioner moves between stages.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from ..checks import op_overload, require
from ..errors import ArtifactError

__all__ = [
    "COND",
    "argument_slot",
    "argument_value",
    "FUNCTION_TARGET",
    "MODULE_TARGET",
    "NODE_KINDS",
    "PLACEHOLDER_KINDS",
    "SYMBOLIC_SIZE",
    "BufferInfo",
    "Node",
    "NodeKind",
    "ParamInfo",
    "Ref",
    "Scope",
    "Size",
    "TensorMeta",
    "Unit",
    "dtype_from_name",
    "dtype_name",
    "iter_refs",
    "json_list",
    "map_refs",
    "map_sizes",
    "sizes_in",
    "value_meta",
]

#: the target of a call of a custom autograd function (see autopipe/ir/autograd_function.py)
FUNCTION_TARGET = "autopipe.function.default"
#: the target of a call of a torch module kept whole (see autopipe/ir/kept_module.py)
MODULE_TARGET = "autopipe.module.default"

NodeKind = str  # "input" | "param" | "buffer" | "constant" | "call" | "output"
PLACEHOLDER_KINDS = ("input", "param", "buffer", "constant")
#: the node kinds a graph artefact may hold
NODE_KINDS = ("input", "param", "buffer", "constant", "call")
#: The target of a ``torch.cond`` node; its branches are graphs in its arguments (ir/cond.py)
COND = "higher_order.cond"


class Size(int):
    """A size the model computes from dynamic dimensions (see autopipe/tracing/dynamic.py): an ``int``
    of its value at the sizes the graph is planned for, which every step before code generation
    computes with, and the ``formula`` of the dimensions' names the generated code writes."""

    formula: str

    def __new__(cls, value: int, formula: str) -> Size:
        size = super().__new__(cls, value)
        size.formula = formula
        return size

    def __reduce__(self) -> tuple[type[Size], tuple[int, str]]:
        return (Size, (int(self), self.formula))

    def __repr__(self) -> str:
        return f"Size({int(self)}, {self.formula!r})"


#: Reads a traced tensor size (a ``torch.SymInt`` of dynamic dimensions) as a :class:`Size`;
#: set by the tracer, through :func:`autopipe.ir.sizes.symbolic_sizes`, while it converts a graph
#: with dynamic dimensions.
SYMBOLIC_SIZE: ContextVar[Callable[[Any], int] | None] = ContextVar("symbolic_size", default=None)


# -- dtypes -----------------------------------------------------------------------------------
_DTYPES = {
    dtype_: str(dtype_).removeprefix("torch.")
    for dtype_ in [
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.complex64,
        torch.complex128,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    ]
}
_DTYPES_BY_NAME = {name: dtype_ for dtype_, name in _DTYPES.items()}


def dtype_name(dtype_: torch.dtype) -> str:
    try:
        return _DTYPES[dtype_]
    except KeyError:
        raise ArtifactError(f"dtype {dtype_} is not supported by autopipe") from None


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES_BY_NAME[name]
    except KeyError:
        raise ArtifactError(f"unknown dtype {name!r} in artefact") from None


def json_list(value: Any, field: str) -> list[Any]:
    """``value``, checked to be a JSON list (an :class:`ArtifactError` naming ``field`` if not)."""
    require(isinstance(value, list), field, value, "a list")
    return cast(list[Any], value)  # checked to be a list just above


# -- values -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorMeta:
    """Shape, dtype, strides and autograd flag of one tensor value. With dynamic dimensions,
    ``shape`` and ``stride`` hold the planned sizes and ``sizes`` one formula per dimension
    (``("batch", "seq", "768")``); a static value has no ``sizes``."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    stride: tuple[int, ...]
    requires_grad: bool = False
    sizes: tuple[str, ...] = ()

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def is_contiguous(self) -> bool:
        expected, ok = 1, True
        for size, stride in reversed(list(zip(self.shape, self.stride))):
            if size != 1 and stride != expected:
                ok = False
            expected *= size
        return ok

    @property
    def formulas(self) -> tuple[str | int, ...]:
        """One entry per dimension: its formula if it is dynamic, else its size."""
        if not self.sizes:
            return self.shape
        return tuple(int(f) if f.isdigit() else f for f in self.sizes)

    @classmethod
    def of(cls, tensor: torch.Tensor, requires_grad: bool | None = None) -> TensorMeta:
        read = SYMBOLIC_SIZE.get()
        if read is None or all(type(s) is int for s in (*tensor.shape, *tensor.stride())):
            read = int
        shape = tuple(read(s) for s in tensor.shape)
        dynamic = any(isinstance(s, Size) for s in shape)
        return cls(
            tuple(int(s) for s in shape),
            tensor.dtype,
            tuple(int(read(s)) for s in tensor.stride()),
            tensor.requires_grad if requires_grad is None else requires_grad,
            tuple(s.formula if isinstance(s, Size) else str(s) for s in shape) if dynamic else (),
        )

    def to_json(self) -> dict[str, Any]:
        data = {
            "shape": list(self.shape),
            "dtype": dtype_name(self.dtype),
            "stride": list(self.stride),
            "requires_grad": self.requires_grad,
        }
        return data | ({"sizes": list(self.sizes)} if self.sizes else {})

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TensorMeta:
        return cls(
            tuple(json_list(data["shape"], "shape")),
            dtype_from_name(data["dtype"]),
            tuple(json_list(data["stride"], "stride")),
            data["requires_grad"],
            tuple(json_list(data.get("sizes", []), "sizes")),
        )


def value_meta(value: Any) -> Any:
    """The metadata of a traced value: a :class:`TensorMeta`, a tuple of them (None for
    non-tensors) for a tuple of values, or None."""
    if isinstance(value, torch.Tensor):
        return TensorMeta.of(value, requires_grad=False)
    if isinstance(value, (list, tuple)):
        return tuple(
            TensorMeta.of(v, requires_grad=False) if isinstance(v, torch.Tensor) else None
            for v in value
        )
    return None


@dataclass(frozen=True)
class Scope:
    """One level of a node's module scope: the call ``key`` (unique per module call), the module's
    fully-qualified name and its class."""

    key: str
    fqn: str
    cls: str

    @property
    def class_name(self) -> str:
        return self.cls.rsplit(".", 1)[-1]


@dataclass(frozen=True)
class Ref:
    """A reference to the value produced by another node, inside a node's arguments."""

    name: str


# -- argument values --------------------------------------------------------------------------
def _leaves(value: Any, kind: type) -> Iterator[Any]:
    """Every ``kind`` instance inside a (possibly nested) argument value."""
    if isinstance(value, kind):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _leaves(v, kind)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v, kind)


def _mapped(value: Any, kind: type, fn: Callable[[Any], Any]) -> Any:
    """An argument value rebuilt with every ``kind`` instance replaced by ``fn(instance)``."""
    if isinstance(value, kind):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_mapped(v, kind, fn) for v in value)
    if isinstance(value, dict):
        return {k: _mapped(v, kind, fn) for k, v in value.items()}
    return value


def iter_refs(value: Any) -> Iterator[Ref]:
    """All node references inside a (possibly nested) argument value."""
    return _leaves(value, Ref)


def sizes_in(value: Any) -> Iterator[Size]:
    """Every :class:`Size` inside a (possibly nested) argument value."""
    return _leaves(value, Size)


def map_refs(value: Any, fn: Callable[[Ref], Any]) -> Any:
    """Rebuild an argument value with every :class:`Ref` replaced by ``fn(ref)``."""
    return _mapped(value, Ref, fn)


def map_sizes(value: Any, fn: Callable[[Size], Any]) -> Any:
    """Rebuild an argument value with every :class:`Size` replaced by ``fn(size)``."""
    return _mapped(value, Size, fn)


# -- nodes and state --------------------------------------------------------------------------
@dataclass
class Node:
    """One node of the graph.

    ``target`` is the operator for calls (``"aten.addmm.default"``, ``"getitem"``), the original
    fully-qualified name for parameters and buffers, and the constant's name for constants.
    ``meta`` describes the produced value: a :class:`TensorMeta`, a tuple of them for operators
    returning several tensors, or ``None``. ``context`` lists the grad / autocast modes the node
    runs under (``("grad", False)``, ``("autocast", device_type, dtype, enabled)``).
    ``eval_args`` names the arguments whose value is training's and differs in eval mode, by
    their name in the operator's schema, with their eval-mode value (``{"train": False}`` of a
    dropout; see :mod:`autopipe.ir.eval_mode`).
    """

    name: str
    kind: NodeKind
    target: str = ""
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    meta: Any = None
    scope: tuple[Scope, ...] = ()
    context: tuple[Any, ...] = ()
    unit: int = -1
    eval_args: dict[str, Any] = field(default_factory=dict)

    @property
    def inputs(self) -> list[str]:
        """Names of the nodes this node reads, in argument order, without repeats."""
        seen: dict[str, None] = {}
        for ref in iter_refs((self.args, self.kwargs)):
            seen[ref.name] = None
        return list(seen)

    @property
    def is_placeholder(self) -> bool:
        return self.kind in PLACEHOLDER_KINDS

    @property
    def tensor_meta(self) -> TensorMeta | None:
        return self.meta if isinstance(self.meta, TensorMeta) else None

    @property
    def scope_label(self) -> str:
        """``fqn (Class)`` of the innermost module, or ``""`` for the model's own forward."""
        if not self.scope:
            return ""
        inner = self.scope[-1]
        return f"{inner.fqn} ({inner.class_name})"


@dataclass
class Unit:
    """A group of nodes a partitioner moves as a whole: a module call or a run of ops."""

    index: int
    label: str
    nodes: list[str]


@dataclass
class ParamInfo:
    """A parameter of the original model: all the names it goes by (tied weights have several)."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    owner: str  # class of the module holding the first name

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class BufferInfo:
    """A buffer of the original model. Non-persistent buffers are not in ``state_dict`` and
    carry their value, which the generated stage must rebuild."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    persistent: bool
    owner: str
    value: Any = None  # encoded tensor literal for non-persistent buffers, when known


def argument_slot(node: Node, name: str) -> int | str | None:
    """Where ``node`` passes its operator's schema argument ``name``: a position, a keyword, or
    None (not passed: the schema's default)."""
    op = op_overload(node.target)
    if op is None:
        return None
    positional = [a.name for a in op._schema.arguments if not a.kwarg_only]
    if name in positional and positional.index(name) < len(node.args):
        return positional.index(name)
    return name if name in node.kwargs else None


def argument_value(node: Node, name: str) -> Any:
    """The value ``node`` passes as its operator's schema argument ``name`` (None where it
    passes none)."""
    slot = argument_slot(node, name)
    if slot is None:
        return None
    return node.args[slot] if isinstance(slot, int) else node.kwargs[slot]
