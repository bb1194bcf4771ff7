"""Training data of a generated pipeline: each step's whole batch, cut into the parts each
pipeline run of each data-parallel replica takes.

Copied into every generated pipeline as ``runtime/data.py``; it needs only torch. A step's batch
holds ``accumulate x dp x microbatches`` example microbatches along each input's batch dimension
(dimension 0 unless the pipeline records another, :meth:`Pipeline.batch_dim`; a loss's target: 0),
in that order: accumulation round, replica, microbatch. The batch of a step depends only on the step number (and
the seed), so a resumed run reads exactly what an uninterrupted one would. Batches come from a
``--data`` function, a Dataset factory, a dataset on disk (``corpus.py``: read, tokenized and
packed on the ranks that read batches), or are synthetic.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
from collections.abc import Callable, Sized
from pathlib import Path
from typing import Any, Protocol

import torch

from .core.dimensions import dimension_sizes
from .core.errors import PipelineRunError, UserCodeError, first_line
from .core.fixed_inputs import check_fixed_inputs
from .core.pipeline import Pipeline, Value
from .corpus import CORPUS_SUFFIXES, Corpus, is_corpus
from .options import TrainConfig

#: apart from the seeds of the ranks' own random numbers (driver.py)
_DATA_SEED = 7_777_777


class MapDataset(Protocol):
    """What a ``--data`` Dataset factory's dataset must offer: its size and its items by index."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


def load_function(spec: str, option: str = "--data") -> Callable[..., Any]:
    """Import ``FILE.py:FN`` or ``package.module:FN``."""
    location, _, name = spec.rpartition(":")
    if not location or not name:
        raise PipelineRunError(
            f"{option} {spec!r} must have the form FILE.py:FN or package.module:FN"
        )
    if location.endswith(".py"):
        path = Path(location).resolve()
        if not path.is_file():
            raise PipelineRunError(f"{option}: file {location} does not exist")
        module_spec = importlib.util.spec_from_file_location(f"_autopipe_data_{path.stem}", path)
        assert module_spec is not None and module_spec.loader is not None  # a .py file has both
        module = importlib.util.module_from_spec(module_spec)
        sys.path.insert(0, str(path.parent))
        try:
            module_spec.loader.exec_module(module)
        except Exception as exc:  # noqa: BLE001 - the user's module failed to import
            raise UserCodeError(option, spec, exc) from exc
        finally:
            sys.path.remove(str(path.parent))
    else:
        module = importlib.import_module(location)
    fn: object = getattr(module, name, None)
    if not callable(fn):
        raise PipelineRunError(f"{option}: {location} has no function {name!r}")
    return fn


def _takes_no_arguments(fn: Callable[..., Any]) -> bool:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return all(
        p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters
    )


class Batches:
    """The whole batch of each step: from ``--data`` (a step function, a Dataset factory or a
    dataset on disk) or synthetic, checked against the pipeline's inputs."""

    def __init__(self, pipeline: Pipeline, config: TrainConfig, held_out: bool = False):
        """``held_out``: the batches of ``--eval-data`` (by index) instead of ``--data``'s."""
        self.pipeline = pipeline
        self.microbatches = config.microbatches
        self.parts = config.accumulate * config.data_parallel  # pipeline runs per step, all ranks
        self.seed = config.seed
        self.pad_to_multiple = config.pad_to_multiple
        self.fn: Callable[..., Any] | None = None
        self.dataset: MapDataset | None = None
        self.corpus: Corpus | None = None
        self.option = "--eval-data" if held_out else "--data"
        spec = config.eval_data if held_out else config.data
        self.spec = spec or ""
        given = [s for s in (config.data, config.eval_data) if s]
        if config.tokenizer and not held_out and not any(map(is_corpus, given)):
            raise PipelineRunError(
                f"--tokenizer {config.tokenizer} tokenizes a dataset file given to --data or "
                f"--eval-data ({', '.join(CORPUS_SUFFIXES)} or a save_to_disk directory), and "
                "neither is one",
                every_rank=True,
            )
        if spec and is_corpus(spec):
            self.corpus = Corpus(
                pipeline,
                spec,
                config.tokenizer,
                self.samples,
                self.seed,
                held_out,
                self.option,
                config.eval_split if held_out else None,
                self.fewest_samples,
            )
        elif held_out and config.eval_split is not None:
            raise PipelineRunError(
                f"--eval-split {config.eval_split} chooses a split of a dataset saved with "
                f"save_to_disk, and --eval-data {spec} is a function: leave --eval-split out",
                every_rank=True,
            )
        elif spec:
            fn = load_function(spec, self.option)
            if _takes_no_arguments(fn):
                try:
                    self.dataset = fn()
                except Exception as exc:  # noqa: BLE001 - named as the user's code failing
                    raise UserCodeError(self.option, spec, exc) from exc
                if not isinstance(self.dataset, torch.utils.data.Dataset):
                    raise PipelineRunError(
                        f"{self.option} {spec}: a function without arguments must return a "
                        f"torch.utils.data.Dataset, got {type(self.dataset).__name__}",
                        every_rank=True,
                    )
                if not isinstance(self.dataset, Sized):
                    raise PipelineRunError(
                        f"{self.option} {spec}: its {type(self.dataset).__name__} has no length; "
                        "give a map-style Dataset (__getitem__ and __len__), whose samples each "
                        "step draws from a seeded permutation, or FN(index) returning a step's "
                        "batch",
                        every_rank=True,
                    )
                size = len(self.dataset)
                if not held_out and 0 < size < self.samples:  # held out: coverage() says it
                    raise PipelineRunError(
                        f"{self.option} {spec}: its dataset holds {size} samples, fewer than a "
                        f"step's batch of {self.samples} (--microbatches x --accumulate x --dp x "
                        "--dp-shard x the example's samples): each step would read some twice; "
                        "give more samples"
                        + (", or fewer --microbatches" if size >= self.fewest_samples else ""),
                        every_rank=True,
                    )
            else:
                self.fn = fn

    @property
    def prepares(self) -> bool:
        """Whether the batches come from a dataset file, read and tokenized by :meth:`prepare`."""
        return self.corpus is not None

    def prepare(self) -> None:
        """Read, tokenize and arrange a dataset file's rows, before the first batch asks for
        them (nothing for other batches)."""
        if self.corpus is not None:
            self.corpus.prepare()

    def coverage(self, count: int) -> str | None:
        """What ``count`` batches (an evaluation's, by index 0 ... count - 1) read of a
        dataset whose size is known, in words, where they read some of its samples more than
        once; None where they read each at most once (or the size is not known: a function's
        batches). For a dataset file, once prepared."""
        if self.dataset is not None:
            size, samples = len(self.dataset), self.samples
            read = count * samples
            if size == 0 or read <= size:
                return None
            fits = size // samples
            fix = (
                f"give --eval-batches {fits} to read each sample once"
                if fits
                else f"give a held-out dataset of at least {samples} samples (a batch's)"
            )
            return (
                f"{self.option} {self.spec}: its dataset holds {size} samples, and "
                f"{count} held-out batch{'es' if count > 1 else ''} of {samples} samples read "
                f"{read}: the held-out loss counts each sample about {read / size:.3g} times; "
                f"{fix}"
            )
        if self.corpus is not None and self.corpus.documents is not None:
            epoch = self.corpus.batches_per_epoch
            if count <= epoch:
                return None
            return (
                f"{self.corpus.where}: it gives {epoch} held-out batch{'es' if epoch > 1 else ''}, "
                f"and --eval-batches {count} reads {count - epoch} of them again (the "
                f"held-out loss counts them twice or more); give --eval-batches {epoch} to read "
                "each once"
            )
        return None

    @property
    def rows(self) -> int:
        """Example microbatches in a step's batch."""
        return self.parts * self.microbatches

    @property
    def fewest_samples(self) -> int:
        """Samples in a step's batch of one microbatch (what fewer --microbatches come down to:
        the accumulation rounds and data-parallel ranks stay)."""
        return self.parts * self.pipeline.samples_per_microbatch

    @property
    def samples(self) -> int:
        """Samples in a step's batch: its microbatches times the example microbatch's size."""
        return self.rows * self.pipeline.samples_per_microbatch

    def __call__(self, step: int) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """``(the first stage's inputs, target or None)`` of the whole step."""
        if self.corpus is not None:
            return self._inputs(self.corpus(step), step, None)
        if self.dataset is not None:
            return self._from_dataset(step)
        if self.fn is None:
            return self._synthetic(step)
        try:
            # every rank that reads the step's batch gets the same one, and a resumed run the
            # one it had, also from a function drawing from torch's global generator (whose
            # state differs between ranks and with the training's random numbers)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed * 1_000_003 + step + _DATA_SEED)
                result = self.fn(step)
        except Exception as exc:  # noqa: BLE001 - named as the user's code failing
            raise UserCodeError(self.option, self.spec, exc, step) from exc
        if not isinstance(result, (tuple, list)) or len(result) not in (2, 3):
            raise PipelineRunError(
                f"{self.option} function returned {type(result).__name__}; expected (args, kwargs) "
                "or (args, kwargs, target)"
            )
        args, kwargs, *rest = result
        args = (args,) if isinstance(args, torch.Tensor) else tuple(args)
        return self._inputs(self._bind(args, dict(kwargs or {})), step, rest[0] if rest else None)

    def part(
        self, batch: tuple[list[torch.Tensor], torch.Tensor | None], index: int
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Pipeline run ``index`` (accumulation round x dp + replica) of a step's batch."""
        inputs, target = batch
        dims = [self.pipeline.batch_dim(value.name) for value in self.pipeline.data_inputs]
        parts = [t.chunk(self.parts, dim)[index] for t, dim in zip(inputs, dims)]
        return parts, (target.chunk(self.parts)[index] if target is not None else None)

    def dimensions(self, inputs: list[torch.Tensor], step: int) -> dict[str, int] | None:
        """The sizes of the pipeline's dynamic dimensions in a step's first-stage ``inputs``
        (per microbatch), checked against their bounds; None for a static pipeline."""
        given = {value.name: t for value, t in zip(self.pipeline.data_inputs, inputs)}
        return dimension_sizes(self.pipeline, given, self.rows, f"step {step}")

    def _inputs(
        self, bound: dict[str, Any], step: int, target: Any
    ) -> tuple[list[torch.Tensor], Any]:
        try:
            check_fixed_inputs(self.pipeline.fixed_inputs, bound, f"step {step}")
        except PipelineRunError as exc:
            if self.corpus is None:
                raise
            raise PipelineRunError(
                f"{exc} ({self.option} {self.spec}: a dataset file's batches pass its token "
                f"inputs alone; give {self.option} FILE.py:FN, a function whose batches pass the "
                "others)"
            ) from None
        inputs = []
        for value in self.pipeline.data_inputs:
            if not isinstance(bound.get(value.name), torch.Tensor):
                raise PipelineRunError(
                    f"{self.option} batch of step {step} has no tensor for input {value.name!r}"
                )
            inputs.append(bound[value.name])
        if self.pad_to_multiple > 1:
            inputs = self._padded(inputs)
        sizes = self.dimensions(inputs, step)
        inputs = [
            self._check(t, v, self.pipeline.batch_dim(v.name), sizes, step)
            for t, v in zip(inputs, self.pipeline.data_inputs)
        ]
        loss = self.pipeline.loss
        if loss.needs_target:
            if not isinstance(target, torch.Tensor):
                raise PipelineRunError(
                    f"this pipeline's loss needs a target: the {self.option} function must return "
                    "(args, kwargs, target), or the dataset's items a 'target' entry"
                )
            assert loss.target is not None  # a loss that needs a target describes it
            target = self._check(target, loss.target, 0, sizes, step)
        return inputs, target

    def _padded(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """``inputs`` with each dynamic dimension but the batch's padded at its end up to a
        multiple of --pad-to-multiple (at most its upper bound, if any): labels with the ignore index
        -100, other inputs (ids, attention masks) with 0. Sizes the bounds refuse are left."""
        names = [value.name for value in self.pipeline.data_inputs]
        inputs = list(inputs)
        for dimension in self.pipeline.dimensions.values():
            sources = [
                (names.index(name), index)
                for name, index in dimension.sources
                if index != self.pipeline.batch_dim(name)
                and name in names
                and inputs[names.index(name)].dim() > index
            ]
            if not sources:
                continue
            position, index = sources[0]
            size = inputs[position].shape[index]
            target = -(-size // self.pad_to_multiple) * self.pad_to_multiple
            if dimension.max is not None:
                target = min(target, dimension.max)
            if not dimension.min <= size < target:
                continue
            for position, index in sources:
                tensor = inputs[position]
                if tensor.shape[index] != size:
                    continue  # disagreeing sizes: refused by the check that follows
                shape = list(tensor.shape)
                shape[index] = target - size
                fill = -100 if "labels" in names[position] else 0
                pad = torch.full(shape, fill, dtype=tensor.dtype, device=tensor.device)
                inputs[position] = torch.cat([tensor, pad], dim=index)
        return inputs

    def _bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        signature = self.pipeline.signature
        if len(args) > len(signature):
            raise PipelineRunError(
                f"{self.option} gave {len(args)} positional inputs; forward takes {len(signature)}"
            )
        bound = dict(zip(signature, args))
        bound.update(kwargs)
        return bound

    def _check(
        self,
        tensor: torch.Tensor,
        value: Value,
        batch: int,
        sizes: dict[str, int] | None,
        step: int,
    ) -> torch.Tensor:
        """``tensor``, checked to be what the pipeline takes as ``value`` (whose batch is
        along dimension ``batch``) in a step's batch; the error names the step, the input, and
        the fix that matches what differs."""
        micro = list(value.shape_for(sizes))
        expected = self._step_shape(micro, batch)
        got = list(tensor.shape)
        where = f"step {step}: input {value.name!r}"
        if tensor.dtype != value.torch_dtype:
            raise PipelineRunError(
                f"{where} is {str(tensor.dtype).removeprefix('torch.')}, this pipeline takes "
                f"{value.dtype}: convert it in the {self.option} function "
                f"(tensor.to(torch.{value.dtype}))"
            )
        if got == expected:
            return tensor
        if len(got) != len(expected):
            raise PipelineRunError(
                f"{where} has shape {got}, this pipeline takes {len(expected)} dimensions, "
                f"{expected} per step: give the {self.option} function's batch that shape"
            )
        others = [d for d in range(len(got)) if d != batch]
        if any(got[d] != expected[d] for d in others):
            dim = next(d for d in others if got[d] != expected[d])
            if sizes is not None and value.sizes is not None:
                formulas = ", ".join(map(str, value.sizes))
                raise PipelineRunError(
                    f"{where} has shape {got}; with {sizes} this pipeline expects {expected} "
                    f"per step ({self.rows} microbatches of shape [{formulas}]): its inputs "
                    "disagree on a dynamic dimension's size; give them the same lengths"
                )
            raise PipelineRunError(
                f"{where} has shape {got}, this pipeline takes {expected} per step: its dimension "
                f"{dim} is {got[dim]} where the pipeline was compiled for {expected[dim]}. To "
                f"train on other lengths compile with --dynamic; or pad (or cut) the batch to "
                f"{expected[dim]} in the {self.option} function"
            )
        per_run = micro[batch] * self.parts  # rows of one microbatch in every pipeline run
        fix = (
            f"run with --microbatches {got[batch] // per_run}"
            if got[batch] % per_run == 0
            else f"give the {self.option} function batches of {expected[batch]} rows"
        )
        layout = (
            f" (its batch dimension: the package records {batch} for {value.name!r}; "
            "compile with --batch-dims to change it)"
            if batch
            else ""
        )
        raise PipelineRunError(
            f"{where} has {got[batch]} rows (dimension {batch}), this pipeline takes "
            f"{expected[batch]} per step: {self.rows} microbatches of {micro[batch]} "
            f"(--microbatches {self.microbatches} x --accumulate x --dp x --dp-shard = "
            f"{self.rows}){layout}. To take its batches, {fix}"
        )

    def _step_shape(self, micro: list[int] | tuple[int, ...], batch: int) -> list[int]:
        """The shape of a step's batch of a value of microbatch shape ``micro`` whose batch is
        along dimension ``batch``."""
        shape = list(micro)
        if shape:
            shape[batch] *= self.rows
        return shape

    def _from_dataset(self, step: int) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Samples ``step * B ... (step + 1) * B - 1`` of an endless stream of seeded epoch
        permutations of the dataset (B: samples per step)."""
        assert self.dataset is not None  # called only with a dataset
        size = len(self.dataset)
        count = self.samples
        if size == 0:
            raise PipelineRunError(f"{self.option}: the dataset is empty")
        items: list[Any] = []
        epoch: int | None = None
        order: torch.Tensor | None = None
        for position in range(step * count, (step + 1) * count):
            if position // size != epoch:
                epoch = position // size
                generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                order = torch.randperm(size, generator=generator)
            assert order is not None  # drawn at the first position
            try:
                items.append(self.dataset[int(order[position % size])])
            except Exception as exc:  # noqa: BLE001 - named as the user's code failing
                raise UserCodeError(
                    self.option, f"{self.spec} (its dataset's items)", exc, step
                ) from exc
        if not all(isinstance(item, dict) for item in items):
            raise PipelineRunError(
                f"{self.option}: dataset items must be dicts of tensors keyed by the model's input "
                "names"
            )
        try:
            batch = {
                key: torch.stack([item[key] for item in items], self.pipeline.batch_dim(key))
                for key in items[0]
            }
        except RuntimeError as exc:
            raise PipelineRunError(
                f"{self.option}: the dataset's items of step {step} do not stack into one batch "
                f"({first_line(exc)}); items of different lengths need a --data FN(step) that "
                "pads each step's batch (see examples/finetune.py)"
            ) from None
        target = batch.pop("target", None)
        return self._inputs(batch, step, target)

    def _synthetic(self, step: int) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        inputs = [
            self._random(value, self.pipeline.batch_dim(value.name), generator)
            for value in self.pipeline.data_inputs
        ]
        loss = self.pipeline.loss
        target = None
        if loss.needs_target:
            assert loss.target is not None  # a loss that needs a target describes it
            target = self._random(loss.target, 0, generator)
        return inputs, target

    def _random(self, value: Value, batch: int, generator: torch.Generator) -> torch.Tensor:
        shape = self._step_shape(value.shape, batch)
        dtype = value.torch_dtype
        if dtype.is_floating_point:
            return torch.randn(shape, generator=generator).to(dtype)
        if dtype == torch.bool:
            return torch.rand(shape, generator=generator) < 0.5
        high = self.pipeline.input_ranges.get(value.name, 1)
        return torch.randint(0, max(high, 0) + 1, shape, generator=generator, dtype=dtype)
