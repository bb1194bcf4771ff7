"""Weights and training checkpoints of a generated pipeline.

Copied into every generated pipeline as ``runtime/train_state.py``; it needs only torch.

A training checkpoint is a directory ``DIR/step-N`` written with ``torch.distributed.checkpoint``
(DCP): every rank writes its own shards in parallel, keyed by the original model's names, the
model's state under ``model.NAME`` and the optimizer's under ``optimizer.NAME.*``; beside them per
rank its RNG states (``rankR.pt``, R the rank's place: its global rank in the default mesh order,
``Layout.place``, which no mesh order changes) and ``checkpoint.json`` (step, layout, tied names,
every file's size, the model's identity). Because the names are the original model's, a checkpoint
resumes under any pipeline of the same model: another number of stages, another partition, other
``--dp``/``--dp-shard`` (DCP reshards on load). Only of the same model: a checkpoint of another one
is refused, naming the first tensor that differs, and a run neither resumes from, points ``latest``
past nor prunes checkpoints of another model (see ``identity.py``). Ranks write into
``DIR/.step-N.partial``, which becomes ``step-N`` by one rename once every file is on disk;
``DIR/latest`` names the newest complete one and is replaced atomically. A crash at any point leaves
the previous checkpoint as it was. Written with ``--save-trainable-only``, a checkpoint leaves the
frozen parameters out; its ``checkpoint.json`` then records ``trainable_only``
(:class:`FrozenSource`: their names and where they came from, the ``--load`` or ``--seed`` a resume
must give again); checkpoints without it hold every tensor.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Placement
from torch.distributed.tensor import empty as dtensor_empty

from .checkpoint import (
    Checkpoint,
    CheckpointError,
    SafeFileSystemReader,
    SafeLoadPlanner,
    save_safetensors,
)
from .core.errors import PipelineRunError, first_line
from .core.pipeline import ModelIdentity, PipelineFormatError
from .guards import agree, describe_write_error, replace_atomically
from .identity import identity_difference, identity_from_tensors, identity_of_manifest
from .parallel import Layout
from .core.pipeline import Pipeline, as_pipeline
from .core.sharded_layers import plain_placement
from .support import copy_whole, local_shard, stage_state

__all__ = [
    "CHECKPOINT_FILE",
    "FORMAT",
    "FrozenSource",
    "MANIFEST",
    "READABLE_VERSIONS",
    "STEP_NAME",
    "StateMetadata",
    "TrainingCheckpoints",
    "VERSION",
    "checked_checkpoint",
    "complete_checkpoints",
    "damage",
    "expand_aliases",
    "fingerprint",
    "frozen_names",
    "gather_weights",
    "has_checkpoint",
    "latest_checkpoint",
    "load_weights",
    "materialise",
    "merge_checkpoint",
    "merged_state",
    "read_manifest",
    "save_weights",
    "stage_training_state",
    "trainable_only_note",
    "training_state",
]

#: DCP's metadata of a checkpoint: what it holds, by key
StateMetadata = dict[str, TensorStorageMetadata | BytesStorageMetadata]
FORMAT, VERSION = "autopipe.checkpoint", 3
#: the versions this runtime reads: 2 did not record the model's identity
READABLE_VERSIONS = (2, 3)
MANIFEST = "checkpoint.json"
#: the files of a checkpoint: DCP's metadata and per-rank data, per-rank RNG states
CHECKPOINT_FILE = re.compile(r"\.metadata|__\d+_\d+\.distcp|rank\d+\.pt")


# -- original-model weights -------------------------------------------------------------------
def load_weights(
    stages: dict[int, nn.Module],
    path: str,
    pipeline: Pipeline | dict[str, Any],
    device: torch.device,
    partial: bool = False,
) -> int:
    """Fill each local stage (built with ``meta_state``, or sharded by FSDP2 and materialised)
    with its own tensors from an original-model checkpoint, reading nothing else: a rank holds
    about its stages' size (its shards, one whole tensor at a time, when sharded). The
    checkpoint must hold the model's tensors and, unless ``partial``, no others. Collective
    when a process group is up: a problem any rank finds stops every rank, with its reason.
    Returns how many of the checkpoint's tensors were left out (``partial``).
    ``pipeline``: a Pipeline, or a package's ``PIPELINE`` dict."""
    pipeline = as_pipeline(pipeline)
    problem, left_out = None, 0
    try:
        left_out = _load_weights(stages, path, pipeline, device, partial)
    except PipelineRunError as exc:
        problem = str(exc)
    problem = agree(problem) if dist.is_initialized() else problem
    if problem:
        raise PipelineRunError(problem, every_rank=True)
    return left_out


def _renamed_by_transformers(path: str, pipeline: Pipeline) -> str | None:
    """What to do with a Hugging Face model directory whose tensors are not under the model's
    names: transformers saves some models (ViT, Mixtral's experts) under older names, or split
    differently, and converts them in ``from_pretrained``, which a package (torch alone) does
    not; None for anything else (another kind of model's directory: its ``model_type``)."""
    config = Path(path) / "config.json"
    if pipeline.huggingface is None or not config.is_file():
        return None
    try:
        model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    if model_type != pipeline.huggingface.config.get("model_type"):
        return None  # another kind of model's directory
    return (
        f"{path} is a Hugging Face model directory whose tensors are not all under the names "
        f"{pipeline.model_class} holds them by (transformers saves some models under older "
        "names, or split differently, and converts them as from_pretrained loads them; this "
        "package reads the names as the model holds them). Load it with "
        f"{pipeline.model_class}.from_pretrained, save torch.save(model.state_dict(), "
        "'model.pt') and pass --load model.pt"
    )


def _load_weights(
    stages: dict[int, nn.Module],
    path: str,
    pipeline: Pipeline,
    device: torch.device,
    partial: bool,
) -> int:
    try:
        checkpoint = Checkpoint(path)
    except CheckpointError as exc:
        raise PipelineRunError(f"--load: {exc}") from None
    left_out = _foreign_tensors(checkpoint, pipeline)
    if left_out and not partial:
        renamed = _renamed_by_transformers(path, pipeline)
        raise PipelineRunError(
            f"--load: {path} holds {len(left_out)} tensor(s) that {pipeline.model_class} has not "
            f"(the first: {left_out[0]}): "
            + (
                renamed
                or "it is a checkpoint of another model. To load this model's tensors from it "
                "and leave the others out, add --load-partial"
            )
        )
    mapped: set[str] = set()
    for index, stage in stages.items():
        wanted = stage.state_dict()
        targets = dict(stage.named_parameters()) | dict(stage.named_buffers())
        try:
            names = stage_state(stage, {name: name for name in checkpoint}, pipeline.aliases)
        except KeyError as exc:
            renamed = _renamed_by_transformers(path, pipeline)
            raise PipelineRunError(
                f"--load: {path} has no entry {exc} (needed by stage {index}); "
                + (renamed or f"is it a checkpoint of {pipeline.model}?")
            ) from None
        own = {}
        for key, source in names.items():
            try:
                tensor = checkpoint[source]
            except CheckpointError as exc:
                raise PipelineRunError(f"--load: {exc}") from None
            if tuple(tensor.shape) != tuple(wanted[key].shape):
                raise PipelineRunError(
                    f"--load: {source} in {path} has shape {list(tensor.shape)}, stage {index} "
                    f"expects {list(wanted[key].shape)}: it is a checkpoint of another model"
                )
            if isinstance(wanted[key], DTensor) or not targets[key].is_meta:
                copy_whole(targets[key], tensor)  # allocated (this rank's shard when sharded)
                continue
            # on CPU with the right dtype the first user gets the mapped tensor itself (private,
            # copy-on-write); a tied tensor held by several local stages is copied for the others
            own[key] = tensor.to(device=device, dtype=wanted[key].dtype, copy=source in mapped)
            mapped.add(source)
        if own:
            stage.load_state_dict(own, assign=True)
    return len(left_out)


def _foreign_tensors(checkpoint: Checkpoint, pipeline: Pipeline) -> list[str]:
    """The tensors of an original-model checkpoint that the pipeline's model has not (none
    known for a pipeline compiled before pipelines recorded the model's identity)."""
    if pipeline.identity is None:
        return []
    known = set(pipeline.identity.tensors) | {n for group in pipeline.aliases for n in group}
    return [name for name in checkpoint if name not in known]


def expand_aliases(state: dict[str, torch.Tensor], aliases: Sequence[Sequence[str]]) -> None:
    """Add every name of a tied tensor that ``state`` holds under one of its names."""
    for group in aliases:
        held = next((name for name in group if name in state), None)
        if held is not None:
            for name in group:
                state.setdefault(name, state[held])


def gather_weights(
    stages: dict[int, nn.Module], pipeline: Pipeline, layout: Layout, trainable_only: bool = False
) -> dict[str, torch.Tensor] | None:
    """The whole original-model ``state_dict`` on rank 0 (``None`` elsewhere), collective;
    ``trainable_only``: without the frozen parameters."""
    local = {}
    for stage in stages.values():
        left_out = frozen_names(stage) if trainable_only else set()
        for k, v in stage.state_dict().items():
            if k not in left_out:  # sharded tensors are gathered by all the ranks holding a part
                local[k] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
    if layout.dp_rank != 0 or not layout.reports:  # the others hold the same tensors
        local = {}
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(local, gathered, dst=0)
    if dist.get_rank() != 0:
        return None
    assert gathered is not None  # rank 0 gathers
    merged: dict[str, torch.Tensor] = {}
    for part in gathered:
        merged.update(part)
    expand_aliases(merged, pipeline.aliases)
    return merged


def save_weights(
    state: dict[str, torch.Tensor], path: str | Path, file_format: str | None = None
) -> None:
    """Write a state_dict as ``.safetensors`` or with ``torch.save`` (``file_format``
    "safetensors" or "torch"; by default by the suffix), through a temporary file created
    exclusively beside it and a rename (:func:`replace_atomically`): an interrupted or failed
    save never leaves a broken file, nor a temporary, and never writes through a link planted
    beforehand."""
    target = Path(path)
    safetensors = file_format == "safetensors" or (
        file_format is None and target.suffix == ".safetensors"
    )

    def write(temporary: Path) -> None:
        if safetensors:
            save_safetensors(state, temporary)
        else:
            torch.save(state, temporary)

    replace_atomically(target, write)


# -- training checkpoints ---------------------------------------------------------------------
def fingerprint(pipeline: Pipeline) -> str:
    """Identifies a pipeline's structure: its values and how stages take, return and place them."""
    data = pipeline.to_json()
    shape = {
        "inputs": data["inputs"],
        "outputs": data["outputs"],
        "values": data["values"],
        "stages": [
            {k: stage[k] for k in ("inputs", "outputs", "device")} for stage in data["stages"]
        ],
    }
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]


#: names of complete checkpoints inside a checkpoint directory
STEP_NAME = re.compile(r"step-\d{8}")


@dataclass(frozen=True)
class FrozenSource:
    """Where a run's frozen parameters come from, for the checkpoints it writes with
    ``--save-trainable-only`` (which leave them out) to name: the ``--load`` checkpoint, or
    (``load`` None) autopipe's initialisation with ``--seed``. Recorded in checkpoint.json as
    ``trainable_only``, with the names of the tensors left out."""

    load: str | None
    seed: int

    def describe(self) -> str:
        return f"--load {self.load}" if self.load else f"the initialisation of --seed {self.seed}"

    def to_json(self, frozen: Sequence[str]) -> dict[str, Any]:
        return {"load": self.load, "seed": self.seed, "frozen": list(frozen)}

    @classmethod
    def of_manifest(cls, manifest: dict[str, Any], path: Path) -> FrozenSource | None:
        """The source a trainable-only checkpoint's manifest records; None for a checkpoint
        holding every tensor."""
        entry = manifest.get("trainable_only")
        if entry is None:
            return None
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("load"), (str, type(None)))
            and isinstance(entry.get("seed"), int)
            and isinstance(entry.get("frozen"), list)
        ):
            raise PipelineRunError(
                f"{path / MANIFEST}: 'trainable_only' must be an object of load, seed and frozen"
            )
        return cls(entry["load"], entry["seed"])

    def resume_problem(self, path: Path, load: str | None, seed: int) -> str | None:
        """Why a run given ``--load load`` and ``--seed seed`` cannot resume from the
        trainable-only checkpoint ``path`` (its frozen parameters would differ from the ones
        it was trained with), or None."""
        held = (
            f"checkpoint {path} holds only the trainable parameters (written with "
            f"--save-trainable-only); its frozen ones came from {self.describe()}"
        )
        if self.load and not load:
            return f"{held}: resume with --load {self.load} (the same weights)"
        if not self.load and load:
            return f"{held}, not from --load: resume without --load (and with --seed {self.seed})"
        if not self.load and seed != self.seed:
            return f"{held}: resume with --seed {self.seed}"
        return None


class TrainingCheckpoints:
    """The checkpoints of one run in ``root``; every rank holds one of these."""

    def __init__(
        self,
        root: str | Path,
        pipeline: Pipeline | dict[str, Any],
        layout: Layout,
        keep: int,
        trainable_only: FrozenSource | None = None,
    ):
        """``pipeline``: a Pipeline, or a package's ``PIPELINE`` dict. ``trainable_only``:
        checkpoints leave the frozen parameters out (``--save-trainable-only``), which come
        from there."""
        self.root = Path(root)
        self.pipeline = as_pipeline(pipeline)
        self.layout = layout
        self.keep = keep
        self.trainable_only = trainable_only

    def latest(self) -> Path | None:
        return latest_checkpoint(self.root)

    def model_difference(
        self,
        path: Path,
        manifest: dict[str, Any] | None = None,
        saved: StateMetadata | None = None,
    ) -> str | None:
        """How the model checkpoint ``path`` holds differs from this pipeline's, in words; None
        for the same model (or one that cannot be told: a pipeline compiled before pipelines
        recorded their model's identity). ``manifest`` and ``saved`` (DCP's metadata): the
        checkpoint's, when the caller has read them already. A checkpoint that cannot be read
        is left to :func:`damage` to name."""
        ours = self.pipeline.identity
        if ours is None:
            return None
        try:
            theirs = identity_of_manifest(manifest or read_manifest(path))
            if theirs is None:  # written before checkpoints recorded it: its tensors tell
                theirs = _identity_of_tensors(saved or _saved_metadata(path), self.pipeline)
        except (PipelineRunError, PipelineFormatError):
            return None
        return identity_difference(ours, theirs)

    def refuse_other_models(self) -> None:
        """Stop every rank, before anything is trained or written, when the directory holds a
        checkpoint of another model: resuming from it, pointing ``latest`` past it or pruning
        it would lose another run's work. Collective."""
        problem = None
        if dist.get_rank() == 0:
            for path in complete_checkpoints(self.root):
                difference = self.model_difference(path)
                if difference:
                    problem = (
                        f"{self.root} holds checkpoints of another model than "
                        f"{self.pipeline.model_class}: {path.name} is not this model's "
                        f"({difference}). Give this run its own --checkpoint-dir; nothing in "
                        f"{self.root} was changed"
                    )
                    break
        found = [problem]
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(found, src=0)
        if found[0]:
            raise PipelineRunError(found[0], every_rank=True)

    def named(self, name: str) -> Path:
        """Checkpoint ``name`` (``step-N`` or N) of this directory, checked intact."""
        if name.isdigit():
            name = f"step-{int(name):08d}"
        path = self.root / name
        if not STEP_NAME.fullmatch(name) or not path.is_dir():
            raise PipelineRunError(
                f"--resume-from {name}: {self.root} has no such checkpoint; it has "
                f"{', '.join(p.name for p in complete_checkpoints(self.root)) or 'none'}",
                every_rank=True,
            )
        problem = damage(path)
        if problem:
            raise PipelineRunError(
                f"checkpoint {path} is damaged ({problem}); {_intact_hint(self.root, path)}",
                every_rank=True,
            )
        return path

    def save(
        self, step: int, stages: dict[int, nn.Module], optimizers: dict[int, torch.optim.Optimizer]
    ) -> Path:
        """Checkpoint the state after ``step`` optimizer steps; collective over all ranks. If any
        rank cannot write, nothing of this step is kept and every rank raises PipelineRunError;
        the previous checkpoint stays ``latest``."""
        final = self.root / f"step-{step:08d}"
        partial = self.root / f".step-{step:08d}.partial"
        problem = None
        try:
            if dist.get_rank() == 0:
                problem = self._attempt(lambda: self._start(partial), partial)
            self._check(agree(problem), step, partial)
            problem = self._attempt(lambda: self._write_own(partial, stages, optimizers), partial)
            self._check(agree(problem), step, partial)
            if dist.get_rank() == 0:
                problem = self._attempt(lambda: self._publish(step, partial, final), partial)
            self._check(agree(problem), step, partial)
        except BaseException:  # a stopped run (SIGTERM, Ctrl-C, a lost rank) leaves no partial
            if dist.get_rank() == 0:
                shutil.rmtree(partial, ignore_errors=True)
            raise
        return final

    @staticmethod
    def _attempt(write: Callable[[], None], where: Path) -> str | None:
        """``write()``, a stop request (SIGINT, SIGTERM) arriving meanwhile acted on once it
        ends: interrupted, torch.save's zip writer would report a broken file instead."""
        try:
            with _stop_signals_deferred():
                write()
        except (OSError, RuntimeError, CheckpointException) as exc:  # torch.save: a full disk
            cause = _cause(exc)  # is a RuntimeError; DCP wraps what a rank met
            if not isinstance(cause, Exception):  # a stop (SIGINT) inside DCP stops the run
                raise cause from None
            return describe_write_error(cause, where)
        return None

    def _check(self, problem: str | None, step: int, partial: Path) -> None:
        if problem is None:
            return
        if dist.get_rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)
        kept = _named_latest(self.root)
        raise PipelineRunError(
            f"the checkpoint of step {step} could not be written ({problem}); nothing of it was "
            + (
                f"kept, and {self.root / kept} is still the latest checkpoint: make room, then "
                "rerun with --resume"
                if kept
                else "kept (there is no earlier checkpoint)"
            ),
            every_rank=True,
        )

    def _start(self, partial: Path) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()

    def _write_own(
        self,
        partial: Path,
        stages: dict[int, nn.Module],
        optimizers: dict[int, torch.optim.Optimizer],
    ) -> None:
        state = training_state(stages, optimizers, self.trainable_only is not None)
        dcp.save(state, storage_writer=FileSystemWriter(partial))
        if self.layout.reports:  # a place's tensor-parallel ranks share its random state
            _save({"rng": _rng_state(self.layout.device)}, partial / f"rank{self.layout.place}.pt")

    def _publish(self, step: int, partial: Path, final: Path) -> None:
        """Rank 0: the manifest (with every file's size), then ``partial`` -> ``final`` and
        ``latest`` -> ``final`` by renames, then old checkpoints pruned (run by ``_attempt``: a
        stop request waits until ``latest`` is consistent)."""
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "step": step,
            "pipeline": fingerprint(self.pipeline),
            "model": self.pipeline.model,
            **({"identity": self.pipeline.identity.to_json()} if self.pipeline.identity else {}),
            "stages": self.pipeline.num_stages,
            "dp": self.layout.dp_size // self.layout.dp_shard,
            "dp_shard": self.layout.dp_shard,
            "world_size": dist.get_world_size(),
            "aliases": [list(group) for group in self.pipeline.aliases],
            **(
                {"trainable_only": self.trainable_only.to_json(self.pipeline.frozen)}
                if self.trainable_only is not None
                else {}
            ),
            **(
                {"huggingface": self.pipeline.huggingface.to_json()}
                if self.pipeline.huggingface
                else {}
            ),
            "files": {p.name: p.stat().st_size for p in sorted(partial.iterdir())},
        }
        (partial / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
        _fsync(partial / MANIFEST)
        if final.exists():  # left by a run that died before pointing `latest` at it
            shutil.rmtree(final)
        os.replace(partial, final)
        pointer = self.root / ".latest.tmp"
        try:
            pointer.write_text(final.name + "\n", encoding="utf-8")
            _fsync(pointer)
            os.replace(pointer, self.root / "latest")
            _fsync(self.root)
        except BaseException:  # unless `latest` already names it, keep the previous one
            pointer.unlink(missing_ok=True)
            if _named_latest(self.root) != final.name:
                shutil.rmtree(final, ignore_errors=True)
            raise
        if self.keep:  # only this model's checkpoints: another's are never touched
            own = [p for p in complete_checkpoints(self.root) if not self.model_difference(p)]
            for old in own[: -self.keep]:
                if old != final:  # the one `latest` names is never pruned
                    shutil.rmtree(old)

    def restore(
        self,
        path: Path,
        stages: dict[int, nn.Module],
        optimizers: dict[int, torch.optim.Optimizer],
    ) -> int:
        """Fill this rank's stages (materialised, sharded or not) and their optimizers from
        checkpoint ``path``, whatever pipeline wrote it, checking every tensor's name, shape and
        dtype; collective. RNG states too when the layout is the same. Returns its step. A
        checkpoint written with ``--save-trainable-only`` fills the trainable parameters only:
        the frozen ones keep what the stages hold (``--load``, or the initialisation)."""
        manifest = read_manifest(path)
        reader = SafeFileSystemReader(path)  # runs no code a checkpoint could hold
        saved = _saved_metadata(path, reader, every_rank=True)
        partial = FrozenSource.of_manifest(manifest, path) is not None
        left_out = frozenset(manifest["trainable_only"]["frozen"]) if partial else frozenset()
        state = {i: stage_training_state(m, optimizers[i], partial) for i, m in stages.items()}
        request: dict[str, dict[str, Any]] = {"model": {}, "optimizer": {}}
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # names held twice on this rank
        aliases = {n: group for group in manifest["aliases"] for n in group}
        problem = self.model_difference(path, manifest, saved)
        if problem:  # the same on every rank
            problem = (
                f"checkpoint {path} holds another model than {self.pipeline.model_class}: {problem}"
            )
        else:
            problem = self._request_all(path, saved, aliases, state, request, copies, left_out)
        problem = agree(problem)  # every rank stops before DCP's collective load
        if problem:
            raise PipelineRunError(problem, every_rank=True)
        try:
            dcp.load(request, storage_reader=reader, planner=SafeLoadPlanner())
        except CheckpointException as exc:
            raise PipelineRunError(
                f"checkpoint {path} cannot be read ({first_line(_cause(exc))}); it is damaged",
                every_rank=True,
            ) from None
        with torch.no_grad():
            for target, value in copies:
                _copy_into(target, value)
        for index, stage in stages.items():
            tensors, osd = state[index]
            # torch annotates a dict of its ValueType where a Mapping of tensors would do
            options = StateDictOptions(strict=not partial)
            set_model_state_dict(stage, tensors, options=options)  # type: ignore[arg-type]
            set_optimizer_state_dict(stage, optimizers[index], osd)
        same_layout = (
            manifest["world_size"] == dist.get_world_size()
            and manifest.get("dp_shard") == self.layout.dp_shard
            and manifest.get("pipeline") == fingerprint(self.pipeline)
        )
        rank_file = path / f"rank{self.layout.place}.pt"
        if same_layout and rank_file.is_file():
            _set_rng_state(_load(rank_file, "cpu")["rng"], self.layout.device)
        return cast(int, manifest["step"])  # checked by read_manifest

    @staticmethod
    def _request_all(
        path: Path,
        saved: StateMetadata,
        aliases: dict[str, Sequence[str]],
        state: dict[int, tuple[dict[str, torch.Tensor], dict[str, Any]]],
        request: dict[str, dict[str, Any]],
        copies: list[tuple[torch.Tensor, torch.Tensor]],
        left_out: frozenset[str] = frozenset(),
    ) -> str | None:
        """Ask DCP for every tensor of this rank's ``state`` (model and optimizer), each checked
        against the checkpoint's ``saved`` metadata; the first problem this rank's stages find
        (another rank's may differ), or None. ``left_out``: the frozen parameters a
        trainable-only checkpoint does not hold."""
        try:
            for index, (tensors, osd) in state.items():
                for name, tensor in tensors.items():
                    if name in left_out or left_out.intersection(aliases.get(name, ())):
                        raise PipelineRunError(
                            f"checkpoint {path} holds only the parameters that trained in the "
                            f"run that wrote it (--save-trainable-only): {name} was frozen "
                            f"there, and stage {index} of this pipeline trains it; start from "
                            "weights that hold it (--load) instead of resuming"
                        )
                    held = _source(path, saved, aliases.get(name, ()), index, tensor, "model", name)
                    _request(request["model"], held, tensor, copies)
                for name, entries in osd["state"].items():
                    for entry, tensor in entries.items():
                        held = _source(
                            path,
                            saved,
                            aliases.get(name, ()),
                            index,
                            tensor,
                            "optimizer",
                            name,
                            entry,
                        )
                        _request(request["optimizer"], held, tensor, copies)
        except PipelineRunError as exc:
            return str(exc)
        return None


def _source(
    path: Path,
    saved: StateMetadata,
    aliases: Sequence[str],
    index: int,
    tensor: torch.Tensor,
    kind: str,
    name: str,
    entry: str = "",
) -> str:
    """Where checkpoint ``path`` holds ``kind`` ("model" or "optimizer") state ``name`` (or
    its ``entry``, an optimizer's ``exp_avg``...): under ``name`` itself or a tied alias, the key
    without ``kind``. Checks its shape and dtype; names what is missing or different."""
    suffix = f".{entry}" if entry else ""
    for candidate in [name, *aliases]:
        key = f"{kind}.{candidate}{suffix}"
        if key in saved:
            break
    else:
        what = "tensor" if kind == "model" else f"{entry!r} optimizer state of"
        raise PipelineRunError(
            f"checkpoint {path} has no {what} {name} (needed by stage {index} of this "
            f"pipeline): it was written for another model"
            + (" or with another --optimizer" if kind == "optimizer" else "")
        )
    meta = saved[key]
    shape, dtype = list(getattr(meta, "size", [])), getattr(meta, "properties", None)
    dtype = getattr(dtype, "dtype", None)
    if shape != list(tensor.shape) or dtype != tensor.dtype:
        raise PipelineRunError(
            f"checkpoint {path} holds {key} as {dtype} {shape}; stage {index} of this "
            f"pipeline has {tensor.dtype} {list(tensor.shape)}: it was written for another "
            "model"
        )
    return f"{candidate}{suffix}"


def frozen_names(stage: nn.Module) -> set[str]:
    """The names of a stage's parameters that take no gradient (a frozen base under LoRA
    adapters): what ``--save-trainable-only`` leaves out."""
    return {
        name for name, p in stage.named_parameters(remove_duplicate=False) if not p.requires_grad
    }


def stage_training_state(
    stage: nn.Module, optimizer: torch.optim.Optimizer, trainable_only: bool = False
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """One stage's model state and torch's optimizer state dict of it, keyed by the original
    model's names (DTensors when sharded; the optimizer's state created if it has none yet).
    ``trainable_only``: without the frozen parameters (which have no optimizer state)."""
    # a model's state: tensors (torch types it as any state_dict value)
    tensors = cast(dict[str, torch.Tensor], get_model_state_dict(stage))
    if trainable_only:
        frozen = frozen_names(stage)
        tensors = {name: t for name, t in tensors.items() if name not in frozen}
    return tensors, get_optimizer_state_dict(stage, optimizer)


def training_state(
    stages: dict[int, nn.Module],
    optimizers: dict[int, torch.optim.Optimizer],
    trainable_only: bool = False,
) -> dict[str, Any]:
    """What a checkpoint holds of a rank's stages: ``{"model": {name: tensor}, "optimizer":
    {name: {entry: tensor}}}``, a name held by two local stages (tied copies) once;
    ``trainable_only``: no frozen parameters."""
    model: dict[str, torch.Tensor] = {}
    optimizer: dict[str, dict[str, torch.Tensor]] = {}
    for index, stage in stages.items():
        tensors, osd = stage_training_state(stage, optimizers[index], trainable_only)
        for name, tensor in tensors.items():
            if name not in model:  # a tied copy held twice is written once (and gathered once)
                model[name] = _as_saved(tensor)
        for name, entries in osd["state"].items():
            if name not in optimizer:
                optimizer[name] = {key: _as_saved(t) for key, t in entries.items()}
    return {"model": model, "optimizer": optimizer}


def _request(
    request: dict[str, torch.Tensor],
    source: str,
    tensor: torch.Tensor,
    copies: list[tuple[torch.Tensor, torch.Tensor]],
) -> None:
    """Ask DCP to fill ``tensor`` from ``source``; a second tensor of the same source is
    copied from the first after loading, and so is a tensor the checkpoint holds in another
    layout (a fused projection's sections, filled in the plain layout first)."""
    if source in request:
        copies.append((tensor, request[source]))
        return
    layout = _saved_placements(tensor)
    if layout is None:
        request[source] = tensor
        return
    assert isinstance(tensor, DTensor)  # _saved_placements
    buffer = dtensor_empty(  # filled by DCP: nothing to gather first
        tensor.shape, dtype=tensor.dtype, device_mesh=tensor.device_mesh, placements=layout
    )
    request[source] = buffer
    copies.append((tensor, buffer))


def _as_saved(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in the layout a checkpoint holds it in: a DTensor split section by section
    (a fused projection's, whose rank holds a share of each section, which DCP cannot write
    as one block) redistributed to the plain split of the same dimension; any other as it
    is."""
    layout = _saved_placements(tensor)
    if layout is None:
        return tensor
    assert isinstance(tensor, DTensor)  # _saved_placements
    return cast(torch.Tensor, tensor.redistribute(placements=layout))


def _saved_placements(tensor: torch.Tensor) -> tuple[Placement, ...] | None:
    """The placements a checkpoint holds ``tensor`` in where they are not its own: a
    sectioned split over the "tp" mesh dimension as the plain split (FSDP2's own placements
    are DCP's to write); None otherwise."""
    if not isinstance(tensor, DTensor):
        return None
    names = tensor.device_mesh.mesh_dim_names or ()
    if "tp" not in names:
        return None
    placements = list(tensor.placements)
    at = names.index("tp")
    placements[at] = plain_placement(placements[at])
    return None if placements[at] == tensor.placements[at] else tuple(placements)


def _copy_into(target: torch.Tensor, value: torch.Tensor) -> None:
    """``target``'s values from ``value`` (the same tensor, perhaps in another layout)."""
    if isinstance(target, DTensor) and isinstance(value, DTensor):
        if tuple(value.placements) != tuple(target.placements):
            value = value.redistribute(placements=target.placements)
    local_shard(target).copy_(local_shard(value))


def _cause(exc: BaseException) -> BaseException:
    """The error a rank met inside DCP, which wraps every rank's in one CheckpointException."""
    if isinstance(exc, CheckpointException) and exc.failures:
        failure = next(iter(exc.failures.values()))
        return failure[0] if isinstance(failure, tuple) else failure
    return exc


def materialise(module: nn.Module, device: torch.device) -> None:
    """Allocate, uninitialised, the parameters and buffers a stage built with ``meta_state``
    left on the meta device (FSDP2-managed ones: only this rank's shard), keeping the buffers
    that have values; a checkpoint fills the rest."""
    kept = {name: b for name, b in module.named_buffers() if not b.is_meta}
    fsdp = any(isinstance(m, FSDPModule) for m in module.modules())  # FSDP2 allocates its own
    if not fsdp and any(isinstance(p, DTensor) for p in module.parameters()):
        _materialise_each(module, device)
    else:
        module.to_empty(device=device)
    with torch.no_grad():
        for name, value in kept.items():
            module.get_buffer(name).copy_(value)


def _materialise_each(module: nn.Module, device: torch.device) -> None:
    """``to_empty`` for a module holding tensor-parallel DTensor parameters: each parameter
    and buffer on the meta device replaced by an uninitialised one on ``device`` (a DTensor by
    one of this rank's shard), each once however many modules hold it. ``to_empty`` would swap
    each DTensor in place, which torch refuses for a tensor something holds a weak reference
    to (a fake tensor, in a dry run)."""
    made: dict[int, torch.Tensor] = {}

    def allocated(tensor: torch.Tensor) -> torch.Tensor:
        if isinstance(tensor, DTensor):
            local = torch.empty_like(tensor.to_local(), device=device)
            return DTensor.from_local(
                local,
                tensor.device_mesh,
                tensor.placements,
                run_check=False,
                shape=tensor.shape,
                stride=tensor.stride(),
            )
        return torch.empty_like(tensor, device=device)

    for owner in module.modules():
        for name, param in list(owner.named_parameters(recurse=False)):
            if id(param) not in made:
                if not (param.to_local() if isinstance(param, DTensor) else param).is_meta:
                    continue
                made[id(param)] = nn.Parameter(allocated(param), param.requires_grad)
            owner.register_parameter(name, cast(nn.Parameter, made[id(param)]))
        for name, buffer in list(owner.named_buffers(recurse=False)):
            if buffer.is_meta:
                made.setdefault(id(buffer), allocated(buffer))
                owner._buffers[name] = made[id(buffer)]


def has_checkpoint(root: str | Path | None) -> bool:
    """Whether ``root`` holds a published checkpoint (its ``latest`` pointer, written only once
    a checkpoint is complete, or a complete checkpoint without it), without reading or
    checking it (:func:`latest_checkpoint`)."""
    return root is not None and (
        (Path(root) / "latest").is_file() or bool(complete_checkpoints(Path(root)))
    )


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint ``root/latest`` names, or None if there is none yet; refuses one that is
    damaged, naming the newest intact one to resume from instead. Without the pointer (a run
    stopped between its first checkpoint's completion and the pointer, or step directories
    copied without it), the newest checkpoint there, refused alike when it is damaged: a run
    never starts over beside checkpoints, nor passes one over unsaid."""
    pointer = root / "latest"
    if not pointer.is_file():
        complete = complete_checkpoints(root)
        if not complete:
            return None
        problem = damage(complete[-1])
        if problem:
            raise PipelineRunError(
                f"{root} has no latest pointer, and its newest checkpoint {complete[-1]} is "
                f"damaged ({problem}); {_intact_hint(root, complete[-1])}",
                every_rank=True,
            )
        return complete[-1]
    try:
        name = pointer.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        name = f"<unreadable: {exc}>"
    if not STEP_NAME.fullmatch(name):
        raise PipelineRunError(
            f"{pointer} holds {name[:80]!r}, not the name of a checkpoint (step-NNNNNNNN); "
            f"{_intact_hint(root)}",
            every_rank=True,
        )
    path = root / name
    problem = damage(path)
    if problem:
        raise PipelineRunError(
            f"the latest checkpoint {path} is damaged ({problem}); {_intact_hint(root, path)}",
            every_rank=True,
        )
    return path


def _named_latest(root: Path) -> str | None:
    try:
        return (root / "latest").read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None


@contextmanager
def _stop_signals_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM arriving inside the block are acted on when it ends, so a stopped run
    never leaves half a write or a half-done rename sequence. Their Python handlers are swapped for a recorder (not
    the thread's signal mask: a signal sent to the process may reach another thread, and Python
    runs its handler in the main thread all the same); the first one recorded is then handed
    to the handler it replaced."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    stops = (signal.SIGINT, signal.SIGTERM)
    previous: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {
        s: signal.signal(s, lambda signum, _frame: caught.append(signum)) for s in stops
    }
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if caught:
            handler = previous[caught[0]]
            if callable(handler):
                handler(caught[0], None)
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), caught[0])


def complete_checkpoints(root: Path) -> list[Path]:
    """Checkpoint directories of ``root`` with a manifest, oldest first (not checked further)."""
    found = (p.parent for p in root.glob(f"step-*/{MANIFEST}"))
    return sorted(p for p in found if STEP_NAME.fullmatch(p.name))


def _intact_hint(root: Path, damaged: Path | None = None) -> str:
    intact = [p for p in complete_checkpoints(root) if p != damaged and damage(p) is None]
    if not intact:
        return f"no intact checkpoint is left in {root}"
    name = intact[-1].name
    return (
        f"the newest intact checkpoint is {name}: train.py --resume-from {name} continues from "
        f"it, autopipe merge {intact[-1]} reads it"
    )


def damage(path: Path) -> str | None:
    """What is wrong with checkpoint directory ``path`` (a missing or unreadable manifest, a
    missing file, a file of another size than written), or None. Checks sizes only: cheap."""
    try:
        manifest = read_manifest(path)
    except PipelineRunError as exc:
        return str(exc)
    for name, size in sorted(manifest.get("files", {}).items()):
        if not CHECKPOINT_FILE.fullmatch(name):
            return f"its manifest names a file {name[:80]!r} that a checkpoint never holds"
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, {size} were written"
    return None


def read_manifest(path: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise PipelineRunError(f"{path} is not a readable autopipe checkpoint ({exc})") from None
    if not isinstance(manifest, dict):
        raise PipelineRunError(f"{path / MANIFEST} does not hold a checkpoint manifest")
    if manifest.get("format") != FORMAT or manifest.get("version") not in READABLE_VERSIONS:
        raise PipelineRunError(
            f"{path} is a {manifest.get('format')} version {manifest.get('version')} checkpoint; "
            f"this runtime reads {FORMAT} versions {', '.join(map(str, READABLE_VERSIONS))}"
        )
    fields = (
        ("step", int),
        ("stages", int),
        ("world_size", int),
        ("aliases", list),
        ("files", dict),
    )
    for key, kind in fields:
        if not isinstance(manifest.get(key), kind):
            raise PipelineRunError(
                f"{path / MANIFEST}: {key!r} is missing or not a {kind.__name__}"
            )
    FrozenSource.of_manifest(manifest, path)  # checked here, with every other field
    return manifest


def _saved_metadata(
    path: Path, reader: SafeFileSystemReader | None = None, every_rank: bool = False
) -> StateMetadata:
    """What DCP's metadata of checkpoint ``path`` lists, by key (read without running code);
    PipelineRunError if it cannot be read."""
    try:
        return (reader or SafeFileSystemReader(path)).read_metadata().state_dict_metadata
    except Exception as exc:  # noqa: BLE001 - DCP's reader raises what its storage does
        raise PipelineRunError(
            f"checkpoint {path} cannot be read ({first_line(exc)})", every_rank=every_rank
        ) from None


def _identity_of_tensors(saved: StateMetadata, pipeline: Pipeline) -> ModelIdentity:
    """The identity, without a digest, of a checkpoint that records none (version 2): its
    model's tensors as DCP's metadata (``saved``) lists them."""
    tensors = {
        key[len("model.") :]: (list(meta.size), meta.properties.dtype)
        for key, meta in saved.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    return identity_from_tensors(tensors, pipeline.aliases)


def merge_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The whole original-model state_dict held by a checkpoint directory (``DIR`` for its
    latest, or ``DIR/step-N``), and its manifest. A checkpoint written with
    ``--save-trainable-only`` holds the trainable tensors only (:func:`trainable_only_note`
    says so)."""
    checkpoint, manifest = checked_checkpoint(path)
    return merged_state(checkpoint, manifest), manifest


def checked_checkpoint(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """The checkpoint directory ``path`` names (``DIR`` for its latest, or ``DIR/step-N``),
    checked for damage, and its manifest: what :func:`merged_state` reads, known before its
    tensors are."""
    path = Path(path)
    if not (path / MANIFEST).is_file() and path.is_dir() and not STEP_NAME.fullmatch(path.name):
        path = latest_checkpoint(path) or path  # None: _not_a_checkpoint says what is there
    absent = _not_a_checkpoint(path)
    if absent:
        raise PipelineRunError(absent)
    problem = damage(path)
    if problem:
        raise PipelineRunError(f"checkpoint {path} is damaged ({problem})")
    return path, read_manifest(path)


def _not_a_checkpoint(path: Path) -> str | None:
    """Why ``path`` is no checkpoint at all (missing, a file, a directory holding neither a
    checkpoint nor a ``latest`` pointer), with the checkpoints there are; None for a directory
    that holds a checkpoint's files or its manifest (:func:`damage` judges those)."""
    if path.is_dir() and (
        (path / MANIFEST).exists() or any(CHECKPOINT_FILE.fullmatch(p.name) for p in path.iterdir())
    ):
        return None
    if not path.exists():
        what = "does not exist"
    elif not path.is_dir():
        what = "is a file, not a checkpoint directory"
    else:
        what = "holds no checkpoint (no checkpoint.json, no latest pointer)"
    root = path if path.is_dir() and not STEP_NAME.fullmatch(path.name) else path.parent
    steps = [p.name for p in complete_checkpoints(root)] if root.is_dir() else []
    there = (
        f"; {root} holds {', '.join(steps)}"
        if steps
        else "; give a --checkpoint-dir of train.py, or one of its step-N directories"
    )
    return f"checkpoint {path} {what}{there}"


def merged_state(path: Path, manifest: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The original-model state_dict of the checkpoint :func:`checked_checkpoint` gave (with
    its ``manifest``), tied names included, read in this one process."""
    reader = SafeFileSystemReader(path)  # runs no code a checkpoint could hold
    try:
        saved = reader.read_metadata().state_dict_metadata
        state = {
            # the model's entries are tensors (a bytes entry fails here, as damage)
            key[len("model.") :]: torch.empty(
                cast(TensorStorageMetadata, meta).size,
                dtype=cast(TensorStorageMetadata, meta).properties.dtype,
            )
            for key, meta in saved.items()
            if key.startswith("model.")
        }
        with warnings.catch_warnings():  # reading in one process is what merge is for
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.load(
                {"model": state}, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True
            )
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP's reader raises what
        raise PipelineRunError(  # its storage does, wrapped in a (Base)CheckpointException
            f"checkpoint {path} cannot be read ({first_line(_cause(exc))}); it is damaged"
        ) from None
    expand_aliases(state, manifest["aliases"])
    return state


def trainable_only_note(manifest: dict[str, Any], path: str | Path) -> str | None:
    """For a checkpoint written with ``--save-trainable-only`` (its ``manifest``), in words:
    that it holds only the trainable tensors, which it left out and where those come from;
    None for a checkpoint holding every tensor."""
    source = FrozenSource.of_manifest(manifest, Path(path))
    if source is None:
        return None
    frozen = manifest["trainable_only"]["frozen"]
    shown = ", ".join(frozen[:3]) + (f" and {len(frozen) - 3} more" if len(frozen) > 3 else "")
    return (
        f"{path} holds only the trainable tensors (written with --save-trainable-only): the "
        f"{len(frozen)} frozen parameter(s) ({shown or 'none'}) are not in it; they are those of "
        f"{source.describe()}: load the merged tensors over those (load_state_dict(state, "
        "strict=False))"
    )


def _load(path: Path, device: torch.device | str) -> dict[str, Any]:
    """A checkpoint file, or PipelineRunError naming it when it is truncated or corrupted."""
    try:
        loaded = torch.load(path, map_location=device, weights_only=True, mmap=True)
        return cast(dict[str, Any], loaded)  # what _save wrote
    except (OSError, RuntimeError, ValueError, EOFError) as exc:
        raise PipelineRunError(
            f"{path} cannot be read ({first_line(exc)}); the checkpoint is damaged"
        ) from None


def _save(obj: Any, path: Path) -> None:
    torch.save(obj, path)
    _fsync(path)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
