"""The graph IR shared by every step of the compiler.

A :class:`Graph` is the model's forward pass as a list of nodes in program order, held in a
``networkx.DiGraph`` whose edges are data dependencies. Like ``torch.fx`` the IR is small: a node
is an input, a parameter, a buffer, a constant, an operator call or the output, and it carries the
tensor metadata of the value it produces and the module scope it came from. Nodes are grouped into
*units*, the pieces a partitioner moves between stages.

The graph round-trips through JSON (``autopipe.graph`` artefact), so every later step can start
from the file ``autopipe trace`` wrote.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Iterable, Iterator

import networkx as nx
import torch

from .artifacts import artifact_text, atomic_write_text, read_artifact
from .errors import ArtifactError

GRAPH_KIND = "graph"

NodeKind = str  # "input" | "param" | "buffer" | "constant" | "call" | "output"
PLACEHOLDER_KINDS = ("input", "param", "buffer", "constant")


@dataclass(frozen=True)
class TensorMeta:
    """Shape, dtype, strides and autograd flag of one tensor value."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    stride: tuple[int, ...]
    requires_grad: bool = False

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

    @classmethod
    def of(cls, tensor: torch.Tensor, requires_grad: bool | None = None) -> TensorMeta:
        return cls(
            tuple(int(s) for s in tensor.shape),
            tensor.dtype,
            tuple(int(s) for s in tensor.stride()),
            tensor.requires_grad if requires_grad is None else requires_grad,
        )

    def to_json(self) -> dict:
        return {
            "shape": list(self.shape),
            "dtype": dtype_name(self.dtype),
            "stride": list(self.stride),
            "requires_grad": self.requires_grad,
        }

    @classmethod
    def from_json(cls, data: dict) -> TensorMeta:
        return cls(
            tuple(data["shape"]),
            dtype_from_name(data["dtype"]),
            tuple(data["stride"]),
            data["requires_grad"],
        )


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
    ):
        self.dag = nx.DiGraph()
        for node in nodes:
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
            **({"loss": self.loss.to_json()} if self.loss is not None else {}),
        }

    @classmethod
    def from_json(cls, data: dict) -> Graph:
        try:
            scopes = [tuple(Scope(*s) for s in scope) for scope in data["scopes"]]
            nodes = [
                Node(
                    name=r["name"],
                    kind=r["kind"],
                    target=r.get("target", ""),
                    args=tuple(decode(r.get("args", []))),
                    kwargs={k: decode(v) for k, v in r.get("kwargs", {}).items()},
                    meta=_decode_meta(r.get("meta")),
                    scope=scopes[r["scope"]] if "scope" in r else (),
                    context=tuple(tuple(c) for c in decode(r.get("context", []))),
                    unit=r.get("unit", -1),
                )
                for r in data["nodes"]
            ]
            params = {
                p["names"][0]: ParamInfo(
                    tuple(p["names"]),
                    tuple(p["shape"]),
                    dtype_from_name(p["dtype"]),
                    p["requires_grad"],
                    p["owner"],
                )
                for p in data["params"]
            }
            buffers = {
                b["names"][0]: BufferInfo(
                    tuple(b["names"]),
                    tuple(b["shape"]),
                    dtype_from_name(b["dtype"]),
                    b["persistent"],
                    b["owner"],
                    b.get("value"),
                )
                for b in data["buffers"]
            }
            units = [Unit(i, u["label"], u["nodes"]) for i, u in enumerate(data["units"])]
            return cls(
                nodes,
                inputs=data["inputs"],
                outputs=data["outputs"],
                signature=data["signature"],
                params=params,
                buffers=buffers,
                constants=data["constants"],
                model=data["model"],
                units=units,
                loss=cls.from_json(data["loss"]) if "loss" in data else None,
            )
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise ArtifactError(
                f"graph artefact is malformed ({exc!r}); run `autopipe trace` again"
            ) from exc

    def json_text(self) -> str:
        """The text of the graph artefact, computed once: a graph is not changed after tracing."""
        if self._json_text is None:
            self._json_text = artifact_text(GRAPH_KIND, self.to_json())
        return self._json_text

    def save(self, path) -> None:
        atomic_write_text(path, self.json_text())

    @classmethod
    def load(cls, path) -> Graph:
        return cls.from_json(read_artifact(path, GRAPH_KIND))


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
    raise UnsupportedValue(f"{type(value).__name__} value {value!r}")


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
    if tag == "dict":
        return {k: decode(v) for k, v in payload.items()}
    if tag == "dtype":
        return dtype_from_name(payload)
    if tag == "device":
        return torch.device(payload)
    if tag == "layout":
        return {v: k for k, v in _LAYOUTS.items()}[payload]
    if tag == "memory_format":
        return {v: k for k, v in _MEMORY_FORMATS.items()}[payload]
    raise ArtifactError(f"unknown encoded value {value!r}")


def iter_refs(value: Any) -> Iterator[Ref]:
    """All node references inside a (possibly nested) argument value."""
    if isinstance(value, Ref):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from iter_refs(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from iter_refs(v)


def map_refs(value: Any, fn) -> Any:
    """Rebuild an argument value with every :class:`Ref` replaced by ``fn(ref)``."""
    if isinstance(value, Ref):
        return fn(value)
    if isinstance(value, list):
        return [map_refs(v, fn) for v in value]
    if isinstance(value, tuple):
        return tuple(map_refs(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: map_refs(v, fn) for k, v in value.items()}
    return value


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
