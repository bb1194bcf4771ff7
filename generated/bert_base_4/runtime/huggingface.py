"""Trained weights as a Hugging Face model directory that ``from_pretrained`` loads as is:
``config.json`` (and ``generation_config.json``) recorded at compile time, the weights as
safetensors shards with an index, tied weights written once under the name the model keeps; a
PEFT model's as its adapter directory (``adapter_config.json``, ``adapter_model.safetensors``).

Copied into every generated pipeline as ``runtime/huggingface.py``; it needs only torch (the
safetensors files are written by ``checkpoint.py``). Used by ``train.py --save DIR --save-format
hf`` and ``autopipe merge CKPT --hf DIR``.

Nothing else is lost: autopipe deletes only the files it writes (:func:`own_file`: the names
above, ``model-0000K-of-0000N.safetensors`` shards and the shards a directory's index names),
one by one, never a tree. A destination holding anything else (a tokenizer, a README, a
checkpoint directory) is refused, with what it holds, ``--force`` or not; one holding an
earlier model directory is replaced only when asked (``replace``: ``--force``). The files are
written into a temporary directory beside the destination (``.DIR.autopipe-tmp-HOST-PID``,
removed when the write fails or is stopped, and on the next write if its process is gone),
then renamed into place: a new directory at once, an existing one file by file, its earlier
files no longer written removed last.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

import torch

from .checkpoint import save_safetensors
from .core.errors import PipelineRunError
from .core.pipeline import HuggingFaceModel, PeftAdapter

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "CONFIG",
    "INDEX",
    "MAX_SHARD_BYTES",
    "SHARD",
    "WRITTEN",
    "directory_problem",
    "file_name_problem",
    "own_file",
    "shards",
    "stale_temporaries",
    "temporary_of",
    "untied",
    "write_pretrained",
]

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: the largest safetensors shard written (bytes), as ``save_pretrained``'s default of "5GB"
MAX_SHARD_BYTES = 5 * 10**9
#: the files of a model or adapter directory autopipe writes, but for the shards
WRITTEN = frozenset({CONFIG, GENERATION_CONFIG, WEIGHTS, INDEX, ADAPTER_CONFIG, ADAPTER_WEIGHTS})
#: a shard of the weights, as autopipe (and ``save_pretrained``) names them
SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
#: the suffixes of a file's name: a model directory named so would be taken for a file
_FILE_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".ckpt", ".json", ".gguf", ".h5")
#: the temporary directory of a write, beside its destination: ``.DIR`` + this + ``HOST-PID``
_TEMPORARY = ".autopipe-tmp-"


def untied(
    state: dict[str, torch.Tensor], aliases: Sequence[Sequence[str]]
) -> dict[str, torch.Tensor]:
    """``state`` with each tied tensor under its first name only (the module that owns it, an
    input embedding, comes first in the model's ``state_dict``): ``from_pretrained`` ties the
    others to it, as it does for ``save_pretrained``'s files."""
    dropped = {name for group in aliases for name in list(group)[1:] if group[0] in state}
    return {name: tensor for name, tensor in state.items() if name not in dropped}


def shards(
    state: dict[str, torch.Tensor], max_bytes: int = MAX_SHARD_BYTES
) -> list[dict[str, torch.Tensor]]:
    """``state`` cut into shards of at most ``max_bytes`` each (a larger tensor alone), in
    order."""
    parts: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if parts[-1] and size + nbytes > max_bytes:
            parts.append({})
            size = 0
        parts[-1][name] = tensor
        size += nbytes
    return parts


def own_file(directory: Path, name: str, indexed: frozenset[str] = frozenset()) -> bool:
    """Whether ``directory / name`` is a file autopipe writes into a model directory, and so
    may delete: a regular file (not a link) of :data:`WRITTEN`, a :data:`SHARD`, or a
    ``.safetensors`` file that ``indexed`` (the names the directory's index maps tensors to)
    holds."""
    path = directory / name
    if path.is_symlink() or not path.is_file():
        return False
    return (
        name in WRITTEN
        or SHARD.fullmatch(name) is not None
        or (name in indexed and name.endswith(".safetensors"))
    )


def _indexed(directory: Path) -> frozenset[str]:
    """The shard files ``directory``'s index names (none when it has no readable index)."""
    try:
        weight_map = json.loads((directory / INDEX).read_text(encoding="utf-8"))["weight_map"]
        return frozenset(
            shard
            for shard in weight_map.values()
            if isinstance(shard, str) and Path(shard).name == shard
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return frozenset()


def _entries(directory: Path) -> tuple[list[str], list[str]]:
    """The entries of ``directory``: autopipe's own files (:func:`own_file`) and the others."""
    indexed = _indexed(directory)
    own, foreign = [], []
    for entry in sorted(directory.iterdir()):
        if own_file(directory, entry.name, indexed):
            own.append(entry.name)
        else:
            foreign.append(entry.name + ("/" if entry.is_dir() and not entry.is_symlink() else ""))
    return own, foreign


def _shown(names: list[str], limit: int = 8) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def file_name_problem(path: Path, option: str, file_option: str) -> str | None:
    """Why ``path``, named like a file (``x.safetensors``), cannot be a model directory; None
    if it can. ``file_option``: the option that writes one file instead."""
    suffix = path.suffix.lower()
    if suffix not in _FILE_SUFFIXES:
        return None
    return (
        f"{option} {path}: a Hugging Face model is a directory, and {path.name} is named like a "
        f"{suffix} file; drop the suffix (e.g. {path.with_suffix('')}), or write one file with "
        f"{file_option}"
    )


def directory_problem(
    path: Path, option: str, *, replace: bool = False, file_option: str = "another format"
) -> str | None:
    """Why ``path`` cannot receive a model directory; None if it can. It can when it does not
    exist, is empty, or holds only files autopipe writes (:func:`own_file`) and ``replace``
    (``--force``) says to replace them. Refused: a name like a file's, a file, a directory
    holding anything else (listed, ``replace`` or not: autopipe deletes nothing it did not
    write), and a model directory without ``replace``."""
    problem = file_name_problem(path, option, file_option)
    if problem:
        return problem
    if not path.exists():
        return None
    if not path.is_dir():
        return f"{option} {path} is a file; the Hugging Face format writes a directory"
    try:
        own, foreign = _entries(path)
    except OSError as exc:
        return f"{option} {path} cannot be read ({exc.strerror or exc})"
    if foreign:
        return (
            f"{option} {path} holds {len(foreign)} entr{'ies' if len(foreign) > 1 else 'y'} that "
            f"autopipe did not write: {_shown(foreign)}. A model directory is written into a new "
            "or empty directory, or over one autopipe wrote, and nothing else there is deleted "
            f"(--force or not): give another directory (e.g. {path / 'model'}), or move those "
            "entries out"
        )
    if own and not replace:
        return (
            f"{option} {path} already holds a model directory ({_shown(own)}); pass --force to "
            "replace it"
        )
    return None


def _temporary_prefix(target: Path) -> str:
    """``.DIR.autopipe-tmp-HOST-``: the start of the names of ``target``'s temporaries written
    on this host (a pid ends them)."""
    return f".{target.name}{_TEMPORARY}{re.sub(r'[^A-Za-z0-9.-]', '_', socket.gethostname())}-"


def temporary_of(target: Path) -> Path:
    """The temporary directory this process writes ``target``'s files into, beside it."""
    return target.with_name(f"{_temporary_prefix(target)}{os.getpid()}")


def _process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # another user's: alive
        return False
    return False


def stale_temporaries(target: Path) -> list[Path]:
    """The temporary directories beside ``target`` that writes of it left behind on this
    host, whose process is gone (killed before it could remove them)."""
    prefix = _temporary_prefix(target)
    found: list[Path] = []
    if not target.parent.is_dir():
        return found
    for entry in target.parent.iterdir():
        pid = entry.name[len(prefix) :] if entry.name.startswith(prefix) else ""
        if pid.isdigit() and int(pid) != os.getpid() and entry.is_dir() and _process_gone(int(pid)):
            found.append(entry)
    return sorted(found)


def _remove_own(directory: Path) -> None:
    """Delete autopipe's own files in ``directory`` (a temporary), then the directory if
    that emptied it; anything else stays."""
    if not directory.is_dir() or directory.is_symlink():
        return
    for entry in directory.iterdir():
        if own_file(directory, entry.name):
            entry.unlink(missing_ok=True)
    try:
        directory.rmdir()
    except OSError:
        pass  # it holds something autopipe did not write: left as it is


@contextmanager
def _stop_signal_interrupts() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt meanwhile (where nothing else handles it, in the main
    thread), so that a stopped write removes its temporary directory on the way out."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL
    ):
        yield
        return

    def stop(_signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt("SIGTERM")

    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def write_pretrained(
    state: dict[str, torch.Tensor],
    model: HuggingFaceModel,
    aliases: Sequence[Sequence[str]],
    directory: str | Path,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    replace: bool = False,
) -> int:
    """Write the original-model ``state`` (every name, tied ones included) as a Hugging Face
    model directory, floating-point tensors in ``dtype`` (default: as they are); for a PEFT
    model, as its adapter directory (``PeftModel.from_pretrained`` loads it over the base
    model). ``replace``: replace the files of a model directory written before (refused
    otherwise); a directory holding anything else is always refused (:func:`directory_problem`).
    Returns the number of tensors written."""
    target = Path(os.path.abspath(directory))  # `.` has a name once absolute
    problem = directory_problem(target, "the destination", replace=replace)
    if problem:
        raise PipelineRunError(problem)
    if model.adapter is not None:
        weights = _adapter_weights(state, model.adapter)
    else:
        weights = untied(state, aliases)
    if dtype is not None:
        weights = {name: t.to(dtype) if t.is_floating_point() else t for name, t in weights.items()}
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in stale_temporaries(target):  # left by a write that was killed
        _remove_own(stale)
    tmp = temporary_of(target)
    with _stop_signal_interrupts():
        _remove_own(tmp)
        tmp.mkdir()
        try:
            if model.adapter is not None:
                _write_json(tmp / ADAPTER_CONFIG, model.adapter.config)
                save_safetensors(weights, tmp / ADAPTER_WEIGHTS, metadata={"format": "pt"})
            else:
                _write_model(tmp, weights, model, max_shard_bytes)
            _move_in(tmp, target, replace)
        finally:
            _remove_own(tmp)
    return len(weights)


def _adapter_weights(
    state: dict[str, torch.Tensor], adapter: PeftAdapter
) -> dict[str, torch.Tensor]:
    """The adapter's tensors of ``state`` under their names in ``adapter_model.safetensors``."""
    missing = [name for name in adapter.weights if name not in state]
    if missing:
        raise PipelineRunError(
            f"the weights hold no {missing[0]}"
            + (f" (and {len(missing) - 1} more adapter tensors)" if len(missing) > 1 else "")
            + "; an adapter directory needs every adapter tensor"
        )
    return {saved: state[name] for name, saved in adapter.weights.items()}


def _write_model(
    directory: Path, weights: dict[str, torch.Tensor], model: HuggingFaceModel, max_bytes: int
) -> None:
    """``config.json`` (with the weights' dtype), ``generation_config.json`` and the weights,
    in one file or in shards with an index."""
    floating = [t.dtype for t in weights.values() if t.is_floating_point()]
    config = dict(model.config)
    if floating:
        config["dtype"] = str(max(set(floating), key=floating.count)).removeprefix("torch.")
    _write_json(directory / CONFIG, config)
    if model.generation_config is not None:
        _write_json(directory / GENERATION_CONFIG, model.generation_config)
    parts = shards(weights, max_bytes)
    if len(parts) == 1:
        save_safetensors(parts[0], directory / WEIGHTS, metadata={"format": "pt"})
        return
    weight_map = {}
    for number, part in enumerate(parts, 1):
        name = f"model-{number:05d}-of-{len(parts):05d}.safetensors"
        save_safetensors(part, directory / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    total = sum(t.numel() * t.element_size() for t in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(directory / INDEX, index)


def _write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _move_in(new: Path, target: Path, replace: bool) -> None:
    """The files of ``new`` (a complete model directory) renamed into ``target``: ``new``
    itself when there is no ``target``; else file by file, the weights first and
    ``config.json`` last, then ``target``'s own files no longer written removed. Checked
    again first: what came into ``target`` meanwhile is refused as well."""
    if not target.exists():  # an existing one, even empty, stays (it may be a working directory)
        os.rename(new, target)
        return
    problem = directory_problem(target, "the destination", replace=replace)
    if problem:
        raise PipelineRunError(problem)
    old, _ = _entries(target)
    order = {CONFIG: 3, GENERATION_CONFIG: 2, INDEX: 1, ADAPTER_CONFIG: 2}
    written = sorted((p.name for p in new.iterdir()), key=lambda name: (order.get(name, 0), name))
    for name in written:
        os.replace(new / name, target / name)
    for name in old:
        if name not in written:
            (target / name).unlink(missing_ok=True)
