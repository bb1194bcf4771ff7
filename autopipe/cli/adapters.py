"""A trained PEFT model's adapter merged into its base model's weights, for ``autopipe merge
CKPT --hf DIR --merge-adapters``: the base model is rebuilt on the meta device from the
configuration recorded at compile time, wrapped by PEFT with the recorded adapter
configuration, filled with the checkpoint's tensors and merged by PEFT itself
(``merge_and_unload``), so every adapter kind PEFT merges is merged as PEFT would.
``transformers`` and ``peft`` are imported only here, when it runs."""

from __future__ import annotations

import importlib
from typing import Any

import torch

from ..errors import AutopipeError
from ..runtime.core.pipeline import HuggingFaceModel

__all__ = ["BASE_PREFIX", "merged_adapter"]

#: what a PEFT model's state_dict names put before its base model's names
BASE_PREFIX = "base_model.model."


def merged_adapter(
    state: dict[str, torch.Tensor],
    model: HuggingFaceModel,
    aliases: list[list[str]],
) -> tuple[dict[str, torch.Tensor], HuggingFaceModel, list[list[str]]]:
    """The base model's state_dict with the adapter merged in, the base model's Hugging Face
    description (no adapter) and its tied-name groups, from a PEFT model's whole ``state``
    (original names, as a checkpoint merges them)."""
    adapter = model.adapter
    assert adapter is not None  # asked for a PEFT model's checkpoint only
    transformers, peft = _library("transformers"), _library("peft")
    config = dict(model.config)
    architecture = getattr(transformers, config["architectures"][0])
    with torch.device("meta"):
        base = architecture(transformers.AutoConfig.for_model(**config))
        wrapped = peft.get_peft_model(base, peft.PeftConfig.from_peft_type(**adapter.config))
    # the merge adds to the adapted layers' weights in place: those are copies, not the caller's
    state = {n: t.clone() if ".base_layer." in n else t for n, t in state.items()}
    result = wrapped.load_state_dict(state, assign=True, strict=False)
    if result.missing_keys:
        raise AutopipeError(
            f"the checkpoint holds no {result.missing_keys[0]} (and "
            f"{len(result.missing_keys) - 1} more tensors) that the PEFT model needs to merge"
        )
    merged: dict[str, torch.Tensor] = wrapped.merge_and_unload().state_dict()
    base_aliases = [
        [n.removeprefix(BASE_PREFIX) for n in group if n.startswith(BASE_PREFIX)]
        for group in aliases
    ]
    return (
        merged,
        HuggingFaceModel(model.config, model.generation_config),
        [g for g in base_aliases if len(g) > 1],
    )


def _library(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        raise AutopipeError(
            f"--merge-adapters merges with {name}, which is not installed: pip install {name}"
        ) from None
