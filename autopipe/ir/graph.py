"""The graph IR shared by every step of the compiler.

A :class:`Graph` is the model's forward pass as a list of nodes in program order, held in a
``networkx.DiGraph`` whose edges are data dependencies. Like ``torch.fx`` the IR is small: a node
is an input, a parameter, a buffer, a constant, an operator call or the output, and it carries the
tensor metadata of the value it produces and the module scope it came from. Nodes are grouped into
*units*, the pieces a partitioner moves between stages.

The graph round-trips through JSON (``autopipe.ir.graph`` artefact), so every later step can start
from the file ``autopipe trace`` wrote.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import math
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable, Iterable, Iterator

import networkx as nx
import torch
from torch import fx

from ..artifacts import artifact_text, atomic_write_text, check_replaceable, read_artifact
from ..checks import (
    is_class_name,
    is_fqn,
    is_identifier,
    is_int,
    is_text,
    is_value_name,
    op_overload,
    require,
)
from ..errors import ArtifactError
from ..runtime.shapes import FormulaError, evaluate

GRAPH_KIND = "graph"
#: the target of a call of a custom autograd function (see autopipe/ir/autograd_function.py)
FUNCTION_TARGET = "autopipe.function.default"

NodeKind = str  # "input" | "param" | "buffer" | "constant" | "call" | "output"
PLACEHOLDER_KINDS = ("input", "param", "buffer", "constant")
#: The target of a ``torch.cond`` node; its branches are graphs in its arguments (control_flow.py)
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

    def __reduce__(self) -> tuple:
        return (Size, (int(self), self.formula))

    def __repr__(self) -> str:
        return f"Size({int(self)}, {self.formula!r})"


#: Reads a traced tensor size (a ``torch.SymInt`` of dynamic dimensions) as a :class:`Size`;
#: set by the tracer while it converts a graph with dynamic dimensions.
_symbolic_size: ContextVar[Callable[[Any], int] | None] = ContextVar("symbolic_size", default=None)


@contextlib.contextmanager
def symbolic_sizes(reader: Callable[[Any], int]) -> Iterator[None]:
    """Within this block, :meth:`TensorMeta.of` reads symbolic sizes with ``reader``."""
    token = _symbolic_size.set(reader)
    try:
        yield
    finally:
        _symbolic_size.reset(token)


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
        read = _symbolic_size.get()
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

    def to_json(self) -> dict:
        data = {
            "shape": list(self.shape),
            "dtype": dtype_name(self.dtype),
            "stride": list(self.stride),
            "requires_grad": self.requires_grad,
        }
        return data | ({"sizes": list(self.sizes)} if self.sizes else {})

    @classmethod
    def from_json(cls, data: dict) -> TensorMeta:
        return cls(
            tuple(_list(data["shape"], "shape")),
            dtype_from_name(data["dtype"]),
            tuple(_list(data["stride"], "stride")),
            data["requires_grad"],
            tuple(_list(data.get("sizes", []), "sizes")),
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


@dataclass
class Node:
    """One node of the graph.

    ``target`` is the operator for calls (``"aten.addmm.default"``, ``"getitem"``), the original
    fully-qualified name for parameters and buffers, and the constant's name for constants.
    ``meta`` describes the produced value: a :class:`TensorMeta`, a tuple of them for operators
    returning several tensors, or ``None``. ``context`` lists the grad / autocast modes the node
    runs under (``("grad", False)``, ``("autocast", device_type, dtype, enabled)``).
    """

    name: str
    kind: NodeKind
    target: str = ""
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    meta: Any = None
    scope: tuple[Scope, ...] = ()
    context: tuple = ()
    unit: int = -1

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


class Graph:
    """The traced model: nodes in program order inside a ``networkx.DiGraph``."""

    def __init__(
        self,
        nodes: Iterable[Node],
        *,
        inputs: list[str],
        outputs: list[str],
        signature: list[str],
        params: dict[str, ParamInfo],
        buffers: dict[str, BufferInfo],
        constants: dict[str, Any],
        model: dict[str, Any],
        units: list[Unit] | None = None,
        loss: Graph | None = None,
        functions: dict[str, Any] | None = None,
    ):
        self.dag = nx.DiGraph()
        for node in nodes:
            if node.name in self.dag:
                raise ArtifactError(f"two nodes are named {node.name!r}")
            self.dag.add_node(node.name, node=node)
        for node in self.nodes:
            for src in node.inputs:
                if src not in self.dag:
                    raise ArtifactError(f"node {node.name!r} reads unknown node {src!r}")
                self.dag.add_edge(src, node.name)
        self.inputs = inputs
        self.outputs = outputs
        self.signature = signature
        self.params = params
        self.buffers = buffers
        self.constants = constants
        self.model = model
        self.units = units or []
        #: the traced user loss function (output leaves and target -> scalar), if one was given
        self.loss = loss
        #: custom autograd functions the graph calls, by name (:class:`autopipe.ir.autograd_function.FunctionDef`)
        self.functions = functions if functions is not None else {}
        self._json_text: str | None = None

    # -- access -------------------------------------------------------------------------------
    @property
    def nodes(self) -> Iterator[Node]:
        for name in self.dag.nodes:
            yield self.dag.nodes[name]["node"]

    def __getitem__(self, name: str) -> Node:
        return self.dag.nodes[name]["node"]

    def __len__(self) -> int:
        return self.dag.number_of_nodes()

    @property
    def calls(self) -> list[Node]:
        return [n for n in self.nodes if n.kind == "call"]

    def users(self, name: str) -> list[str]:
        return list(self.dag.successors(name))

    def param_of(self, name: str) -> ParamInfo:
        """The parameter a name (any of its tied aliases) refers to."""
        for info in self.params.values():
            if name in info.names:
                return info
        raise KeyError(name)

    def unit_nodes(self, unit: int) -> list[Node]:
        return [self[n] for n in self.units[unit].nodes]

    def value_bytes(self, name: str) -> int:
        meta = self[name].meta
        return meta.nbytes if isinstance(meta, TensorMeta) else 0

    @property
    def unused_inputs(self) -> list[str]:
        """Model inputs no operator reads (an optional mask the model ignores)."""
        return [
            name
            for name in self.inputs
            if self.dag.out_degree(name) == 0 and name not in self.outputs
        ]

    # -- invariants ---------------------------------------------------------------------------
    def lint(self, where: str = "") -> None:
        """Check the invariants the later steps rely on, in one pass, as ``torch.fx``'s
        ``Graph.lint`` does; raise :class:`ArtifactError` naming the first field that breaks one.

        Names that become Python identifiers in generated code are identifiers autopipe could
        have made; module names are dotted identifiers; operators are real torch operators called
        with arguments their schemas accept; nodes come in program order; every value a stage
        could exchange is a tensor; units cover the operators exactly once."""
        _lint_model(self.model, where)
        require(
            isinstance(self.signature, list) and all(map(is_identifier, self.signature)),
            f"{where}signature",
            self.signature,
            "a list of argument names",
        )
        for table, kind in ((self.params, "params"), (self.buffers, "buffers")):
            for canonical, info in table.items():
                _lint_state(info, f"{where}{kind}[{canonical!r}]")
        held = [n for info in [*self.params.values(), *self.buffers.values()] for n in info.names]
        require(len(set(held)) == len(held), f"{where}params", held, "names of one tensor each")
        require(isinstance(self.constants, dict), f"{where}constants", self.constants, "an object")
        for name, value in self.constants.items():
            require(is_value_name(name), f"{where}constants", name, _IDENTIFIER)
            _lint_tensor(value, f"{where}constants[{name!r}]")
        if self.functions:
            from .autograd_function import lint_functions

            lint_functions(self, where)
        seen: set[str] = set()
        planned = planned_sizes(self)
        for position, node in enumerate(self.nodes):
            field_name = f"{where}nodes[{position}] ({node.name!r})"
            _lint_node(self, node, seen, field_name)
            _lint_sizes(node, planned, field_name)
            seen.add(node.name)
        for field_name, names in (("inputs", self.inputs), ("outputs", self.outputs)):
            require(isinstance(names, list), f"{where}{field_name}", names, "a list of node names")
            for name in names:
                require(
                    isinstance(name, str) and name in self.dag,
                    f"{where}{field_name}",
                    name,
                    "the name of a node",
                )
                require(
                    self[name].tensor_meta is not None,
                    f"{where}{field_name}",
                    name,
                    "a tensor value with shape and dtype",
                )
        declared = {n.name for n in self.nodes if n.kind == "input"}
        require(
            set(self.inputs) == declared and len(self.inputs) == len(declared),
            f"{where}inputs",
            self.inputs,
            f"the input nodes, each once ({sorted(declared)})",
        )
        _lint_symbol_sources(self, where)
        _lint_units(self, where)
        if self.loss is not None:
            require(
                len(self.loss.outputs) == 1 and len(self.loss.inputs) == len(self.outputs) + 1,
                "loss",
                self.loss.inputs,
                "a graph from the model's outputs and a target to one loss value",
            )

    # -- JSON ---------------------------------------------------------------------------------
    def to_json(self) -> dict:
        scopes: dict[tuple[Scope, ...], int] = {}
        nodes = []
        for node in self.nodes:
            record: dict[str, Any] = {"name": node.name, "kind": node.kind}
            if node.target:
                record["target"] = node.target
            if node.args:
                record["args"] = encode(list(node.args))
            if node.kwargs:
                record["kwargs"] = {k: encode(v) for k, v in node.kwargs.items()}
            if node.meta is not None:
                record["meta"] = _encode_meta(node.meta)
            if node.scope:
                record["scope"] = scopes.setdefault(node.scope, len(scopes))
            if node.context:
                record["context"] = encode(list(node.context))
            if node.kind == "call":
                record["unit"] = node.unit
            nodes.append(record)
        return {
            "model": self.model,
            "signature": self.signature,
            "inputs": self.inputs,
            "outputs": self.outputs,
            "params": [
                {
                    "names": list(p.names),
                    "shape": list(p.shape),
                    "dtype": dtype_name(p.dtype),
                    "requires_grad": p.requires_grad,
                    "owner": p.owner,
                }
                for p in self.params.values()
            ],
            "buffers": [
                {
                    "names": list(b.names),
                    "shape": list(b.shape),
                    "dtype": dtype_name(b.dtype),
                    "persistent": b.persistent,
                    "owner": b.owner,
                    **({"value": b.value} if b.value is not None else {}),
                }
                for b in self.buffers.values()
            ],
            "constants": self.constants,
            "scopes": [[[s.key, s.fqn, s.cls] for s in scope] for scope in scopes],
            "units": [{"label": u.label, "nodes": u.nodes} for u in self.units],
            "nodes": nodes,
            **(
                {"functions": [f.to_json() for f in self.functions.values()]}
                if self.functions
                else {}
            ),
            **({"loss": self.loss.to_json()} if self.loss is not None else {}),
        }

    @classmethod
    def from_json(cls, data: dict) -> Graph:
        """The graph an ``autopipe.ir.graph`` payload describes, checked with :meth:`lint`."""
        try:
            return cls._from_json(data)
        except KeyError as exc:
            problem = f"malformed (a field {exc} is missing)"
        except (TypeError, ValueError, IndexError, AttributeError) as exc:
            problem = f"malformed ({type(exc).__name__}: {exc})"
        except ArtifactError as exc:
            problem = f"invalid: {exc}"
        raise ArtifactError(
            f"the graph artefact is {problem}; write it again with `autopipe trace`"
        )

    @classmethod
    def _from_json(cls, data: dict, where: str = "") -> Graph:
        scopes = [tuple(Scope(*s) for s in _list(scope, "scope")) for scope in data["scopes"]]
        nodes = [
            Node(
                name=r["name"],
                kind=r["kind"],
                target=r.get("target", ""),
                args=tuple(decode(_list(r.get("args", []), "a node's args"))),
                kwargs={k: decode(v) for k, v in r.get("kwargs", {}).items()},
                meta=_decode_meta(r.get("meta")),
                scope=scopes[_index(r["scope"])] if "scope" in r else (),
                context=tuple(tuple(c) for c in decode(r.get("context", []))),
                unit=r.get("unit", -1),
            )
            for r in _list(data["nodes"], "nodes")
        ]
        params = {
            p["names"][0]: ParamInfo(
                tuple(_list(p["names"], "a parameter's names")),
                tuple(_list(p["shape"], "a parameter's shape")),
                dtype_from_name(p["dtype"]),
                p["requires_grad"],
                p["owner"],
            )
            for p in data["params"]
        }
        buffers = {
            b["names"][0]: BufferInfo(
                tuple(_list(b["names"], "a buffer's names")),
                tuple(_list(b["shape"], "a buffer's shape")),
                dtype_from_name(b["dtype"]),
                b["persistent"],
                b["owner"],
                b.get("value"),
            )
            for b in data["buffers"]
        }
        units = [
            Unit(i, u["label"], u["nodes"]) for i, u in enumerate(_list(data["units"], "units"))
        ]
        functions = {}
        if "functions" in data:
            from .autograd_function import FunctionDef

            for i, record in enumerate(_list(data["functions"], "functions")):
                function = FunctionDef.from_json(record, f"{where}functions[{i}]")
                require(
                    function.name not in functions,
                    f"{where}functions[{i}].name",
                    function.name,
                    "the name of one function",
                )
                functions[function.name] = function
        graph = cls(
            nodes,
            inputs=data["inputs"],
            outputs=data["outputs"],
            signature=data["signature"],
            params=params,
            buffers=buffers,
            constants=data["constants"],
            model=data["model"],
            units=units,
            loss=cls._from_json(data["loss"], "loss.") if "loss" in data else None,
            functions=functions,
        )
        graph.lint(where)
        return graph

    def rebound(self, sizes: dict[str, int]) -> Graph:
        """A copy whose metadata and sizes are for other ``sizes`` of the dynamic dimensions
        (those not given stay at their planned sizes): for profiling time at the sizes a run
        expects. Strides keep each value's memory layout. Not for saving: lint checks the upper
        bounds."""
        values = planned_sizes(self) | sizes

        def meta(m: Any) -> Any:
            if isinstance(m, tuple):
                return tuple(meta(item) for item in m)
            if not isinstance(m, TensorMeta) or not m.sizes:
                return m
            shape = tuple(evaluate(f, values) for f in m.formulas)
            return dataclasses.replace(m, shape=shape, stride=_same_layout(m, shape))

        def args(value: Any) -> Any:
            return _mapped(value, Size, lambda s: Size(evaluate(s.formula, values), s.formula))

        nodes = [
            dataclasses.replace(n, meta=meta(n.meta), args=args(n.args), kwargs=args(n.kwargs))
            for n in self.nodes
        ]
        return Graph(
            nodes,
            inputs=self.inputs,
            outputs=self.outputs,
            signature=self.signature,
            params=self.params,
            buffers=self.buffers,
            constants=self.constants,
            model=self.model,
            units=self.units,
            loss=self.loss,
            functions=self.functions,
        )

    def json_text(self) -> str:
        """The text of the graph artefact, computed once: a graph is not changed after tracing."""
        if self._json_text is None:
            self._json_text = artifact_text(GRAPH_KIND, self.to_json())
        return self._json_text

    def save(self, path) -> None:
        check_replaceable(path, GRAPH_KIND)
        atomic_write_text(path, self.json_text())

    @classmethod
    def load(cls, path) -> Graph:
        data = read_artifact(path, GRAPH_KIND)
        try:
            return cls.from_json(data)
        except ArtifactError as exc:
            raise ArtifactError(f"{path}: {exc}") from None


# -- argument encoding ------------------------------------------------------------------------
# Node arguments are Python values with Ref for node references. In JSON, plain ints, bools,
# strings, None and lists stay as they are; everything else is a one-key object.

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
_LAYOUTS = {torch.strided: "strided", torch.sparse_coo: "sparse_coo"}
_MEMORY_FORMATS = {
    torch.contiguous_format: "contiguous_format",
    torch.channels_last: "channels_last",
    torch.channels_last_3d: "channels_last_3d",
    torch.preserve_format: "preserve_format",
}


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


class UnsupportedValue(TypeError):
    """An argument value the IR cannot represent."""


def encode(value: Any) -> Any:
    """Encode a node argument as JSON-compatible data."""
    if isinstance(value, Size):
        return {"size": [int(value), value.formula]}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, Ref):
        return {"ref": value.name}
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        return {"dict": {k: encode(v) for k, v in value.items()}}
    if isinstance(value, torch.dtype):
        return {"dtype": dtype_name(value)}
    if isinstance(value, torch.device):
        return {"device": value.type}
    if isinstance(value, torch.layout):
        return {"layout": _LAYOUTS[value]}
    if isinstance(value, torch.memory_format):
        return {"memory_format": _MEMORY_FORMATS[value]}
    if isinstance(value, Graph):  # a branch of torch.cond
        return {"graph": value.to_json()}
    raise UnsupportedValue(f"{type(value).__name__} value {value!r}")


def encode_args(value: Any, names: dict) -> Any:
    """FX arguments -> IR arguments (:class:`Ref` for nodes), checked to be JSON-encodable."""
    if isinstance(value, fx.Node):
        return names[value]
    if isinstance(value, (list, tuple)):
        return [encode_args(v, names) for v in value]
    if isinstance(value, dict):
        return {k: encode_args(v, names) for k, v in value.items()}
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        raise UnsupportedValue(f"symbolic value {value} (declare its dimension with --dynamic)")
    encode(value)  # raises UnsupportedValue for anything the IR cannot hold
    return value


def decode(value: Any) -> Any:
    """Inverse of :func:`encode`."""
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) != 1:
        raise ArtifactError(f"malformed encoded value {value!r}")
    ((tag, payload),) = value.items()
    if tag == "ref":
        return Ref(payload)
    if tag == "float":
        return float(payload)
    if tag == "size":
        if not (
            isinstance(payload, list)
            and len(payload) == 2
            and is_int(payload[0])
            and is_text(payload[1])
        ):
            raise ArtifactError(f"malformed size {value!r}: [planned size, formula] expected")
        return Size(*payload)
    if tag == "dict":
        return {k: decode(v) for k, v in payload.items()}
    if tag == "dtype":
        return dtype_from_name(payload)
    if tag == "device":
        try:
            return torch.device(payload)
        except (RuntimeError, TypeError):
            raise ArtifactError(f"unknown device {payload!r} in artefact") from None
    if tag == "layout":
        return {v: k for k, v in _LAYOUTS.items()}[payload]
    if tag == "memory_format":
        return {v: k for k, v in _MEMORY_FORMATS.items()}[payload]
    if tag == "graph":  # a branch of torch.cond, checked as a graph of its own
        return Graph._from_json(payload, "branch.")
    raise ArtifactError(f"unknown encoded value {value!r}")


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


def map_refs(value: Any, fn) -> Any:
    """Rebuild an argument value with every :class:`Ref` replaced by ``fn(ref)``."""
    return _mapped(value, Ref, fn)


def _encode_meta(meta: Any) -> Any:
    if isinstance(meta, TensorMeta):
        return meta.to_json()
    if isinstance(meta, tuple):
        return {"tuple": [_encode_meta(m) for m in meta]}
    return None


def _decode_meta(data: Any) -> Any:
    if data is None:
        return None
    if "tuple" in data:
        return tuple(_decode_meta(m) for m in data["tuple"])
    return TensorMeta.from_json(data)


# -- tensor literals --------------------------------------------------------------------------
def encode_tensor(tensor: torch.Tensor) -> dict:
    """A tensor's value as JSON data (used for small constants and non-persistent buffers)."""
    flat = tensor.detach().cpu().reshape(-1)
    if tensor.dtype.is_floating_point:
        data = [encode(float(v)) for v in flat.double().tolist()]
    else:
        data = flat.tolist()
    return {"shape": list(tensor.shape), "dtype": dtype_name(tensor.dtype), "data": data}


def decode_tensor(data: dict, device: torch.device | str = "cpu") -> torch.Tensor:
    values = [decode(v) for v in data["data"]]
    dtype_ = dtype_from_name(data["dtype"])
    return torch.tensor(values, dtype=dtype_, device=device).reshape(data["shape"])


# -- invariants (Graph.lint) ------------------------------------------------------------------
_IDENTIFIER = "a Python identifier autopipe could have made (not a keyword or a reserved name)"
_NODE_KINDS = ("input", "param", "buffer", "constant", "call")
_SIZES = "a list of sizes (integers of at least 0)"


def _list(value: Any, field: str) -> list:
    require(isinstance(value, list), field, value, "a list")
    return value


def _index(value: Any) -> int:
    require(is_int(value, 0), "a node's scope", value, "an index into scopes")
    return value


def _lint_model(model: Any, where: str) -> None:
    require(isinstance(model, dict), f"{where}model", model, "an object")
    require(is_class_name(model.get("class")), f"{where}model.class", model.get("class"), "a class")
    source = model.get("source")
    require(source is None or is_text(source), f"{where}model.source", source, "a model spec")
    on_meta = model.get("on_meta", False)
    require(isinstance(on_meta, bool), f"{where}model.on_meta", on_meta, "true or false")
    ranges = model.get("input_ranges", {})
    require(
        isinstance(ranges, dict) and all(is_int(v) for v in ranges.values()),
        f"{where}model.input_ranges",
        ranges,
        "an object of integers by input name",
    )
    depth = model.get("depth")
    require(depth is None or is_int(depth, 0), f"{where}model.depth", depth, "null or a depth")
    blocks = model.get("basic_blocks", [])
    require(
        isinstance(blocks, list) and all(map(is_text, blocks)),
        f"{where}model.basic_blocks",
        blocks,
        "a list of class names",
    )
    inline = model.get("inline_blocks", False)
    require(isinstance(inline, bool), f"{where}model.inline_blocks", inline, "true or false")
    operators = model.get("operators", {})
    require(
        isinstance(operators, dict)
        and all(
            is_text(name) and name.count("::") == 1 and is_fqn(module)
            for name, module in operators.items()
        ),
        f"{where}model.operators",
        operators,
        "an object of module names by operator (namespace::name)",
    )
    symbols = model.get("symbols", {})
    require(isinstance(symbols, dict), f"{where}model.symbols", symbols, "an object")
    for name, symbol in symbols.items():
        require(
            is_value_name(name)
            and isinstance(symbol, dict)
            and sorted(symbol) == ["max", "min", "planned", "sources"]
            and is_int(symbol["min"], 2)
            and is_int(symbol["planned"], symbol["min"])
            and (symbol["max"] is None or is_int(symbol["max"], symbol["planned"]))
            and isinstance(symbol["sources"], list)
            and all(
                isinstance(s, list) and len(s) == 2 and is_identifier(s[0]) and is_int(s[1], 0)
                for s in symbol["sources"]
            ),
            f"{where}model.symbols.{name}",
            symbol,
            "a dynamic dimension {min >= 2, planned >= min, max >= planned or null, "
            "sources: [[input, dimension], ...]}",
        )

    for name, module in sorted(operators.items()):  # registers them, for the checks below
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ArtifactError(
                f"the graph calls the operator {name}, registered by the module {module}, which "
                f"cannot be imported here ({exc}); install the package that provides it"
            ) from None


def _lint_symbol_sources(graph: Graph, where: str) -> None:
    """Each dynamic dimension sizes model inputs, whose metadata names it there."""
    for name, symbol in graph.model.get("symbols", {}).items():
        for source, dim in symbol["sources"]:
            meta = graph[source].tensor_meta if source in graph.inputs else None
            require(
                meta is not None and dim < len(meta.sizes) and meta.sizes[dim] == name,
                f"{where}model.symbols.{name}.sources",
                [source, dim],
                f"a model input whose dimension {dim} is {name}",
            )


def _lint_state(info: ParamInfo | BufferInfo, field: str) -> None:
    require(
        bool(info.names) and all(map(is_fqn, info.names)),
        f"{field}.names",
        list(info.names),
        "a list of module names (dot-separated identifiers or numbers)",
    )
    require(all(is_int(s, 0) for s in info.shape), f"{field}.shape", list(info.shape), _SIZES)
    flag = "requires_grad" if isinstance(info, ParamInfo) else "persistent"
    value = getattr(info, flag)
    require(isinstance(value, bool), f"{field}.{flag}", value, "true or false")
    require(is_class_name(info.owner), f"{field}.owner", info.owner, "a class")
    if isinstance(info, BufferInfo) and info.value is not None:
        tensor = _lint_tensor(info.value, f"{field}.value")
        require(
            tuple(tensor.shape) == info.shape and tensor.dtype == info.dtype,
            f"{field}.value",
            info.value,
            f"a tensor of the buffer's shape {list(info.shape)} and dtype",
        )


def _lint_tensor(data: Any, field: str) -> torch.Tensor:
    """A tensor literal (:func:`encode_tensor`) checked by decoding it."""
    require(
        isinstance(data, dict) and sorted(data) == ["data", "dtype", "shape"],
        field,
        data,
        "a tensor literal {shape, dtype, data}",
    )
    shape, values = data["shape"], data["data"]
    require(isinstance(shape, list) and all(is_int(s, 0) for s in shape), field, shape, _SIZES)
    count = math.prod(shape)
    require(
        isinstance(values, list) and len(values) == count,
        f"{field}.data",
        values,
        f"a list of {count} values",
    )
    try:
        return decode_tensor(data)
    except (ArtifactError, RuntimeError, TypeError, ValueError, OverflowError) as exc:
        raise ArtifactError(f"{field} is not a tensor literal ({exc})") from None


def _lint_node(graph: Graph, node: Node, seen: set[str], field: str) -> None:
    require(is_value_name(node.name), f"{field}.name", node.name, _IDENTIFIER)
    require(node.kind in _NODE_KINDS, f"{field}.kind", node.kind, f"one of {_NODE_KINDS}")
    for ref in iter_refs((node.args, node.kwargs)):
        require(ref.name in seen, f"{field}.args", ref.name, "a node defined before this one")
    _lint_meta(node.meta, f"{field}.meta")
    for level in node.scope:
        require(
            is_text(level.key) and is_fqn(level.fqn) and is_class_name(level.cls),
            f"{field}.scope",
            [level.key, level.fqn, level.cls],
            "a [key, module name, class] triple",
        )
    for entry in node.context:
        require(_is_mode(entry), f"{field}.context", entry, "a grad or autocast mode")
    if node.kind == "call":
        _lint_call(graph, node, field)
        return
    require(
        not node.args and not node.kwargs and not node.context,
        field,
        node.args,
        "a placeholder: it has no arguments",
    )
    require(node.tensor_meta is not None, f"{field}.meta", node.meta, "tensor metadata")
    if node.kind == "param":
        known = any(node.target in info.names for info in graph.params.values())
        require(known, f"{field}.target", node.target, "the name of a parameter in params")
    elif node.kind == "buffer":
        info = next((b for b in graph.buffers.values() if node.target in b.names), None)
        require(info is not None, f"{field}.target", node.target, "a buffer in buffers")
        require(
            info.persistent or info.value is not None,
            f"{field}.target",
            node.target,
            "a buffer the pipeline can rebuild (a non-persistent buffer needs its value)",
        )
    elif node.kind == "constant":
        require(
            node.target == node.name and node.name in graph.constants,
            f"{field}.target",
            node.target,
            "the node's own name, a key of constants",
        )


def _lint_call(graph: Graph, node: Node, field: str) -> None:
    require(
        is_int(node.unit, 0) and node.unit < len(graph.units),
        f"{field}.unit",
        node.unit,
        f"a unit index below {len(graph.units)}",
    )
    if node.target == FUNCTION_TARGET:
        from .autograd_function import lint_call

        lint_call(graph, node, field)
        return
    if node.target == "getitem":
        source, index = node.args if len(node.args) == 2 else (None, None)
        require(
            isinstance(source, Ref)
            and is_int(index, 0)
            and not node.kwargs
            and isinstance(graph[source.name].meta, tuple)
            and index < len(graph[source.name].meta),
            f"{field}.args",
            list(node.args),
            "[an operator with several outputs, the index of one]",
        )
        return
    if node.target == COND:
        from .cond import lint_cond

        lint_cond(graph, node, field)
        return
    op = op_overload(node.target)
    require(
        op is not None,
        f"{field}.target",
        node.target,
        "a torch operator NAMESPACE.NAME.OVERLOAD (a custom one needs its library imported)",
    )
    arguments = op._schema.arguments
    positional = [a for a in arguments if not a.kwarg_only]
    given = {a.name for a in positional[: len(node.args)]} | set(node.kwargs)
    missing = [a.name for a in arguments if a.name not in given and not a.has_default_value()]
    require(
        len(node.args) <= len(positional) and not missing,
        f"{field}.args",
        list(node.args),
        f"the arguments of {node.target} ({op._schema})",
    )
    names = {a.name for a in arguments} - {a.name for a in positional[: len(node.args)]}
    for key in node.kwargs:
        require(
            is_identifier(key) and key in names,
            f"{field}.kwargs",
            key,
            f"an argument of {node.target}",
        )
    by_name = {a.name: a for a in arguments}
    for argument, value in [
        *zip(positional, node.args),
        *((by_name[key], value) for key, value in node.kwargs.items()),
    ]:
        require(
            _fits(value, argument.real_type),
            f"{field}.args",
            value,
            f"a value for {argument.name} ({argument.real_type}) of {node.target}",
        )


#: Python types of argument values, by the kind of schema type they are passed as
_SCALAR_TYPES: dict[str, tuple[type, ...]] = {
    "IntType": (int,),
    "SymIntType": (int,),
    "FloatType": (int, float),
    "NumberType": (int, float),
    "BoolType": (bool,),
    "StringType": (str,),
    "DeviceObjType": (torch.device,),
    "ScalarTypeType": (torch.dtype,),
    "LayoutType": (torch.layout,),
    "MemoryFormatType": (torch.memory_format,),
}


def _fits(value: Any, type_: Any) -> bool:
    """Whether ``value`` can be passed where an operator's schema says ``type_`` (a JIT type)."""
    kind = type_.kind()
    if kind == "OptionalType":
        return value is None or _fits(value, type_.getElementType())
    if kind == "ListType":
        element = type_.getElementType()
        return isinstance(value, list) and all(_fits(v, element) for v in value)
    if kind == "TensorType":  # a value, or a Python number torch turns into a tensor
        return isinstance(value, (Ref, int, float))
    if kind not in _SCALAR_TYPES:
        return True  # a type traced graphs do not pass; torch checks it when the code runs
    if isinstance(value, bool) and kind not in ("BoolType", "NumberType"):
        return False
    return isinstance(value, _SCALAR_TYPES[kind])


def _is_mode(entry: tuple) -> bool:
    """``("grad", enabled)`` or ``("autocast", device_type, dtype or None, enabled)``."""
    if entry[:1] == ("grad",):
        return len(entry) == 2 and isinstance(entry[1], bool)
    return (
        entry[:1] == ("autocast",)
        and len(entry) == 4
        and is_text(entry[1])
        and (entry[2] is None or isinstance(entry[2], torch.dtype))
        and isinstance(entry[3], bool)
    )


def _lint_meta(meta: Any, field: str) -> None:
    if isinstance(meta, tuple):
        for item in meta:
            require(not isinstance(item, tuple), field, item, "tensor metadata")
            _lint_meta(item, field)
    elif meta is not None:
        require(
            all(is_int(s, 0) for s in meta.shape)
            and len(meta.stride) == len(meta.shape)
            and all(is_int(s, 0) for s in meta.stride)
            and isinstance(meta.requires_grad, bool),
            field,
            _encode_meta(meta),
            "tensor metadata {shape, dtype, stride, requires_grad}",
        )


def _same_layout(meta: TensorMeta, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Strides for ``shape`` that order dimensions in memory as ``meta``'s do (broadcast
    dimensions keep stride 0)."""
    order = sorted(range(len(shape)), key=lambda d: (meta.stride[d], meta.shape[d]))
    strides, step = [0] * len(shape), 1
    for d in order:
        if meta.stride[d] != 0:
            strides[d] = step
            step *= shape[d]
    return tuple(strides)


def planned_sizes(graph: Graph) -> dict[str, int]:
    """The size of each dynamic dimension that the graph's metadata and sizes are for: its
    upper bound, or the example's size when it has none."""
    return {name: s["planned"] for name, s in graph.model.get("symbols", {}).items()}


def _lint_sizes(node: Node, planned: dict[str, int], field: str) -> None:
    """Every formula, of the value's dimensions and of the sizes among the arguments, reads
    the graph's dynamic dimensions and gives the planned size recorded beside it."""

    def gives(formula: Any, size: int) -> bool:
        try:
            return is_text(formula) and evaluate(formula, planned) == size
        except (FormulaError, ArithmeticError, TypeError):
            return False

    metas = node.meta if isinstance(node.meta, tuple) else (node.meta,)
    for meta in metas:
        if isinstance(meta, TensorMeta) and meta.sizes:
            require(
                len(meta.sizes) == len(meta.shape) and all(map(gives, meta.sizes, meta.shape)),
                f"{field}.meta.sizes",
                list(meta.sizes),
                f"one formula per dimension, giving {list(meta.shape)} for {planned}",
            )
    for size in sizes_in((node.args, node.kwargs)):
        require(
            gives(size.formula, int(size)),
            f"{field}.args",
            encode(size),
            f"a size whose formula gives it for {planned}",
        )


def _lint_units(graph: Graph, where: str) -> None:
    listed: set[str] = set()
    for unit in graph.units:
        field = f"{where}units[{unit.index}]"
        require(is_text(unit.label), f"{field}.label", unit.label, "a one-line label")
        require(bool(_list(unit.nodes, f"{field}.nodes")), f"{field}.nodes", [], "non-empty")
        for name in unit.nodes:
            require(
                isinstance(name, str)
                and name in graph.dag
                and graph[name].kind == "call"
                and graph[name].unit == unit.index
                and name not in listed,
                f"{field}.nodes",
                name,
                f"an operator of unit {unit.index}, listed once",
            )
            listed.add(name)
    unlisted = [node.name for node in graph.calls if node.name not in listed]
    require(not unlisted, f"{where}units", unlisted[:3], "a list covering every operator")
