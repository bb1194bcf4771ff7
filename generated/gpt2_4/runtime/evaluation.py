"""Held-out evaluation of a generated pipeline: forward-only pipeline passes over ``--eval-data``.

Copied into every generated pipeline as ``runtime/evaluation.py``; it needs only torch. An
evaluation runs each held-out batch through this rank's stages without gradients, in eval mode
(dropout off) and without recomputation, with the training's schedule kind run by torch's
``eval`` (its backward actions and their transfers skipped) over stages of its own, so that the
training schedule keeps its buffers. The last stage computes each microbatch's loss. The mean weights each microbatch by its *label tokens* when the
model takes ``labels`` (those not the ignore index -100, after the shift by one of a causal
language model, as Hugging Face's losses count them), equally otherwise, over every data-parallel
replica: the loss of the whole held-out set, as the original model in eval mode gives it. A
microbatch without label tokens (every label -100: a prompt masked whole) weighs nothing and is
left out (its own loss is 0 / 0); held-out batches without any are refused (there is no loss to
average). An evaluation leaves the training as it found it: every random number generator it
may draw from (torch's CPU generator, the CUDA generator of the rank's device, Python's
``random`` and numpy's global one where numpy is loaded) is saved before and restored after
(:class:`RandomStates`), and torch's are seeded for it, so that each evaluation draws the same
numbers: training with evaluations is bit for bit training without.
"""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .core.pipeline import Pipeline

__all__ = [
    "EVAL_SEED",
    "IGNORE_INDEX",
    "EvalResult",
    "LossSums",
    "RandomStates",
    "label_tokens",
    "no_label_tokens",
    "random_states_kept",
    "weighs_by_tokens",
]

#: the label of a position no loss is computed at (Hugging Face's and torch's cross entropy)
IGNORE_INDEX = -100
#: model classes whose loss shifts the labels by one (a causal language model)
CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")
#: added to a rank's seed for its evaluations' draws: a stream apart from the training's
EVAL_SEED = 1 << 40


def weighs_by_tokens(pipeline: Pipeline) -> bool:
    """Whether the pipeline's microbatch losses are means over label tokens (the model takes
    ``labels``), to be weighted by them."""
    return "labels" in [value.name for value in pipeline.data_inputs]


def label_tokens(pipeline: Pipeline, inputs: list[torch.Tensor], microbatches: int) -> torch.Tensor:
    """The label tokens of each microbatch of one pipeline run's first-stage ``inputs`` (of a
    pipeline that :func:`weighs_by_tokens`), split along the labels' batch dimension as the
    schedule splits them: what its loss is a mean over."""
    names = [value.name for value in pipeline.data_inputs]
    labels = inputs[names.index("labels")]
    batch = pipeline.batch_dim("labels")
    if pipeline.model_class.endswith(CAUSAL_SUFFIXES) and labels.dim() > 1:
        sequence = 1 if batch == 0 else 0  # shifted by one along the sequence
        labels = labels.narrow(sequence, 1, labels.shape[sequence] - 1)
    return torch.stack(
        [(part != IGNORE_INDEX).sum() for part in labels.tensor_split(microbatches, batch)]
    ).to(torch.float64)


def no_label_tokens(pipeline: Pipeline, batches: int, spec: str, done: int) -> str:
    """The refusal of an evaluation after ``done`` steps whose ``batches`` held-out batches
    (of ``--eval-data spec``) hold no label token: there is no loss to average."""
    when = f"after step {done - 1}" if done else "before training"
    shifted = pipeline.model_class.endswith(CAUSAL_SUFFIXES)
    return (
        f"evaluation {when}: the {batches} held-out batch{'es' if batches > 1 else ''} of "
        f"--eval-data {spec} hold no label tokens: every label is the ignore index "
        f"{IGNORE_INDEX}{' (after the shift by one of a causal language model)' if shifted else ''}"
        ", so there is no loss to average. Give held-out batches whose labels are not all "
        f"{IGNORE_INDEX} (a prompt may be masked, its answer not)"
    )


@dataclass(frozen=True)
class EvalResult:
    """One evaluation: the mean held-out loss and its perplexity, over ``batches`` batches;
    ``empty``: the microbatches left out, without label tokens."""

    loss: float
    batches: int
    seconds: float
    empty: int = 0

    @property
    def perplexity(self) -> float:
        if math.isnan(self.loss):
            return math.nan
        return math.exp(self.loss) if self.loss < 700 else math.inf


class LossSums:
    """The weighted sum of microbatch losses and of their weights, accumulated on this rank;
    the microbatches that weigh nothing (no label tokens) are counted apart."""

    def __init__(self) -> None:
        self.loss = 0.0
        self.weight = 0.0
        self.empty = 0  # microbatches without label tokens, left out

    def add(self, losses: list[torch.Tensor], weights: torch.Tensor | None) -> None:
        """The losses of one pipeline run's microbatches, each weighted by ``weights`` (its
        label tokens; None: each weighs 1). A microbatch of weight 0 is left out: its loss, a
        mean over no token, is NaN, and NaN times 0 is NaN."""
        for index, loss in enumerate(losses):
            weight = 1.0 if weights is None else float(weights[index])
            if weight == 0:
                self.empty += 1
                continue
            self.loss += float(loss.detach().double()) * weight
            self.weight += weight

    def reduce(self, group: Any, device: torch.device) -> None:
        """Sums over every rank of ``group`` (collective; None: this rank's alone)."""
        sums = torch.tensor(
            [self.loss, self.weight, float(self.empty)], dtype=torch.float64, device=device
        )
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(sums, group=group)
        self.loss, self.weight, self.empty = float(sums[0]), float(sums[1]), int(sums[2])

    @property
    def mean(self) -> float:
        """The weighted mean (NaN when nothing was weighed)."""
        return self.loss / self.weight if self.weight > 0 else math.nan


@dataclass(frozen=True)
class RandomStates:
    """The states of every random number generator an evaluation may draw from: torch's CPU
    generator, the CUDA generator of ``device`` (on a GPU), Python's ``random``, and numpy's
    global generator where numpy is loaded (it is never imported here)."""

    device: torch.device
    cpu: torch.Tensor
    cuda: torch.Tensor | None
    python: Any
    numpy: Any

    @classmethod
    def save(cls, device: torch.device) -> RandomStates:
        numpy = sys.modules.get("numpy")
        return cls(
            device=device,
            cpu=torch.get_rng_state(),
            cuda=torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
            python=random.getstate(),
            numpy=numpy.random.get_state() if numpy is not None else None,
        )

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)
        random.setstate(self.python)
        numpy = sys.modules.get("numpy")
        if self.numpy is not None and numpy is not None:
            numpy.random.set_state(self.numpy)


@contextmanager
def random_states_kept(device: torch.device, seed: int) -> Iterator[None]:
    """The ``with`` block draws from torch's generators (CPU, and ``device``'s on a GPU)
    seeded with ``seed``; every generator's state is as it was before it when it ends, however
    it ends."""
    saved = RandomStates.save(device)
    try:
        torch.default_generator.manual_seed(seed)
        if device.type == "cuda":
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)  # this device's alone: the others' are not saved
        yield
    finally:
        saved.restore()
