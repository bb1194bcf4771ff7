"""Read checkpoints without running code: original-model checkpoints one tensor at a time,
without loading the whole file, and the metadata of training checkpoints (DCP) through an
unpickler that builds only the classes DCP's metadata holds.

Copied into every generated pipeline as ``runtime/checkpoint.py``; it needs only torch. Formats:

- a ``torch.save`` file (zip format): opened with ``mmap=True``, so only the tensors read are paged in;
- a ``.safetensors`` file: its JSON header is parsed here and each tensor is a view of the mapped
  file, so the ``safetensors`` package is not needed;
- a Hugging Face style directory: ``*.index.json`` (a ``weight_map`` from names to shard files) with
  ``.safetensors`` or ``torch.save`` shards, or a single ``model.safetensors`` /
  ``pytorch_model.bin``. Shards are opened only when one of their tensors is read.

A training checkpoint written with ``torch.distributed.checkpoint`` keeps its metadata
(``.metadata``) as a pickle, which DCP's own reader unpickles as it is: a crafted file would run
code. :class:`SafeFileSystemReader` reads it with :func:`read_dcp_metadata` instead, which builds
only DCP's metadata classes, torch sizes, dtypes and layouts, and refuses anything else naming the
file and the class; :class:`SafeLoadPlanner` reads a checkpoint's non-tensor entries (none in
autopipe's own, but a crafted file may declare some) with ``torch.load(weights_only=True)``,
where DCP's planner unpickles them unrestricted. Tensors are read with ``weights_only=True``
everywhere.
"""

from __future__ import annotations

import ctypes
import io
import json
import mmap
import pickle
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from .core.errors import first_line

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "METADATA_CLASSES",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "SafetensorsFile",
    "TorchFile",
    "read_dcp_metadata",
    "save_safetensors",
]

_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be read, named with what is wrong."""


class SafetensorsFile:
    """Tensors of one ``.safetensors`` file, each a zero-copy view of the memory-mapped file."""

    def __init__(self, path: Path):
        self.path = path
        try:
            with open(path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # lazy, private
            (length,) = struct.unpack("<Q", self._map[:8])
            header = json.loads(self._map[8 : 8 + length])
            if not isinstance(header, dict):
                raise ValueError("its header is not a JSON object")
        except (OSError, struct.error, ValueError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path} is not a safetensors file ({exc})") from None
        header.pop("__metadata__", None)
        self._start = 8 + length
        size = len(self._map) - self._start
        for name, entry in header.items():
            try:
                begin, end = entry["data_offsets"]
                ok = 0 <= begin <= end <= size and isinstance(entry["shape"], list)
            except (KeyError, TypeError, ValueError):
                ok = False
            if not ok:
                raise CheckpointError(
                    f"{path}: the entry of tensor {name} points past the end of the file "
                    f"({size} data bytes) or is malformed: the file is truncated or corrupted"
                )
        self._entries = header

    def keys(self) -> list[str]:
        return list(self._entries)

    def __getitem__(self, name: str) -> torch.Tensor:
        entry = self._entries[name]
        begin, end = entry["data_offsets"]
        dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise CheckpointError(
                f"{self.path}: tensor {name} has unsupported dtype {entry['dtype']}"
            )
        count = (end - begin) // dtype.itemsize
        if count == 0:
            return torch.empty(entry["shape"], dtype=dtype)
        flat = torch.frombuffer(self._map, dtype=dtype, count=count, offset=self._start + begin)
        return flat.reshape(entry["shape"])


class TorchFile:
    """Tensors of one ``torch.save`` file (state_dict), memory-mapped when the format allows."""

    _state: dict[str, torch.Tensor]  # torch.load's result, checked to be a dict below

    def __init__(self, path: Path):
        try:
            try:
                self._state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            except RuntimeError:  # an old (non-zip) file cannot be mapped
                self._state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any failure to unpickle is a bad file
            first = str(exc).strip().splitlines()[0].split(". ")[0] if str(exc).strip() else ""
            raise CheckpointError(
                f"{path} is not a readable torch.save checkpoint ({type(exc).__name__}: "
                f"{first[:160]}); it may be truncated or corrupted"
            ) from None
        if not isinstance(self._state, dict):
            raise CheckpointError(
                f"{path} does not hold a state_dict (found {type(self._state).__name__})"
            )

    def keys(self) -> list[str]:
        return list(self._state)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._state[name]


def _weight_map(index: Path) -> dict[str, Path]:
    """Tensor name -> shard file of a Hugging Face ``*.index.json``; shards stay in its folder."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index} is not a checkpoint index ({exc})") from None
    where = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or Path(shard).name != shard:
            raise CheckpointError(
                f"{index}: tensor {name} is said to be in {shard!r}, which is not a file of "
                f"{index.parent}; shards must lie beside the index"
            )
        where[name] = index.parent / shard
    return where


def _open_file(path: Path) -> SafetensorsFile | TorchFile:
    return SafetensorsFile(path) if path.suffix == ".safetensors" else TorchFile(path)


class Checkpoint:
    """Name -> tensor access to a checkpoint file or directory; tensors are read on demand."""

    def __init__(self, path: str | Path):
        path = Path(path)
        self.path = path
        self._files: dict[Path, SafetensorsFile | TorchFile] = {}
        if path.is_dir():
            indexes = sorted(path.glob("*.index.json"))
            if indexes:
                self._where = _weight_map(indexes[0])
            else:
                singles = [
                    p
                    for p in (path / "model.safetensors", path / "pytorch_model.bin")
                    if p.is_file()
                ]
                if not singles:
                    raise CheckpointError(
                        f"{path} has no *.index.json, model.safetensors or pytorch_model.bin"
                    )
                self._where = {name: singles[0] for name in self._file(singles[0]).keys()}
        elif path.is_file():
            self._where = {name: path for name in self._file(path).keys()}
        else:
            raise CheckpointError(f"{path} does not exist")

    def _file(self, path: Path) -> SafetensorsFile | TorchFile:
        if path not in self._files:
            if not path.is_file():
                raise CheckpointError(f"checkpoint shard {path} does not exist")
            self._files[path] = _open_file(path)
        return self._files[path]

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._file(self._where[name])[name]


def save_safetensors(
    state: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None
) -> None:
    """Write ``state`` as a ``.safetensors`` file (tensors contiguous, 8-byte aligned header),
    one tensor at a time; ``metadata``: the header's ``__metadata__`` (Hugging Face reads
    ``{"format": "pt"}``)."""
    names = {dtype: code for code, dtype in _SAFETENSORS_DTYPES.items()}
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, tensor in state.items():
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": names[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for tensor in state.values():
            flat = tensor.detach().cpu().contiguous()
            if flat.numel():
                f.write(ctypes.string_at(flat.data_ptr(), flat.numel() * flat.element_size()))


# -- DCP's metadata, read without running code ------------------------------------------------
#: what DCP's ``.metadata`` pickle may name, by module: its metadata classes (torch 2.13 pickles
#: exactly these), ``torch.Size``, the layout and memory format as DCP encodes them, the paths it
#: records, and the builtin collections; ``torch``'s dtypes, layouts and memory formats by name too
METADATA_CLASSES: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}),
    "builtins": frozenset({"set", "frozenset"}),
    "collections": frozenset({"OrderedDict"}),
}


def _allowed(module: str, name: str) -> bool:
    if name in METADATA_CLASSES.get(module, frozenset()):
        return True
    return module == "torch" and isinstance(
        getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
    )


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only what :data:`METADATA_CLASSES` allows; refuses any other global, naming the
    file and the class, before it is imported or called."""

    def __init__(self, file: IO[bytes], path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if not _allowed(module, name):
            raise CheckpointError(
                f"{self.path} names {module}.{name}, which the metadata of a checkpoint never "
                "holds; it was not loaded (unpickling it would run code). The file was not "
                "written by torch.distributed.checkpoint, or was altered: use a checkpoint "
                "you trust, or write it again"
            )
        return super().find_class(module, name)


def read_dcp_metadata(path: str | Path) -> Metadata:
    """DCP's metadata of a training checkpoint (its ``.metadata`` file), read without running
    code: CheckpointError naming the file (and the class) for anything but DCP's metadata."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f, path).load()
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except Exception as exc:  # noqa: BLE001 - unpickling a damaged file raises anything
        raise CheckpointError(
            f"{path} is not the metadata of a checkpoint ({type(exc).__name__}: "
            f"{str(exc)[:160]}); it is damaged"
        ) from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointError(
            f"{path} holds a {type(metadata).__name__}, not the metadata of a checkpoint"
        )
    for info in (metadata.storage_data or {}).values():
        where = getattr(info, "relative_path", None)
        if not isinstance(where, str) or Path(where).name != where:
            raise CheckpointError(
                f"{path} places a tensor in {where!r}, which is not a file beside it; the "
                "metadata is damaged or altered"
            )
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's reader of a checkpoint directory, its metadata read by :func:`read_dcp_metadata`
    (DCP's own unpickles it unrestricted)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        metadata = read_dcp_metadata(Path(self.path) / name)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None  # set just above
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, reading a checkpoint's non-tensor entries with
    ``torch.load(weights_only=True)`` (DCP's unpickles them unrestricted)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except Exception as exc:  # noqa: BLE001 - the weights-only unpickler refuses anything
            lines = [line.strip() for line in str(exc).splitlines()]
            why = next((line for line in lines if "Unsupported global" in line), first_line(exc))
            raise CheckpointError(
                f"the checkpoint's entry {read_item.dest_index.fqn} holds more than plain values "
                f"({why[:200]}); it was not loaded (unpickling it would run code)"
            ) from None
        plain = io.BytesIO()
        torch.save(loaded, plain)  # what DCP reads back holds only what was checked
        plain.seek(0)
        super().load_bytes(read_item, plain)
