"""Held-out evaluation of a generated pipeline: forward-only pipeline passes over ``--eval-data``.

Copied into every generated pipeline as ``runtime/evaluation.py``; it needs only torch. An
evaluation runs each held-out batch through this rank's stages without gradients, in eval mode
(dropout off) and without recomputation, with the training's schedule kind run by torch's
``eval`` (its backward actions and their transfers skipped) over stages of its own, so that the
training schedule keeps its buffers. The last stage computes each microbatch's loss. The mean weights each microbatch by its *label tokens* when the
model takes ``labels`` (those not the ignore index -100, after the shift by one of a causal
language model, as Hugging Face's losses count them), equally otherwise, over every data-parallel
replica: the loss of the whole held-out set, as the original model in eval mode gives it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .core.pipeline import Pipeline

__all__ = [
    "IGNORE_INDEX",
    "EvalResult",
    "LossSums",
    "label_tokens",
    "weighs_by_tokens",
]

#: the label of a position no loss is computed at (Hugging Face's and torch's cross entropy)
IGNORE_INDEX = -100
#: model classes whose loss shifts the labels by one (a causal language model)
CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")


def weighs_by_tokens(pipeline: Pipeline) -> bool:
    """Whether the pipeline's microbatch losses are means over label tokens (the model takes
    ``labels``), to be weighted by them."""
    return "labels" in [value.name for value in pipeline.data_inputs]


def label_tokens(pipeline: Pipeline, inputs: list[torch.Tensor], microbatches: int) -> torch.Tensor:
    """The label tokens of each microbatch of one pipeline run's first-stage ``inputs`` (of a
    pipeline that :func:`weighs_by_tokens`): what its loss is a mean over."""
    names = [value.name for value in pipeline.data_inputs]
    labels = inputs[names.index("labels")]
    if pipeline.model_class.endswith(CAUSAL_SUFFIXES) and labels.dim() > 1:
        labels = labels[:, 1:]
    return torch.stack(
        [(part != IGNORE_INDEX).sum() for part in labels.tensor_split(microbatches)]
    ).to(torch.float64)


@dataclass(frozen=True)
class EvalResult:
    """One evaluation: the mean held-out loss and its perplexity, over ``batches`` batches."""

    loss: float
    batches: int
    seconds: float

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.loss < 700 else math.inf


class LossSums:
    """The weighted sum of microbatch losses and of their weights, accumulated on this rank."""

    def __init__(self) -> None:
        self.loss = 0.0
        self.weight = 0.0

    def add(self, losses: list[torch.Tensor], weights: torch.Tensor | None) -> None:
        for index, loss in enumerate(losses):
            weight = 1.0 if weights is None else float(weights[index])
            self.loss += float(loss.detach().double()) * weight
            self.weight += weight

    def mean(self, group: Any, device: torch.device) -> float:
        """The mean over every rank of ``group`` (collective; NaN when nothing was weighed)."""
        sums = torch.tensor([self.loss, self.weight], dtype=torch.float64, device=device)
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(sums, group=group)
        return float(sums[0] / sums[1]) if float(sums[1]) > 0 else math.nan
