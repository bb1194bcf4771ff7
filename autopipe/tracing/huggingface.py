"""What a Hugging Face model's ``from_pretrained`` directory needs besides its weights: the
configuration (``config.json``) and generation configuration (``generation_config.json``) of a
``transformers`` ``PreTrainedModel``, recorded when it is traced (``ModelFacts.huggingface``)
so that a trained pipeline can be written out as such a directory; for a PEFT model over one,
also its adapter's ``adapter_config.json`` and the name each adapter tensor has in
``adapter_model.safetensors``, both as PEFT itself writes them. ``transformers`` is not imported
(a model is recognised by its classes), ``peft`` only for a PEFT model."""

from __future__ import annotations

import contextlib
import copy
import importlib
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "huggingface_configs",
    "is_peft_model",
    "is_pretrained_model",
    "traced_as_transformers_trains",
]

#: what ``transformers`` sets for training, by configuration attribute: the value traced with
_TRAINING_SETTINGS = {"use_cache": False}


@contextlib.contextmanager
def traced_as_transformers_trains(model: torch.nn.Module) -> Iterator[dict[str, Any]]:
    """Trace a Hugging Face model as ``transformers`` trains it: the attributes of
    ``_TRAINING_SETTINGS`` (``use_cache``: a key-value cache is generation's, and torch.export
    cannot return its ``DynamicCache``) set on every configuration the model's modules read
    (sub-configurations included) for the trace, and restored after it. Yields the settings
    it changed (empty for other models and for configurations set so already)."""
    configs: dict[int, Any] = {}
    for module in model.modules():
        if is_pretrained_model(module):
            _collect_configs(getattr(module, "config", None), configs)
    changed: list[tuple[Any, str, Any]] = []
    for config in configs.values():
        for name, value in _TRAINING_SETTINGS.items():
            current = getattr(config, name, None)
            if current is not None and current != value:
                changed.append((config, name, current))
    try:
        for config, name, _ in changed:
            setattr(config, name, _TRAINING_SETTINGS[name])
        yield {name: _TRAINING_SETTINGS[name] for _, name, _ in changed}
    finally:
        for config, name, current in changed:
            setattr(config, name, current)


def _collect_configs(config: Any, found: dict[int, Any]) -> None:
    """``config`` and the configurations it holds (a vision-language model's ``text_config``,
    an encoder-decoder's ``encoder`` and ``decoder``), each once."""
    if config is None or id(config) in found or not hasattr(config, "to_json_string"):
        return
    found[id(config)] = config
    for value in vars(config).values():
        if hasattr(value, "to_json_string") and hasattr(value, "model_type"):
            _collect_configs(value, found)


def is_pretrained_model(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a ``transformers.PreTrainedModel``."""
    return any(
        cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers.")
        for cls in type(model).__mro__
    )


def is_peft_model(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a ``peft.PeftModel`` (``get_peft_model``'s result)."""
    return any(
        cls.__name__ == "PeftModel" and cls.__module__.startswith("peft.")
        for cls in type(model).__mro__
    )


def huggingface_configs(model: torch.nn.Module) -> dict[str, Any] | None:
    """``{"config": ..., "generation_config": ...}`` as ``save_pretrained`` writes them (the
    differences from the defaults; ``architectures`` naming the model's class), the second only
    for a model that generates; for a PEFT model, its base model's and ``"adapter"``; None for
    a model that is neither a ``PreTrainedModel`` nor a PEFT model over one."""
    if is_peft_model(model):
        peft_model: Any = model
        base = peft_model.get_base_model()
        if not is_pretrained_model(base):
            return None
        configs = _pretrained_configs(base)
        configs["adapter"] = _adapter(peft_model)
        return configs
    if not is_pretrained_model(model):
        return None
    return _pretrained_configs(model)


def _pretrained_configs(model: torch.nn.Module) -> dict[str, Any]:
    pretrained: Any = model  # transformers' attributes, untyped here
    config: dict[str, Any] = json.loads(pretrained.config.to_json_string(use_diff=True))
    config["architectures"] = [type(model).__name__]
    configs = {"config": dict(sorted(config.items()))}
    generation = getattr(pretrained, "generation_config", None)
    if generation is not None and pretrained.can_generate():
        configs["generation_config"] = json.loads(generation.to_json_string(use_diff=True))
    return configs


def _adapter(model: Any) -> dict[str, Any]:
    """A PEFT model's active adapter: ``{"config": adapter_config.json's content, "weights":
    {state_dict name: name in adapter_model.safetensors}}``, each as PEFT's ``save_pretrained``
    makes it (its own config writer; its own state-dict filter, run on markers standing for the
    tensors, so that a model on the meta device works too)."""
    peft = importlib.import_module("peft")
    name = model.active_adapter
    config = copy.deepcopy(model.peft_config[name])
    # what PeftModel.save_pretrained sets before it writes the config
    base = model.get_base_model()
    if config.base_model_name_or_path is None:
        config.base_model_name_or_path = base.__dict__.get("name_or_path") or None
    config.inference_mode = True
    mapping = None
    if config.task_type is None:  # PEFT records the class to rebuild the base model with
        mapping = {"base_model_class": type(base).__name__, "parent_library": type(base).__module__}
    with tempfile.TemporaryDirectory() as tmp:
        config.save_pretrained(tmp, auto_mapping_dict=mapping)
        written = json.loads((Path(tmp) / "adapter_config.json").read_text(encoding="utf-8"))
    # PEFT writes a set (target_modules) in its process's string-hash order: sorted, the
    # package is the same whichever process compiles it
    for key, value in vars(config).items():
        if isinstance(value, set) and isinstance(written.get(key), list):
            written[key] = sorted(written[key])
    names = list(model.state_dict())
    markers = {n: torch.tensor([i]) for i, n in enumerate(names)}
    saved = peft.get_peft_model_state_dict(model, state_dict=markers, adapter_name=name)
    weights = {names[int(marker)]: key for key, marker in saved.items()}
    return {"config": written, "weights": weights}
