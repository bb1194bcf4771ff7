"""Hangs explained: when a rank waits longer than ``--timeout``, or on SIGUSR1 to any rank, every
rank that can still answer reports what it is doing and its Python stack, and one rank prints a
diagnosis.

Copied into every generated pipeline as ``runtime/hangs.py``; it needs only torch. Each rank
runs a :class:`HangWatch`: a daemon thread that never needs the main thread, which may be
blocked inside a collective or a transfer (in C++, where no Python signal handler runs). SIGUSR1
reaches the thread through the signal module's wake-up file descriptor; the rank's current
action (``activity.ACTIVITY``) says how long it has waited; ``sys._current_frames`` gives the
main thread's stack. The ranks exchange their :class:`RankReport` through the store torchrun's
agent keeps (``failures.agent_store``), which outlives the ranks: a request is a counter that
every watcher polls every :data:`POLL_SECONDS`; the rank that asked waits up to
:data:`ANSWER_WAIT` for the answers, then prints one diagnosis (:func:`diagnosis`, on stderr):
the wait-for chain, the ranks that did not answer, the likely cause (a dead or stopped rank, a
collective or transfer issued by some ranks only, a data-dependent shape mismatch, ranks
waiting for each other, slow data loading, slow work) and what to do, then the stacks. The
first preparation of a dataset file (``activity.UNTIMED``) is not limited by ``--timeout``: no
rank waits for it in a collective. A timeout is diagnosed by
the first rank to notice it (one diagnosis per step); the process group gives up
:data:`DIAGNOSIS_MARGIN` seconds after ``--timeout``, so the diagnosis comes out first and the
run then stops as it always did. SIGUSR1 is diagnosed by the rank it reached; the run goes on.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from .activity import ACTIVITY, READING, UNTIMED, Action, Activity, rank_list
from .core.fields import FieldReader, is_object
from .core.timeline_format import TRANSFERS  # a transfer's creation: its peers wait
from .failures import agent_store, attempt_prefix

__all__ = [
    "ANSWER_WAIT",
    "DIAGNOSIS_MARGIN",
    "POLL_SECONDS",
    "Frame",
    "HangReportError",
    "HangWatch",
    "RankReport",
    "diagnosis",
]

#: how often each rank's watcher looks at its clock and at the store's requests
POLL_SECONDS = 1.0
#: how long the diagnosing rank waits for the other ranks' answers
ANSWER_WAIT = 4.0
#: seconds between --timeout (a diagnosis) and the process group's timeout (the run stops)
DIAGNOSIS_MARGIN = 10.0
#: frames a report keeps, innermost first: of user code, of the runtime, of libraries
_KEEP = {"user": 8, "runtime": 4, "library": 1}
#: at most this many ranks' stacks are printed
_STACKS_SHOWN = 32


class HangReportError(ValueError):
    """A rank's report that breaks its format; the message names the first bad field."""


_read = FieldReader(HangReportError, "a hang report")


@dataclass(frozen=True)
class Frame:
    """A frame of a rank's main thread: where, and whose code it is (``user``: the model's
    stages and the user's own files; ``runtime``: the generated package's driver;
    ``library``: torch and the standard library)."""

    file: str
    line: int
    function: str
    code: str
    origin: str

    KEYS = ("file", "line", "function", "code", "origin")

    @property
    def where(self) -> str:
        """``FILE:LINE``, the file relative to the working directory when inside it."""
        path = Path(self.file)
        try:
            path = path.relative_to(Path.cwd())
        except ValueError:
            pass
        return f"{path}:{self.line}"

    def to_json(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in self.KEYS}

    @classmethod
    def from_json(cls, data: object, where: str) -> Frame:
        fields = _read.fields(data, where, cls.KEYS)
        origin = _read.check(
            fields["origin"], f"{where}.origin", _KEEP.__contains__, f"one of {list(_KEEP)}"
        )
        return cls(
            file=_read.text(fields["file"], f"{where}.file"),
            line=_read.integer(fields["line"], f"{where}.line", minimum=0),
            function=_read.text(fields["function"], f"{where}.function"),
            code=_read.text(fields["code"], f"{where}.code"),
            origin=origin,
        )


def _action(data: object, where: str) -> Action | None:
    """The action of :meth:`Action.to_json`'s object ``data`` (None for null)."""
    return None if data is None else Action.from_json(data, where, _read)


@dataclass(frozen=True)
class RankReport:
    """What one rank answers: who it is (rank, host, process id, stages), its current action
    (None outside any: before the first step, after the last) and the one it left last, how
    long it has been in it, and its main thread's stack (trimmed, innermost frame first)."""

    rank: int
    host: str
    pid: int
    stages: tuple[int, ...]
    action: Action | None
    after: Action | None
    seconds: float
    stack: tuple[Frame, ...]

    KEYS = ("rank", "host", "pid", "stages", "action", "after", "seconds", "stack")

    def to_json(self) -> str:
        """Compact: one line, fields in a fixed order."""
        data = {
            "rank": self.rank,
            "host": self.host,
            "pid": self.pid,
            "stages": list(self.stages),
            "action": self.action.to_json() if self.action is not None else None,
            "after": self.after.to_json() if self.after is not None else None,
            "seconds": self.seconds,
            "stack": [frame.to_json() for frame in self.stack],
        }
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> RankReport:
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise HangReportError(f"not JSON: {exc}") from None
        where = "report"
        fields = _read.fields(data, where, cls.KEYS)
        stack = _read.items(fields["stack"], f"{where}.stack", is_object, "frame")
        return cls(
            rank=_read.integer(fields["rank"], f"{where}.rank", minimum=0),
            host=_read.text(fields["host"], f"{where}.host"),
            pid=_read.integer(fields["pid"], f"{where}.pid", minimum=0),
            stages=_read.ints(fields["stages"], f"{where}.stages"),
            action=_action(fields["action"], f"{where}.action"),
            after=_action(fields["after"], f"{where}.after"),
            seconds=_read.number(fields["seconds"], f"{where}.seconds", minimum=0),
            stack=tuple(Frame.from_json(f, f"{where}.stack[{i}]") for i, f in enumerate(stack)),
        )

    @property
    def label(self) -> str:
        """``rank 3 (stage 3, pid 812 on node-1)``."""
        stages = ", ".join(str(s) for s in self.stages)
        return (
            f"rank {self.rank} (stage{'s' if len(self.stages) != 1 else ''} {stages}, "
            f"pid {self.pid} on {self.host})"
        )

    @property
    def where(self) -> str | None:
        """``FILE:LINE`` of the innermost frame of user code, else of the runtime."""
        for origin in ("user", "runtime"):
            for frame in self.stack:
                if frame.origin == origin:
                    return frame.where
        return None

    def doing(self) -> str:
        """What the rank does and for how long, in words."""
        if self.action is None:
            return "is not in a training step (not started, or done)"
        text = f"{self.action.describe()} for {_seconds(self.seconds)}"
        if self.after is not None:
            text += f", after {self.after.what()}"
        return text


# -- the stack of the main thread --------------------------------------------------------------
_RUNTIME = Path(__file__).resolve().parent
_PACKAGE_ENTRY = _RUNTIME.parent / "train.py"
_LIBRARIES = tuple(
    {
        str(Path(torch.__file__).resolve().parent),
        *(
            str(Path(sysconfig.get_paths()[key]).resolve())
            for key in ("stdlib", "platstdlib", "purelib", "platlib")
        ),
    }
)


def _origin(file: str) -> str:
    path = Path(file).resolve() if not file.startswith("<") else Path(file)
    if path == _PACKAGE_ENTRY or _RUNTIME in path.parents:
        return "runtime"
    if file.startswith("<frozen") or any(str(path).startswith(lib) for lib in _LIBRARIES):
        return "library"
    return "user"


def _stack(frame: FrameType | None) -> tuple[Frame, ...]:
    """A thread's frames, innermost first: where it waits when that is library code (one
    frame), then at most ``_KEEP`` frames of user code and of the runtime. Frames around the
    runtime's (an entry script, a launcher) are left out."""
    if frame is None:
        return ()
    summaries = traceback.extract_stack(frame)
    origins = [_origin(summary.filename) for summary in summaries]
    first = origins.index("runtime") if "runtime" in origins else 0
    kept: list[Frame] = []
    left = dict(_KEEP)
    for index in reversed(range(first, len(summaries))):
        origin, summary = origins[index], summaries[index]
        if origin == "library" and kept:  # only where the thread waits, innermost
            continue
        if left[origin]:
            left[origin] -= 1
            kept.append(
                Frame(
                    summary.filename,
                    summary.lineno or 0,
                    summary.name,
                    (summary.line or "").strip(),
                    origin,
                )
            )
    return tuple(kept)


# -- the diagnosis -----------------------------------------------------------------------------
def _seconds(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 100 else f"{seconds:.0f} s"


def _alongside(other: RankReport | None, action: Action) -> bool:
    """Whether ``other`` waits in the same collective as ``action``: of the same kind and step,
    over the same ranks (in any order)."""
    mine = other.action if other is not None else None
    return (
        mine is not None
        and mine.kind == action.kind
        and mine.step == action.step
        and sorted(mine.ranks) == sorted(action.ranks)
    )


def _waits_for(report: RankReport, reports: Mapping[int, RankReport]) -> tuple[int, ...]:
    """The ranks ``report``'s rank waits for: a transfer's peers, or the ranks of its collective
    that are not in it alongside."""
    action = report.action
    if action is None:
        return ()
    if action.kind in TRANSFERS:
        return tuple(dict.fromkeys(action.peers))
    return tuple(
        r for r in action.ranks if r != report.rank and not _alongside(reports.get(r), action)
    )


def _later(other: Action | None, action: Action) -> bool:
    """Whether a rank at ``other`` went past ``action`` (not in a step: done with them)."""
    return other is None or (other.step, other.order) > (action.step, action.order)


def _shapes_with(action: Action, peer: int) -> list[list[int]]:
    """The shapes a transfer sends to or receives from ``peer``."""
    return [list(s) for p, s in zip(action.peers, action.shapes) if p == peer]


def _listed(shapes: list[list[int]]) -> str:
    return ", ".join(str(shape) for shape in shapes) or "nothing"


#: the send that a receive waits for
_SENDER = {"recv_activation": "send_activation", "recv_gradient": "send_gradient"}


def _cause(
    reports: Mapping[int, RankReport],
    missing: Mapping[int, RankReport | None],
    waits: Mapping[int, tuple[int, ...]],
) -> tuple[str, str]:
    """The likely cause of the ranks' waiting, and what to do, in words."""
    waiting = {r: targets for r, targets in sorted(waits.items()) if targets}
    gone = sorted({t for targets in waiting.values() for t in targets if t in missing})
    if gone:
        waiters = [r for r, targets in waiting.items() if set(targets) & set(gone)]
        known = [missing[r] for r in gone if missing[r] is not None]
        look = "; ".join(f"py-spy dump --pid {r.pid} on {r.host}" for r in known if r)
        return (
            f"a dead or stopped rank: {rank_list(gone)} did not answer within {ANSWER_WAIT:g} s "
            f"while {rank_list(waiters)} wait{'s' if len(waiters) == 1 else ''} for "
            f"{'it' if len(gone) == 1 else 'them'}",
            "a process stopped (SIGSTOP, a debugger), killed (look for the OOM killer in its "
            "host's kernel log) or stuck in native code that holds Python's lock looks like "
            f"this; look at {'it' if len(gone) == 1 else 'them'}" + (f" ({look})" if look else ""),
        )
    for rank, targets in waiting.items():
        action = reports[rank].action
        assert action is not None  # it waits
        for target in targets:
            other = reports[target].action if target in reports else None
            if action.kind not in _SENDER or other is None or other.kind != _SENDER[action.kind]:
                continue
            sent, expected = _shapes_with(other, rank), _shapes_with(action, target)
            if other.microbatch == action.microbatch and sent != expected:
                return (
                    f"a data-dependent shape mismatch: rank {target} {other.describe()} shaped "
                    f"{_listed(sent)}, and rank {rank} receives it into "
                    f"{'a buffer' if len(expected) == 1 else 'buffers'} of {_listed(expected)}",
                    "the pipeline's buffers have the shapes it was compiled for; compile with "
                    "--dynamic for the dimension that varies, or pad the batches to one shape",
                )
    for rank, targets in waiting.items():
        action = reports[rank].action
        assert action is not None  # it waits
        for target in targets:
            if target not in reports or not _later(reports[target].action, action):
                continue
            past = reports[target]
            what = "transfer" if action.kind in TRANSFERS else "collective"
            return (
                f"a {what} issued by some ranks only: rank {rank} {action.describe()}, which "
                f"rank {target} went past without taking part: it {past.doing()}",
                f"every rank must issue the same {what}s in the same order; look at rank "
                f"{target}'s code (its stack is below) for one that runs on some ranks only, "
                "under a condition on the rank or on the data",
            )
    for start in waiting:
        path = [start]
        while waits.get(path[-1]):
            following = next((t for t in waits[path[-1]] if t in reports), None)
            if following is None:
                break
            if following in path:
                cycle = path[path.index(following) :] + [following]
                return (
                    "ranks that wait for each other: " + " -> ".join(f"rank {r}" for r in cycle),
                    "these ranks issue their transfers or collectives in different orders; run "
                    "every rank with the same options and code",
                )
            path.append(following)
        end = path[-1]
        if end in reports and not waits.get(end) and reports[end].action is not None:
            report = reports[end]
            at = f" at {report.where}" if report.where else ""
            if report.action is not None and report.action.kind in READING:
                return _slow_data(report, f"the wait ends at rank {end}, which")
            return (
                f"slow or stuck work, not communication: the wait ends at rank {end}, which "
                f"{report.doing()}{at} and waits for no one",
                "look at what that code does (its stack is below): a loop that depends on the "
                "data, a slow --data function, input or output, a lock",
            )
    reading = [r for r in reports.values() if r.action is not None and r.action.kind in READING]
    if reading:  # no one waits for it yet: the rank reading data noticed its own timeout
        return _slow_data(reading[0], f"rank {reading[0].rank}")
    return "none: no rank waits for another", "nothing"


def _slow_data(report: RankReport, who: str) -> tuple[str, str]:
    """The likely cause where data loading holds the run up: ``who`` (the words before the
    rank's doing) reads data."""
    at = f" at {report.where}" if report.where else ""
    return (
        f"slow data loading: {who} {report.doing()}{at}",
        "a step's batch must be read within --timeout SECONDS, which this one was not (a "
        "dataset file's first reading and tokenizing, before the first step, has no limit): "
        "raise --timeout, or make the --data function (or its dataset's items) faster; for a "
        "dataset file, tokenize it ahead of time (an input_ids column)",
    )


def _chains(
    reports: Mapping[int, RankReport],
    missing: Mapping[int, RankReport | None],
    waits: Mapping[int, tuple[int, ...]],
) -> list[str]:
    """The wait-for chains, one line per rank along each: from the ranks that no other waits
    for (any rank, where they all wait in a circle), to a rank that does not wait, or did not
    answer, or was already shown."""
    waiting = [r for r in sorted(reports) if waits[r]]
    targeted = {t for r in waiting for t in waits[r]}
    heads = [r for r in waiting if r not in targeted] or waiting[:1]
    lines: list[str] = []
    shown: set[int] = set()
    for head in heads:
        rank, arrow = head, "    "
        while True:
            if rank in missing:
                lines.append(f"{arrow}rank {rank} did not answer")
                break
            if rank in shown:
                lines.append(f"{arrow}rank {rank} (see above)")
                break
            shown.add(rank)
            report = reports[rank]
            targets = waits[rank]
            text = f"{arrow}rank {rank} {report.doing()}"
            if not targets:
                lines.append(text + (f" at {report.where}" if report.where else ""))
                break
            if report.action is not None and report.action.kind not in TRANSFERS:
                text += f"; {rank_list(targets)} {'is' if len(targets) == 1 else 'are'} not in it"
            lines.append(text)
            following = next((t for t in targets if t in missing), None)
            if following is None:  # none missing: the first not shown yet
                following = next((t for t in targets if t not in shown), targets[0])
            rank = following
            arrow = "    -> "
    return lines


def _stacks(reports: Mapping[int, RankReport]) -> list[str]:
    """Each rank's stack, user code first, then the runtime, then where it waits in a library;
    a stack already shown is named, not repeated."""
    lines: list[str] = []
    seen: dict[tuple[Frame, ...], int] = {}
    for rank in sorted(reports)[:_STACKS_SHOWN]:
        report = reports[rank]
        lines.append(f"    {report.label}: {report.doing()}")
        frames = report.stack
        if frames in seen:
            lines.append(f"      the same stack as rank {seen[frames]}")
            continue
        seen[frames] = rank
        ordered = sorted(frames, key=lambda f: list(_KEEP).index(f.origin))  # stable: innermost
        for frame in ordered:
            code = f": {frame.code}" if frame.code else ""
            lines.append(f"      {frame.where} in {frame.function}{code}")
    if len(reports) > _STACKS_SHOWN:
        lines.append(f"    ... and {len(reports) - _STACKS_SHOWN} more ranks")
    return lines


def diagnosis(
    trigger: str,
    reports: Mapping[int, RankReport],
    missing: Mapping[int, RankReport | None],
    *,
    stops: bool,
) -> str:
    """The diagnosis a rank prints, one block: ``trigger`` (what asked for it), the wait-for
    chain, the ranks that did not answer (``missing``: with what they said when they started,
    where they did), the likely cause and what to do, and the stacks of the ranks that answered
    (``reports``). ``stops``: the run stops after it (a timeout), else it goes on."""
    waits = {rank: _waits_for(report, reports) for rank, report in reports.items()}
    lines = [f"train.py: hang diagnosis: {trigger}"]
    chains = _chains(reports, missing, waits)
    lines += ["  wait-for chain:", *chains] if chains else ["  no rank waits for another"]
    if missing:
        described = [
            report.label if report is not None else f"rank {rank}"
            for rank, report in sorted(missing.items())
        ]
        lines.append(f"  did not answer within {ANSWER_WAIT:g} s: {', '.join(described)}")
    cause, advice = _cause(reports, missing, waits)
    lines.append(f"  likely cause: {cause}")
    if advice != "nothing":
        lines.append(f"  what to do: {advice}")
    lines.append("  stacks (innermost call first: user code, then train.py's runtime, then torch):")
    lines += _stacks(reports)
    lines.append(
        f"  the waiting ranks give up {DIAGNOSIS_MARGIN:g} s after --timeout (the process "
        "group's timeout) unless the run moves on by then"
        if stops
        else "  SIGUSR1 only asked for this diagnosis: the run goes on"
    )
    return "\n".join(lines) + "\n"


# -- the watcher -------------------------------------------------------------------------------
def _ignore(_signum: int, _frame: Any) -> None:
    """SIGUSR1's handler in the main thread: the watcher thread answers it."""


class HangWatch:
    """This rank's watcher: :meth:`start` (in the main thread) installs the SIGUSR1 handler and
    starts the thread; :meth:`stop` ends it and restores the handler. Any trouble with the store
    leaves the run alone: a diagnosis then covers the ranks that could answer."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        stages: tuple[int, ...],
        timeout: float,
        activity: Activity = ACTIVITY,
    ) -> None:
        self.rank, self.world_size, self.stages = rank, world_size, stages
        self.timeout = timeout
        self.activity = activity
        self.prefix = f"{attempt_prefix()}hang/"
        self._store: dist.Store | None = None
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._main = threading.main_thread().ident
        self._wake, self._wake_write = socket.socketpair()
        self._wake.setblocking(False)
        self._wake_write.setblocking(False)
        self._restore: tuple[Any, int] | None = None  # SIGUSR1's handler, the wake-up fd
        self._noticed: object = None  # the stuck action already noticed
        self._answered = 0  # the requests answered so far
        self._warned = False  # a failing store has been said to fail

    def start(self) -> None:
        try:
            handler = signal.signal(signal.SIGUSR1, _ignore)
            fd = signal.set_wakeup_fd(self._wake_write.fileno(), warn_on_full_buffer=False)
            self._restore = (handler, fd)
        except ValueError:  # not the main thread: no SIGUSR1, the timeout still watched
            pass
        self._thread = threading.Thread(target=self._run, name="autopipe-hang-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ends the watch without waiting for it: a rank that fails must say so at once (the
        thread wakes, sees it is stopped and ends; a diagnosis under way is left to finish)."""
        self._stopped.set()
        try:
            self._wake_write.send(b"\0")
        except OSError:  # the wake-up buffer is full: the thread wakes all the same
            pass
        if self._restore is not None:
            handler, fd = self._restore
            signal.set_wakeup_fd(fd)
            signal.signal(signal.SIGUSR1, handler)
            self._restore = None
        if self._thread is not None:
            self._thread.join(timeout=0.1)
            if not self._thread.is_alive():
                self._wake.close()
                self._wake_write.close()

    # -- the thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        self._store = agent_store(self.world_size)
        self._guarded(lambda: self._set(f"who/{self.rank}", self._report()))
        while not self._stopped.is_set():
            signalled = self._wait(POLL_SECONDS)
            if self._stopped.is_set():
                return
            if signalled:
                self._guarded(lambda: self._diagnose(f"SIGUSR1 to rank {self.rank}", stops=False))
            stuck = self._stuck()
            if stuck is not None:
                self._guarded(lambda: self._diagnose_timeout(*stuck))
            self._guarded(self._answer)

    def _guarded(self, work: Callable[[], None]) -> None:
        """``work()``; the store failing (the agent gone) ends nothing but this attempt (said
        once)."""
        try:
            work()
        except (RuntimeError, OSError, ValueError) as exc:
            if not self._stopped.is_set() and not self._warned:
                self._warned = True
                print(f"train.py: note: rank {self.rank}'s hang watch: {exc}", file=sys.stderr)

    def _wait(self, seconds: float) -> bool:
        """Sleeps ``seconds`` at most; whether SIGUSR1 arrived meanwhile."""
        try:
            ready, _, _ = select.select([self._wake], [], [], seconds)
            data = self._wake.recv(64) if ready else b""
        except (OSError, ValueError):  # a socket closed under it
            return False
        return signal.SIGUSR1 in data

    def _stuck(self) -> tuple[Action, float] | None:
        """The current action and its age, the first time the rank has been in it longer
        than --timeout."""
        now = self.activity.now
        if now is None or now is self._noticed or now[0].kind in UNTIMED:
            return None
        action, since, _after = now
        age = (time.monotonic_ns() - since) / 1e9
        if age <= self.timeout:
            return None
        self._noticed = now
        return action, age

    # -- the store -----------------------------------------------------------------------------
    def _set(self, key: str, report: RankReport) -> None:
        if self._store is not None:
            self._store.set(self.prefix + key, report.to_json())

    def _report(self) -> RankReport:
        now = self.activity.now
        action, since, after = now if now is not None else (None, time.monotonic_ns(), None)
        frame = sys._current_frames().get(self._main) if self._main is not None else None
        return RankReport(
            rank=self.rank,
            host=socket.gethostname(),
            pid=os.getpid(),
            stages=self.stages,
            action=action,
            after=after,
            seconds=round((time.monotonic_ns() - since) / 1e9, 3),
            stack=_stack(frame),
        )

    def _answer(self) -> None:
        """Answers every request made since the last answer."""
        if self._store is None:
            return
        asked = self._store.add(f"{self.prefix}asked", 0)
        if asked > self._answered:
            report = self._report()
            for request in range(self._answered + 1, asked + 1):
                self._set(f"{request}/{self.rank}", report)
                self._store.add(f"{self.prefix}{request}/answers", 1)
            self._answered = asked

    def _diagnose_timeout(self, action: Action, age: float) -> None:
        """The first rank to notice a timeout in a step diagnoses it; the others only answer."""
        if self._store is not None:
            if self._store.add(f"{self.prefix}timeout/{action.step}", 1) != 1:
                return
        self._diagnose(
            f"rank {self.rank} {action.describe()} for {_seconds(age)}, longer than "
            f"--timeout {self.timeout:g} s",
            stops=True,
        )

    def _diagnose(self, trigger: str, stops: bool) -> None:
        """Asks every rank, waits for their answers (:data:`ANSWER_WAIT` at most) and prints
        the diagnosis."""
        store = self._store
        if store is None:
            sys.stderr.write(diagnosis(trigger, {self.rank: self._report()}, {}, stops=stops))
            sys.stderr.flush()
            return
        request = store.add(f"{self.prefix}asked", 1)
        self._answer()
        deadline = time.monotonic() + ANSWER_WAIT
        while store.add(f"{self.prefix}{request}/answers", 0) < self.world_size:
            if time.monotonic() > deadline or self._stopped.is_set():
                break
            time.sleep(0.1)
            self._answer()  # another rank's request meanwhile
        reports: dict[int, RankReport] = {}
        missing: dict[int, RankReport | None] = {}
        for rank in range(self.world_size):
            answer = self._read(f"{request}/{rank}")
            if answer is not None:
                reports[rank] = answer
            else:  # what it said when it started, if it did
                missing[rank] = self._read(f"who/{rank}")
        sys.stderr.write(diagnosis(trigger, reports, missing, stops=stops))
        sys.stderr.flush()

    def _read(self, key: str) -> RankReport | None:
        """The report under ``key``, or None if there is none (or it is unreadable)."""
        store = self._store
        if store is None or not store.check([self.prefix + key]):
            return None
        try:
            return RankReport.from_json(store.get(self.prefix + key))
        except HangReportError:
            return None
