"""The sizes of a pipeline's dynamic dimensions in a batch, checked against the contract.

Copied into every generated pipeline as ``runtime/core/dimensions.py``; it needs only torch. Both
train.py (each step's batch) and ``autopipe verify`` (the example) read sizes through it.
"""

from __future__ import annotations

import torch

from .errors import PipelineRunError
from .pipeline import Pipeline

__all__ = ["dimension_sizes"]


def dimension_sizes(
    pipeline: Pipeline, given: dict[str, torch.Tensor], rows: int, where: str
) -> dict[str, int] | None:
    """The sizes of ``pipeline``'s dynamic dimensions in the inputs ``given`` (by name), which
    hold ``rows`` microbatches along their batch dimensions, checked to agree and to lie within their
    bounds; None for a static pipeline."""
    if not pipeline.dimensions:
        return None
    sizes: dict[str, int] = {}
    for dimension in pipeline.dimensions.values():
        found = []
        for name, index in dimension.sources:
            tensor = given.get(name)
            if tensor is None or tensor.dim() <= index:
                continue  # an input the pipeline does not read; or checked with its shape
            size = tensor.shape[index]
            if index == pipeline.batch_dim(name):
                if size % rows:
                    raise PipelineRunError(
                        f"{where}: input {name!r} has {size} samples (dimension {index}), which "
                        f"do not split into "
                        f"{rows} equal microbatches (--microbatches x --accumulate x --dp x "
                        "--dp-shard); give a multiple of that many samples"
                    )
                size //= rows
            found.append((f"{name}:{index}", size))
        if not found:
            raise PipelineRunError(
                f"{where}: no input sizes the dynamic dimension {dimension.name!r} (its inputs: "
                f"{', '.join(f'{n}:{i}' for n, i in dimension.sources)})"
            )
        if len({size for _, size in found}) > 1:
            shown = ", ".join(f"{source} is {size}" for source, size in found)
            raise PipelineRunError(
                f"{where}: the sizes of the dynamic dimension {dimension.name!r} differ "
                f"({shown}); the inputs it sizes must agree"
            )
        size = found[0][1]
        if not dimension.holds(size):
            raise PipelineRunError(
                f"{where}: dimension {dimension.name!r} is {size}, outside the bounds "
                f"{dimension.bounds} the pipeline was compiled for; pad or cut "
                f"the batch into them, or compile again with --dynamic "
                f"{dimension.name}[MIN:MAX]=... bounds that hold it"
            )
        sizes[dimension.name] = size
    return sizes
