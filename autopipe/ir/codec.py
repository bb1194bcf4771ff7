"""The JSON codec of the graph IR's values: node arguments, tensor metadata and tensor literals.

Node arguments are Python values with :class:`~autopipe.ir.types.Ref` for node references. In
JSON, plain ints, bools, strings, None and lists stay as they are; everything else is a one-key
object (``{"ref": "x"}``, ``{"dtype": "float32"}``, ``{"size": [128, "seq"]}``, ...). A value type
defined above this module (a branch graph of ``torch.cond``) registers its tag with
:func:`register_value_codec`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from ..checks import is_int, is_text
from ..errors import ArtifactError
from .types import Ref, Size, TensorMeta, dtype_from_name, dtype_name

__all__ = [
    "UnsupportedValue",
    "ValueCodec",
    "decode",
    "decode_meta",
    "decode_tensor",
    "encode",
    "encode_args",
    "encode_meta",
    "encode_tensor",
    "register_value_codec",
]

_LAYOUTS = {torch.strided: "strided", torch.sparse_coo: "sparse_coo"}
_MEMORY_FORMATS = {
    torch.contiguous_format: "contiguous_format",
    torch.channels_last: "channels_last",
    torch.channels_last_3d: "channels_last_3d",
    torch.preserve_format: "preserve_format",
}


class UnsupportedValue(TypeError):
    """An argument value the IR cannot represent."""


@dataclass(frozen=True)
class ValueCodec:
    """How argument values of one ``type`` defined above the codec go to JSON: as
    ``{tag: encode(value)}``, read back with ``decode(payload)``."""

    tag: str
    type: type
    encode: Callable[[Any], Any]
    decode: Callable[[Any], Any]


_VALUE_CODECS: dict[str, ValueCodec] = {}


def register_value_codec(codec: ValueCodec) -> None:
    """Let :func:`encode` and :func:`decode` handle ``codec.type`` values, under ``codec.tag``."""
    if codec.tag in _VALUE_CODECS:
        raise ValueError(f"a value codec for the tag {codec.tag!r} is registered already")
    _VALUE_CODECS[codec.tag] = codec


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
    for codec in _VALUE_CODECS.values():  # a branch of torch.cond
        if isinstance(value, codec.type):
            return {codec.tag: codec.encode(value)}
    raise UnsupportedValue(f"{type(value).__name__} value {value!r}")


def encode_args(value: Any, names: dict[Any, Any]) -> Any:
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
    if tag in _VALUE_CODECS:  # a branch of torch.cond, checked as a graph of its own
        return _VALUE_CODECS[tag].decode(payload)
    raise ArtifactError(f"unknown encoded value {value!r}")


def encode_meta(meta: Any) -> Any:
    """A node's metadata (:class:`TensorMeta`, a tuple of them, or None) as JSON data."""
    if isinstance(meta, TensorMeta):
        return meta.to_json()
    if isinstance(meta, tuple):
        return {"tuple": [encode_meta(m) for m in meta]}
    return None


def decode_meta(data: Any) -> Any:
    """Inverse of :func:`encode_meta`."""
    if data is None:
        return None
    if "tuple" in data:
        return tuple(decode_meta(m) for m in data["tuple"])
    return TensorMeta.from_json(data)


# -- tensor literals --------------------------------------------------------------------------
def encode_tensor(tensor: torch.Tensor) -> dict[str, Any]:
    """A tensor's value as JSON data (used for small constants and non-persistent buffers)."""
    flat = tensor.detach().cpu().reshape(-1)
    data: list[Any]
    if tensor.dtype.is_floating_point:
        data = [encode(float(v)) for v in flat.double().tolist()]
    else:
        data = flat.tolist()
    return {"shape": list(tensor.shape), "dtype": dtype_name(tensor.dtype), "data": data}


def decode_tensor(data: dict[str, Any], device: torch.device | str = "cpu") -> torch.Tensor:
    values = [decode(v) for v in data["data"]]
    dtype_ = dtype_from_name(data["dtype"])
    return torch.tensor(values, dtype=dtype_, device=device).reshape(data["shape"])
