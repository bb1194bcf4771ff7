"""Trained weights as a Hugging Face model directory that ``from_pretrained`` loads as is:
``config.json`` (and ``generation_config.json``) recorded at compile time, the weights as
safetensors shards with an index, tied weights written once under the name the model keeps; a
PEFT model's as its adapter directory (``adapter_config.json``, ``adapter_model.safetensors``).

Copied into every generated pipeline as ``runtime/huggingface.py``; it needs only torch (the
safetensors files are written by ``checkpoint.py``). Used by ``train.py --save DIR --save-format
hf`` and ``autopipe merge CKPT --hf DIR``. A directory is written beside its destination and
renamed into place: an interrupted write leaves the destination as it was.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

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
    "directory_problem",
    "shards",
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


def directory_problem(path: Path, option: str) -> str | None:
    """Why ``path`` cannot receive a model directory: it is a file, or a directory holding
    something else than a model or adapter directory written before (which is replaced); None
    if it can."""
    if not path.exists():
        return None
    if not path.is_dir():
        return f"{option} {path} is a file; the Hugging Face format writes a directory"
    if any(path.iterdir()) and not any(
        (path / name).is_file() for name in (CONFIG, ADAPTER_CONFIG)
    ):
        return (
            f"{option} {path} is a directory holding other files than a Hugging Face model; "
            "give a new or empty directory"
        )
    return None


def write_pretrained(
    state: dict[str, torch.Tensor],
    model: HuggingFaceModel,
    aliases: Sequence[Sequence[str]],
    directory: str | Path,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> int:
    """Write the original-model ``state`` (every name, tied ones included) as a Hugging Face
    model directory, floating-point tensors in ``dtype`` (default: as they are); for a PEFT
    model, as its adapter directory (``PeftModel.from_pretrained`` loads it over the base
    model). Replaces a model directory written before. Returns the number of tensors written."""
    target = Path(directory)
    problem = directory_problem(target, "the destination")
    if problem:
        raise PipelineRunError(problem)
    if model.adapter is not None:
        weights = _adapter_weights(state, model.adapter)
    else:
        weights = untied(state, aliases)
    if dtype is not None:
        weights = {name: t.to(dtype) if t.is_floating_point() else t for name, t in weights.items()}
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        if model.adapter is not None:
            _write_json(tmp / ADAPTER_CONFIG, model.adapter.config)
            save_safetensors(weights, tmp / ADAPTER_WEIGHTS, metadata={"format": "pt"})
        else:
            _write_model(tmp, weights, model, max_shard_bytes)
        _replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
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


def _replace(new: Path, target: Path) -> None:
    """``new`` renamed to ``target``; a directory already there is moved aside first and
    removed after."""
    old = target.with_name(f".{target.name}.old{os.getpid()}")
    if target.exists():
        os.replace(target, old)
    os.replace(new, target)
    shutil.rmtree(old, ignore_errors=True)
