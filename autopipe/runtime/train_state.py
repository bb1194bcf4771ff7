"""Weights and training checkpoints of a generated pipeline.

Copied into every generated pipeline as ``runtime/train_state.py``; it needs only torch.

A training checkpoint is a directory ``DIR/step-N`` holding, per stage, its state under the
original model's names with its optimizer and learning-rate scheduler state (``stageS.pt``,
written by the first replica), per rank its RNG states (``rankR.pt``), and ``checkpoint.json``
(step, which pipeline, layout, tied names). Ranks write into ``DIR/.step-N.partial``, which
becomes ``step-N`` by one rename once every file is on disk; ``DIR/latest`` names the newest
complete one and is replaced atomically. A crash at any point leaves the previous checkpoint as it
was.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .checkpoint import Checkpoint, CheckpointError, save_safetensors
from .data import PipelineRunError, first_line
from .guards import agree, describe_write_error
from .parallel import Layout
from .pipeline import Pipeline, as_pipeline
from .support import stage_state

FORMAT, VERSION = "autopipe.checkpoint", 1
MANIFEST = "checkpoint.json"


# -- original-model weights -------------------------------------------------------------------
def load_weights(
    stages: dict[int, nn.Module], path: str, pipeline: Pipeline | dict, device: torch.device
) -> None:
    """Fill each local stage (built with ``meta_state``) with its own tensors from an
    original-model checkpoint, reading nothing else: a rank holds about its stages' size.
    ``pipeline``: a Pipeline, or a package's ``PIPELINE`` dict."""
    pipeline = as_pipeline(pipeline)
    try:
        checkpoint = Checkpoint(path)
    except CheckpointError as exc:  # every rank opens the same file and finds the same
        raise PipelineRunError(f"--load: {exc}", every_rank=True) from None
    mapped: set[str] = set()
    for index, stage in stages.items():
        wanted = stage.state_dict()
        try:
            names = stage_state(stage, {name: name for name in checkpoint}, pipeline.aliases)
        except KeyError as exc:
            raise PipelineRunError(
                f"--load: {path} has no entry {exc} (needed by stage {index}); is it a checkpoint of {pipeline.model}?"
            ) from None
        own = {}
        for key, source in names.items():
            try:
                tensor = checkpoint[source]
            except CheckpointError as exc:
                raise PipelineRunError(f"--load: {exc}") from None
            if tuple(tensor.shape) != tuple(wanted[key].shape):
                raise PipelineRunError(
                    f"--load: {source} in {path} has shape {list(tensor.shape)}, stage {index} expects {list(wanted[key].shape)}"
                )
            # on CPU with the right dtype the first user gets the mapped tensor itself (private,
            # copy-on-write); a tied tensor held by several local stages is copied for the others
            own[key] = tensor.to(device=device, dtype=wanted[key].dtype, copy=source in mapped)
            mapped.add(source)
        stage.load_state_dict(own, assign=True)


def expand_aliases(state: dict[str, torch.Tensor], aliases: Sequence[Sequence[str]]) -> None:
    """Add every name of a tied tensor that ``state`` holds under one of its names."""
    for group in aliases:
        held = next((name for name in group if name in state), None)
        if held is not None:
            for name in group:
                state.setdefault(name, state[held])


def gather_weights(
    stages: dict[int, nn.Module], pipeline: Pipeline, layout: Layout
) -> dict[str, torch.Tensor] | None:
    """The whole original-model ``state_dict`` on rank 0 (``None`` elsewhere), collective."""
    local = {  # sharded tensors are gathered by all the ranks holding a part
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
        for stage in stages.values()
        for k, v in stage.state_dict().items()
    }
    if layout.dp_rank != 0:
        local = {}
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(local, gathered, dst=0)
    if dist.get_rank() != 0:
        return None
    merged: dict[str, torch.Tensor] = {}
    for part in gathered:
        merged.update(part)
    expand_aliases(merged, pipeline.aliases)
    return merged


def save_weights(state: dict[str, torch.Tensor], path: str | Path) -> None:
    """Write a state_dict as ``.safetensors`` (by suffix) or with ``torch.save``, through a
    temporary file and a rename: an interrupted save never leaves a broken file."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    try:
        if target.suffix == ".safetensors":
            save_safetensors(state, tmp)
        else:
            torch.save(state, tmp)
        _fsync(tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


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


class TrainingCheckpoints:
    """The checkpoints of one run in ``root``; every rank holds one of these."""

    def __init__(self, root: str | Path, pipeline: Pipeline | dict, layout: Layout, keep: int):
        """``pipeline``: a Pipeline, or a package's ``PIPELINE`` dict."""
        self.root = Path(root)
        self.pipeline = as_pipeline(pipeline)
        self.layout = layout
        self.keep = keep

    def latest(self) -> Path | None:
        return latest_checkpoint(self.root)

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
        self,
        step: int,
        stages: dict[int, nn.Module],
        optimizers: dict[int, torch.optim.Optimizer],
        schedulers: dict[int, Any],
    ) -> Path:
        """Checkpoint the state after ``step`` optimizer steps; collective over all ranks. If any
        rank cannot write, nothing of this step is kept and every rank raises PipelineRunError;
        the previous checkpoint stays ``latest``."""
        final = self.root / f"step-{step:08d}"
        partial = self.root / f".step-{step:08d}.partial"
        problem = None
        if dist.get_rank() == 0:
            problem = self._attempt(lambda: self._start(partial), partial)
        self._check(agree(problem), step, partial)
        problem = self._attempt(
            lambda: self._write_own(partial, stages, optimizers, schedulers), partial
        )
        self._check(agree(problem), step, partial)
        if dist.get_rank() == 0:
            problem = self._attempt(lambda: self._publish(step, partial, final), partial)
        self._check(agree(problem), step, partial)
        return final

    @staticmethod
    def _attempt(write: Callable[[], None], where: Path) -> str | None:
        try:
            write()
        except (OSError, RuntimeError) as exc:  # torch.save reports a full disk as RuntimeError
            return describe_write_error(exc, where)
        return None

    def _check(self, problem: str | None, step: int, partial: Path) -> None:
        if problem is None:
            return
        if dist.get_rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)
        latest = self.root / "latest"
        kept = latest.read_text(encoding="utf-8").strip() if latest.is_file() else None
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
        schedulers: dict[int, Any],
    ) -> None:
        if self.layout.dp_rank == 0:
            for index, stage in stages.items():
                state = {
                    "model": stage.state_dict(),
                    "optimizer": optimizers[index].state_dict(),
                    "scheduler": schedulers[index].state_dict(),
                }
                _save(state, partial / f"stage{index}.pt")
        _save({"rng": _rng_state(self.layout.device)}, partial / f"rank{self.layout.rank}.pt")

    def _publish(self, step: int, partial: Path, final: Path) -> None:
        """Rank 0: the manifest (with every file's size), then ``partial`` -> ``final`` and
        ``latest`` -> ``final`` by renames, then old checkpoints pruned."""
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "step": step,
            "pipeline": fingerprint(self.pipeline),
            "model": self.pipeline.model,
            "stages": self.pipeline.num_stages,
            "dp": self.layout.dp_size,
            "world_size": dist.get_world_size(),
            "aliases": [list(group) for group in self.pipeline.aliases],
            "files": {p.name: p.stat().st_size for p in sorted(partial.iterdir())},
        }
        (partial / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
        _fsync(partial / MANIFEST)
        with _stop_signals_deferred():  # a stop request waits until `latest` is consistent
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
        if self.keep:
            for old in complete_checkpoints(self.root)[: -self.keep]:
                if old != final:  # the one `latest` names is never pruned
                    shutil.rmtree(old)

    def restore_weights(self, path: Path, stages: dict[int, nn.Module]) -> dict:
        """Fill this rank's stages (built with ``meta_state``) from checkpoint ``path``; returns
        its manifest. Optimizers are made afterwards, for the parameters this creates."""
        manifest = read_manifest(path)
        if manifest["pipeline"] != fingerprint(self.pipeline):
            raise PipelineRunError(
                f"checkpoint {path} was written by a different pipeline ({manifest['model']}, "
                f"{manifest['stages']} stages, fingerprint {manifest['pipeline']}; this one is "
                f"{fingerprint(self.pipeline)}). Resume with the pipeline that wrote it, or start "
                "from its weights: autopipe merge, then --load"
            )
        for index, stage in stages.items():
            state = self._stage_file(path, index)["model"]
            stage.load_state_dict(state, assign=True)
        return manifest

    def restore_training(
        self,
        path: Path,
        manifest: dict,
        optimizers: dict[int, torch.optim.Optimizer],
        schedulers: dict[int, Any],
    ) -> int:
        """Load optimizer, scheduler and RNG states of checkpoint ``path``; returns its step."""
        for index, optimizer in optimizers.items():
            state = self._stage_file(path, index)
            optimizer.load_state_dict(state["optimizer"])
            schedulers[index].load_state_dict(state["scheduler"])
        rank_file = path / f"rank{self.layout.rank}.pt"
        if manifest["world_size"] == dist.get_world_size() and rank_file.is_file():
            _set_rng_state(_load(rank_file, "cpu")["rng"], self.layout.device)
        return manifest["step"]

    def _stage_file(self, path: Path, index: int) -> dict:
        return _load(path / f"stage{index}.pt", self.layout.device)


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint ``root/latest`` names, or None if there is none yet; refuses one that is
    damaged, naming the newest intact one to resume from instead."""
    pointer = root / "latest"
    if not pointer.is_file():
        return None
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
    """SIGINT and SIGTERM arriving inside the block are delivered when it ends (main thread, on
    systems with signal masks), so a stopped run never leaves half a rename sequence."""
    if not hasattr(signal, "pthread_sigmask") or threading.current_thread() is not (
        threading.main_thread()
    ):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


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
    files = manifest.get("files")
    if files is None:  # written before sizes were recorded
        files = {f"stage{i}.pt": None for i in range(manifest["stages"])}
    for name, size in sorted(files.items()):
        if not re.fullmatch(r"(stage|rank)\d+\.pt", name):
            return f"its manifest names a file {name[:80]!r} that a checkpoint never holds"
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if size is not None and file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, {size} were written"
    return None


def read_manifest(path: Path) -> dict:
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise PipelineRunError(f"{path} is not a readable autopipe checkpoint ({exc})") from None
    if not isinstance(manifest, dict):
        raise PipelineRunError(f"{path / MANIFEST} does not hold a checkpoint manifest")
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise PipelineRunError(
            f"{path} is a {manifest.get('format')} version {manifest.get('version')} checkpoint; "
            f"this runtime reads {FORMAT} version {VERSION}"
        )
    for key, kind in (("step", int), ("stages", int), ("world_size", int), ("aliases", list)):
        if not isinstance(manifest.get(key), kind):
            raise PipelineRunError(
                f"{path / MANIFEST}: {key!r} is missing or not a {kind.__name__}"
            )
    return manifest


def merge_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The whole original-model state_dict held by a checkpoint directory (``DIR`` for its
    latest, or ``DIR/step-N``), and its manifest."""
    path = Path(path)
    if not (path / MANIFEST).is_file() and (path / "latest").is_file():
        path = latest_checkpoint(path)
    problem = damage(path)
    if problem:
        raise PipelineRunError(f"checkpoint {path} is damaged ({problem})")
    manifest = read_manifest(path)
    state: dict[str, torch.Tensor] = {}
    for index in range(manifest["stages"]):
        state.update(_load(path / f"stage{index}.pt", "cpu")["model"])
    expand_aliases(state, manifest["aliases"])
    return state, manifest


def _load(path: Path, device: torch.device | str) -> dict:
    """A checkpoint file, or PipelineRunError naming it when it is truncated or corrupted."""
    try:
        return torch.load(path, map_location=device, weights_only=True, mmap=True)
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
