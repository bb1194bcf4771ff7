"""An exclusive lock on an output directory while autopipe writes it, so that of two compiles
started into one ``--out`` at once, one writes and the other refuses, instead of both saying
"wrote" when one result replaced the other.

The lock is a file beside the directory, ``.NAME.autopipe-lock``, created atomically
(``O_CREAT | O_EXCL``) and holding who holds it (pid, host, since when) as JSON. It is removed
when the writing ends, however it ends. A lock whose process is gone (on this host) is taken
over, with a note; one held on another host is never guessed dead. A process may take a lock it
holds again (a compile holds it over all its steps, and writing the package takes it again).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

from ..artifacts import write_error
from ..errors import OutputLockedError

__all__ = ["LockHolder", "lock_path", "output_lock", "check_unlocked", "pid_alive"]

LOCK_SUFFIX = ".autopipe-lock"
#: a lock file that cannot be read yet is one being created, unless it is older than this
UNREADABLE_GRACE_SECONDS = 10.0
#: times a lock found stale or released meanwhile is tried again before giving up
ATTEMPTS = 5

#: lock path -> (thread holding it, how many times it took it) in this process
_held: dict[Path, tuple[int, int]] = {}
_held_guard = threading.Lock()


@dataclass(frozen=True)
class LockHolder:
    """Who holds an output directory's lock."""

    pid: int
    host: str
    since: str  # local time, ISO 8601

    @classmethod
    def this_process(cls) -> LockHolder:
        since = datetime.now().astimezone().isoformat(timespec="seconds")
        return cls(os.getpid(), socket.gethostname(), since)

    @classmethod
    def parse(cls, text: str) -> LockHolder | None:
        """The holder a lock file names, or None if it is not a lock autopipe wrote (yet)."""
        try:
            data = json.loads(text)
            holder = cls(**data)
        except (ValueError, TypeError):
            return None
        valid = isinstance(holder.pid, int) and isinstance(holder.host, str)
        return holder if valid and isinstance(holder.since, str) else None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    def alive(self) -> bool:
        """Whether its process may still run: certainly gone only on this host."""
        return self.host != socket.gethostname() or pid_alive(self.pid)

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}, since {self.since}"


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host (a zombie, exited but not yet reaped, does not)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # another user's process
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # no /proc (not Linux), or it exited meanwhile
        return True
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


def lock_path(out: str | os.PathLike) -> Path:
    """The lock file of output directory ``out``: beside it, named after it."""
    out = Path(os.path.abspath(out))
    return out.parent / f".{out.name}{LOCK_SUFFIX}"


def _holds(path: Path) -> bool:
    """Whether this thread holds the lock at ``path``."""
    with _held_guard:
        holder = _held.get(path)
    return holder is not None and holder[0] == threading.get_ident()


def check_unlocked(out: str | os.PathLike) -> None:
    """Refuse ``out`` while another autopipe process writes it (a stale lock is no refusal:
    :func:`output_lock` takes it over)."""
    path = lock_path(out)
    if _holds(path):
        return
    text = _read(path)
    if text is not None and not _stale(path, text):
        raise _busy(Path(out), path, LockHolder.parse(text))


@contextlib.contextmanager
def output_lock(
    out: str | os.PathLike, note: Callable[[str], None] | None = None
) -> Iterator[Path]:
    """Hold the lock of output directory ``out`` for the ``with`` block (yields the lock file);
    ``note`` tells of a stale lock taken over (default: printed to stderr). Raises
    :class:`OutputLockedError` if another process holds it. Folders created for the lock file
    are removed again when nothing else was written into them."""
    out = Path(out)
    path = lock_path(out)
    ident = threading.get_ident()
    with _held_guard:
        holder = _held.get(path)
        if holder is not None and holder[0] == ident:
            _held[path] = (ident, holder[1] + 1)
    if holder is not None and holder[0] == ident:
        try:
            yield path
        finally:
            with _held_guard:
                _held[path] = (ident, _held[path][1] - 1)
        return
    if holder is not None:  # another thread of this process writes it
        raise _busy(out, path, LockHolder.parse(_read(path) or ""))
    created = _missing_folders(path.parent)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _acquire(out, path, note or _print_note)
    except OSError as exc:
        _remove_empty(created)
        raise write_error(out, exc, "nothing was written") from exc
    except BaseException:
        _remove_empty(created)
        raise
    with _held_guard:
        _held[path] = (ident, 1)
    try:
        yield path
    finally:
        with _held_guard:
            del _held[path]
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        _remove_empty(created)


def _acquire(out: Path, path: Path, note: Callable[[str], None]) -> None:
    for _ in range(ATTEMPTS):
        try:
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            pass
        else:
            with os.fdopen(descriptor, "w", encoding="utf-8") as lock:
                lock.write(LockHolder.this_process().to_json() + "\n")
            return
        text = _read(path)
        if text is None:
            continue  # released meanwhile
        if not _stale(path, text):
            raise _busy(out, path, LockHolder.parse(text))
        if _remove_if_unchanged(path, text):
            holder = LockHolder.parse(text)
            who = holder.describe() if holder else "an unreadable lock file"
            note(f"note: took over the lock of {out} from {who}, which no longer runs")
    raise OutputLockedError(
        f"{out} is being written by other autopipe compiles that keep taking its lock {path}; "
        "wait for them to finish or choose another --out"
    )


def _stale(path: Path, text: str) -> bool:
    """Whether the lock reading ``text`` is left over from a process that is gone."""
    holder = LockHolder.parse(text)
    if holder is None:  # being written this instant, or a crash left it so
        try:
            age = time.time() - path.stat().st_mtime
        except FileNotFoundError:
            return True
        return age > UNREADABLE_GRACE_SECONDS
    return not holder.alive()


def _remove_if_unchanged(path: Path, text: str) -> bool:
    """Remove the stale lock at ``path`` if it still reads ``text`` (no other process took it
    over meanwhile): moved aside first, atomically, then checked."""
    aside = path.with_name(f"{path.name}.stale-{os.getpid()}-{threading.get_ident()}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False  # another process took it over first
    try:
        if aside.read_text(encoding="utf-8") == text:
            return True
        with contextlib.suppress(FileExistsError):  # a fresh lock: put it back
            os.link(aside, path)
        return False
    finally:
        aside.unlink()


def _busy(out: Path, path: Path, holder: LockHolder | None) -> OutputLockedError:
    if holder is None:
        return OutputLockedError(
            f"{out} is being written by another autopipe compile (its lock {path} is being "
            "created); wait for it to finish or choose another --out"
        )
    elsewhere = ""
    if holder.host != socket.gethostname():
        elsewhere = f" (if no autopipe runs there any more, delete {path})"
    return OutputLockedError(
        f"{out} is being written by another autopipe compile ({holder.describe()}); wait for it "
        f"to finish or choose another --out{elsewhere}"
    )


def _read(path: Path) -> str | None:
    """The lock file's text, or None if there is none."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError):
        return ""


def _missing_folders(folder: Path) -> list[Path]:
    """``folder`` and those of its parents that do not exist, innermost first."""
    missing = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing


def _remove_empty(folders: list[Path]) -> None:
    """Remove ``folders`` (innermost first) while they are empty."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


def _print_note(message: str) -> None:
    print(f"autopipe: {message}", file=sys.stderr)
