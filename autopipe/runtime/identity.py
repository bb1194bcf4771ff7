"""Which model a checkpoint holds, compared with the model a pipeline trains.

Copied into every generated pipeline as ``runtime/identity.py``; it needs only torch. A
pipeline's :class:`~.core.pipeline.ModelIdentity` (``pipeline.json``'s ``identity``) lists every
tensor of the original model's ``state_dict`` with its shape and dtype, and a digest of the
traced model. Training checkpoints record it in their manifest; checkpoints written before they
did are read through the tensors DCP's metadata lists. Tied tensors are compared under their
first name, whichever of their names a checkpoint holds them under.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .core.pipeline import ModelIdentity

__all__ = [
    "identity_difference",
    "identity_from_tensors",
    "identity_of_manifest",
    "tensors_difference",
]


def _canonical(aliases: Sequence[Sequence[str]]) -> dict[str, str]:
    """Each tied tensor's names -> its first name."""
    return {name: group[0] for group in aliases for name in group}


def identity_from_tensors(
    tensors: Mapping[str, tuple[Sequence[int], torch.dtype]], aliases: Sequence[Sequence[str]]
) -> ModelIdentity:
    """The identity, without a digest, of a checkpoint known only by its tensors (name ->
    (shape, dtype)), tied names folded into their first."""
    first = _canonical(aliases)
    entries = {
        first.get(name, name): (tuple(shape), str(dtype).removeprefix("torch."))
        for name, (shape, dtype) in tensors.items()
    }
    return ModelIdentity("", entries)


def _shown(entry: tuple[tuple[int, ...], str]) -> str:
    return f"{entry[1]} {list(entry[0])}"


def tensors_difference(
    ours: Mapping[str, tuple[tuple[int, ...], str]],
    theirs: Mapping[str, tuple[tuple[int, ...], str]],
    *,
    partial: bool = False,
) -> str | None:
    """How ``theirs`` (a checkpoint's tensors) differs from ``ours`` (this model's), in words
    naming the first tensor missing on either side or held with another shape or dtype; None
    when they hold the same tensors. With ``partial``, tensors only ``theirs`` holds are left
    out rather than a difference."""
    missing = [name for name in ours if name not in theirs]
    extra = [] if partial else [name for name in theirs if name not in ours]
    changed = [name for name in ours if name in theirs and ours[name] != theirs[name]]
    parts = []
    if missing:
        more = f" and {len(missing) - 1} more of this model's" if len(missing) > 1 else ""
        parts.append(f"it has no {missing[0]}{more}")
    if extra:
        more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
        parts.append(f"it holds {extra[0]}{more}, which this model has not")
    if changed:
        name = changed[0]
        more = f" ({len(changed) - 1} more differ)" if len(changed) > 1 else ""
        parts.append(
            f"it holds {name} as {_shown(theirs[name])}, this model as {_shown(ours[name])}{more}"
        )
    return "; ".join(parts) or None


def identity_difference(ours: ModelIdentity, theirs: ModelIdentity) -> str | None:
    """How the model of a checkpoint (``theirs``) differs from this pipeline's (``ours``), or
    None when it is the same model. A checkpoint without a digest (written before checkpoints
    recorded one) is compared by its tensors alone."""
    if ours.digest and theirs.digest == ours.digest:
        return None
    difference = tensors_difference(ours.tensors, theirs.tensors)
    if difference is None and ours.digest and theirs.digest:
        difference = (
            f"its tensors are this model's, but its traced model is not (digest {theirs.digest}, "
            f"this model's {ours.digest}): the model's classes or module tree changed"
        )
    return difference


def identity_of_manifest(manifest: Mapping[str, Any]) -> ModelIdentity | None:
    """The identity a checkpoint manifest records (None for a checkpoint written before)."""
    data = manifest.get("identity")
    return None if data is None else ModelIdentity.from_json(data, "checkpoint.json identity")
