"""Guards of a training run: the ranks agree on every problem, outputs are checked before the first
step, one run at a time owns a checkpoint directory, and a step whose loss or gradients are not
finite never reaches the weights.

Copied into every generated pipeline as ``runtime/guards.py``; it needs only torch.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .core.errors import PipelineRunError, first_line
from .core.manifest import changed_files
from .core.paths import names_a_directory
from .failures import error_log_directory
from .huggingface import directory_problem

__all__ = [
    "RankFailedError",
    "RunLock",
    "agree",
    "describe_write_error",
    "edited_files",
    "fallback_paths",
    "nonfinite_problem",
    "output_problems",
    "replace_atomically",
    "write_atomically",
]


class RankFailedError(PipelineRunError):
    """This rank stops because rank ``failed`` found a problem, which that rank prints."""

    def __init__(self, failed: int, message: str) -> None:
        super().__init__(message)
        self.failed = failed


def agree(problem: str | None) -> str | None:
    """Every rank's problem, gathered on all ranks (collective): ``None`` when no rank has one,
    else the first, prefixed by its rank. Lets every rank stop together instead of waiting for a
    rank that already gave up."""
    if dist.get_world_size() == 1:
        return problem
    problems: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    found = [(rank, p) for rank, p in enumerate(problems) if p is not None]
    if not found:
        return None
    rank, first = found[0]
    return first if len(found) == len(problems) else f"rank {rank}: {first}"


def describe_write_error(exc: BaseException, where: Path) -> str:
    """A write error in words: torch's writers say 'iostream error' when a disk is full."""
    text = first_line(exc)
    try:
        free = shutil.disk_usage(_existing_ancestor(where)).free
    except OSError:
        free = None
    if free is not None and free < 1 << 20:
        return f"the disk holding {where} is full ({free} bytes free; {text})"
    return text


# -- output paths -----------------------------------------------------------------------------
def _existing_ancestor(path: Path) -> Path:
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _writable_dir_problem(directory: Path) -> str | None:
    """Why files cannot be created in ``directory`` (or in the folders that would be made for
    it); None if they can. Tries a real write: permission bits say nothing to root or on a
    read-only mount."""
    base = _existing_ancestor(directory)
    if not base.is_dir():
        return f"{base} is a file, not a directory"
    probe = base / f".autopipe-write-test-{socket.gethostname()}-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        return f"cannot write in {base} ({exc.strerror or exc})"
    return None


def _replaced_file_problem(option: str, path: Path) -> str | None:
    """Why writing ``option``'s file would lose something (None if it would not): a file
    ``--save`` would replace (a model saved before, or anything else), or a ``--log-json`` file
    that is not a run's log of steps (a run starting afresh replaces its log, a resumed one keeps
    its steps before the checkpoint)."""
    if option == "--log-json" and is_step_log(path):
        return None
    what = "is not a log of a run's steps" if option == "--log-json" else "exists"
    return (
        f"{option} {path} {what}: the run would replace it; pass --force to replace it, or "
        "give another path"
    )


def is_step_log(path: Path) -> bool:
    """Whether ``path`` is empty or a run's ``--log-json`` log: its first line a JSON object of
    a step (``{"step": ...}``)."""
    try:
        if path.stat().st_size == 0:
            return True
        with path.open(encoding="utf-8") as lines:
            first = json.loads(lines.readline())
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(first, dict) and "step" in first


def output_problems(
    *,
    save: str | None,
    log_json: str | None,
    checkpoint_dir: str | None,
    tensorboard: str | None = None,
    save_directory: bool = False,
    trace: str | None = None,
    replace: bool = False,
    resuming: bool = False,
) -> list[str]:
    """What is wrong with the outputs this rank will write, before any training is done.
    ``save_directory``: ``save`` is a Hugging Face model directory, not a file. ``replace``
    (``--force``): ``save`` may replace a file or model directory there, and ``log_json`` a
    file that is not a run's log. ``resuming``: the run continues from a checkpoint of its own,
    and its ``save`` file (the run's, written when it ended before) may be replaced."""
    problems = []
    if save is not None and save_directory:  # a model directory, checked as one
        problem = directory_problem(
            Path(save), "--save", replace=replace, file_option="--save-format safetensors"
        )
        parent = None if problem else _writable_dir_problem(Path(save).parent)
        if problem or parent:
            problems.append(problem or f"--save {save}: {parent}")
        save = None
    for option, value, example in (
        ("--save", save, "model.safetensors"),
        ("--log-json", log_json, "log.jsonl"),
    ):
        if value is None:
            continue
        path = Path(value)
        if names_a_directory(value):
            problems.append(
                f"{option} {value} is a directory; give a file, e.g. {path / example}"
                + (
                    ", or --save-format hf for a transformers model's directory"
                    if option == "--save"
                    else ""
                )
            )
            continue
        problem = _writable_dir_problem(path.parent)
        if problem:
            problems.append(f"{option} {value}: {problem}")
        elif path.exists() and not replace and not (resuming and option == "--save"):
            problem = _replaced_file_problem(option, path)
            if problem:
                problems.append(problem)
    for option, directory in (
        ("--checkpoint-dir", checkpoint_dir),
        ("--tensorboard", tensorboard),
        ("--trace", trace),
    ):
        if directory is None:
            continue
        path = Path(directory)
        problem = (
            f"{path} is a file, not a directory"
            if path.exists() and not path.is_dir()
            else _writable_dir_problem(path)
        )
        if problem:
            problems.append(f"{option} {directory}: {problem}")
    return problems


def write_atomically(path: Path, text: str) -> None:
    """``text`` into ``path`` through a temporary file beside it and a rename: readers never
    see half of it, and a failed write leaves ``path`` as it was (:func:`replace_atomically`)."""
    replace_atomically(path, lambda temporary: temporary.write_text(text, encoding="utf-8"))


def replace_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """``path`` written by ``write(temporary)``, then renamed into place: the temporary is
    created beside ``path`` exclusively under a random name (``.NAME.*.tmp``, mode 0600 while
    it is written, so that no name planted there beforehand is followed or overwritten), given
    the mode a new file gets (the umask's), synced to disk and renamed over ``path`` (a link
    there is replaced, not followed). Readers never see half of it; when anything fails the
    temporary is removed and ``path`` is as it was, and a failed rename says so."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    temporary = Path(name)
    try:
        write(temporary)
        os.chmod(temporary, _new_file_mode())  # mkstemp makes it private; the output is not
        fd = os.open(temporary, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        _discard(temporary)
        raise
    try:
        os.replace(temporary, path)
    except OSError as exc:
        left = (
            "it was removed"
            if _discard(temporary)
            else f"it could not be removed: delete {temporary}"
        )
        raise OSError(
            exc.errno,
            f"could not rename the written temporary {temporary.name} to {path} "
            f"({exc.strerror or exc}); {left}, and {path} is as it was",
        ) from None


def _discard(temporary: Path) -> bool:
    """Remove ``temporary``; False if it could not be."""
    try:
        temporary.unlink(missing_ok=True)
    except OSError:
        return False
    return True


def _new_file_mode() -> int:
    """The mode a file created now gets: 0666 less the umask (read from /proc where it can be,
    which leaves the umask alone; else set for an instant to 077, never looser)."""
    try:
        for line in Path("/proc/self/status").read_text(encoding="utf-8").splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0o077)
    os.umask(umask)
    return 0o666 & ~umask


def fallback_paths(
    save: str, checkpoint_dir: str | None, step: int, directory: bool = False
) -> list[Path]:
    """Where the trained state goes when ``--save`` cannot be written, in order of preference
    (``directory``: it is written as a directory): ``trained-step-N`` in the checkpoint
    directory and in the working directory, then a new file (directory) of a unique name in this
    user's private directory of the temporary directory (:func:`error_log_directory`), created
    here, exclusively, so that nothing planted there beforehand is followed or overwritten and
    no other run takes the name (left out when it cannot be created)."""
    stem = f"trained-step-{step}"
    suffix = "-hf" if directory else Path(save).suffix or ".pt"
    places = [Path(checkpoint_dir)] if checkpoint_dir else []
    paths = [place / f"{stem}{suffix}" for place in [*places, Path.cwd()]]
    try:
        private = error_log_directory()
        if directory:
            paths.append(Path(tempfile.mkdtemp(prefix=f"{stem}-", suffix=suffix, dir=private)))
        else:
            fd, name = tempfile.mkstemp(prefix=f"{stem}-", suffix=suffix, dir=private)
            os.close(fd)
            paths.append(Path(name))
    except OSError:
        pass
    return paths


# -- one run per checkpoint directory ---------------------------------------------------------
def _process_start(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot), or None if it does not exist; tells
    a live owner from a later process that reused its pid."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


class RunLock:
    """``DIR/.lock``: which run (host, pid) trains into a checkpoint directory. A second run is
    refused while the first lives; a lock whose process is gone (on this host) is stale and taken
    over. Held by global rank 0."""

    def __init__(self, root: str | Path):
        self.path = Path(root) / ".lock"
        self.held = False

    def acquire(self) -> str | None:
        """Take the lock; returns a note when a stale lock was taken over. Raises
        PipelineRunError while another run holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        note = None
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = self._owner()
                if not self._stale(owner):
                    raise PipelineRunError(self._busy(owner)) from None
                note = f"took over the stale lock of a run that ended ({self._who(owner)})"
                self.path.unlink(missing_ok=True)
                continue
            me = {
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "start": _process_start(os.getpid()),
            }
            me["since"] = time.strftime("%Y-%m-%d %H:%M:%S")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(json.dumps(me) + "\n")
                f.flush()
                os.fsync(f.fileno())
            self.held = True
            return note
        raise PipelineRunError(f"{self.path}: another run took the lock at the same time")

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False

    def _owner(self) -> dict[str, Any] | None:
        try:
            owner = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return owner if isinstance(owner, dict) else None

    def _stale(self, owner: dict[str, Any] | None) -> bool:
        if owner is None:  # unreadable: stale unless it is being written right now
            try:
                return time.time() - self.path.stat().st_mtime > 10
            except FileNotFoundError:
                return True
        if owner.get("host") != socket.gethostname() or not isinstance(owner.get("pid"), int):
            return False  # another host's process cannot be seen from here
        return _process_start(owner["pid"]) != owner.get("start")

    @staticmethod
    def _who(owner: dict[str, Any] | None) -> str:
        if owner is None:
            return "owner unknown"
        return f"pid {owner.get('pid')} on {owner.get('host')} since {owner.get('since')}"

    def _busy(self, owner: dict[str, Any] | None) -> str:
        return (
            f"--checkpoint-dir {self.path.parent} is in use by another training run "
            f"({self._who(owner)}); give this run another --checkpoint-dir, or wait for that one "
            f"to end. If no such run lives (it ran on another host and was killed), delete {self.path}"
        )


# -- non-finite steps -------------------------------------------------------------------------
def nonfinite_problem(
    step: int, loss: float | None, grad_norm: float, device: torch.device
) -> str | None:
    """Why this step must not reach the weights, or None (collective over every rank): ``loss``
    is known on last-stage ranks (None elsewhere), the gradient norm everywhere."""
    bad = torch.tensor(
        [float(loss is not None and not math.isfinite(loss)), float(not math.isfinite(grad_norm))],
        device=device,
    )
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    bad_loss, bad_norm = bool(bad[0]), bool(bad[1])
    if not (bad_loss or bad_norm):
        return None
    what = " and ".join(
        (["the loss"] if bad_loss else [])
        + ([f"the gradient norm ({grad_norm})"] if bad_norm else [])
    )
    return (
        f"step {step}: {what} is not finite. The step was not applied and no checkpoint was "
        "written from it. Usual causes: a learning rate too high (lower --lr, add --warmup-steps "
        "or --clip-grad-norm), or a batch whose labels are all the ignore index (-100). "
        "--skip-nonfinite skips such steps instead of stopping"
    )


# -- the package's own files ------------------------------------------------------------------
def edited_files(directory: Path) -> list[str]:
    """The files of a generated package that differ from (or are missing against) the SHA-256
    its ``manifest.json`` records, by relative path; none when it has no readable manifest
    (``autopipe verify`` checks the manifest itself)."""
    try:
        manifest = json.loads((directory / "manifest.json").read_text(encoding="utf-8"))
        digests = manifest["files"]
        if not isinstance(digests, dict):
            return []
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return changed_files(directory, {str(rel): str(digest) for rel, digest in digests.items()})
