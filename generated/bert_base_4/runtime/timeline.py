"""The measured timeline of a training run (``train.py --trace DIR --trace-steps A:B``).

Copied into every generated pipeline as ``runtime/timeline.py``; it needs only torch. A
:class:`Timeline` on each rank records when every schedule action of the traced steps starts and
ends: each stage's forward, full backward, input backward and weight backward of each microbatch
(:class:`~.parallel.DataParallelStage` reports them when a timeline is attached), the
data-parallel gradient reduction the schedule runs after the last backward (FSDP2's, per stage),
the gradient reduction of the step (scaling, tied sums, the norm and clipping), each stage's
optimizer step and the step itself; the creation of send and receive operations is recorded as
instants, with the peer rank. On CPU the clock is ``CLOCK_MONOTONIC`` (system-wide: the ranks of
one host agree on it); on CUDA each interval is a pair of timing events, resolved once at the
end of a traced step and placed on the host clock by a reference event recorded at a known host
time. Ranks on other hosts than global rank 0 are aligned by a barrier at the start
(:meth:`Timeline.align`).

Each rank writes ``rankR.json`` (:class:`RankTimeline`, compact JSON); global rank 0 gathers
every rank's and writes ``trace.json``, a Chrome / Perfetto trace (:func:`chrome_trace`).
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .guards import write_atomically

__all__ = [
    "FORMAT",
    "VERSION",
    "KINDS",
    "Record",
    "RankTimeline",
    "TimelineFormatError",
    "Timeline",
    "chrome_trace",
    "default_steps",
    "parse_steps",
    "recorded",
]

FORMAT, VERSION = "autopipe.timeline", 1
#: what a record measures, and its letter in the trace's event names
KINDS = {
    "forward": "F",
    "backward": "B",  # a full backward (input and weight gradients)
    "backward_input": "I",
    "backward_weight": "W",
    "send_activation": "F",  # the instants name what is sent or received, and the peer
    "send_gradient": "B",
    "recv_activation": "F",
    "recv_gradient": "B",
    "dp_reduce": "dp-reduce",  # what a stage's backward left of its data-parallel reduction
    "reduce": "reduce",  # gradients scaled, tied copies summed, the norm taken and clipped
    "optimizer": "optimizer",
    "step": "step",
}
#: the kinds recorded as instants (the creation of the operations), not intervals
INSTANTS = frozenset({"send_activation", "send_gradient", "recv_activation", "recv_gradient"})
#: the compute actions of a schedule
COMPUTE = frozenset({"forward", "backward", "backward_input", "backward_weight"})


class TimelineFormatError(ValueError):
    """A timeline file that breaks its format; the message names the first bad field."""


def _int(data: dict[str, Any], key: str, where: str, optional: bool = False) -> int | None:
    if key not in data:
        raise TimelineFormatError(f"{where}: missing {key!r}")
    value = data[key]
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise TimelineFormatError(f"{where}.{key}: expected an integer, got {value!r}")
    return value


def _fields(data: object, where: str, keys: Sequence[str]) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise TimelineFormatError(f"{where}: expected an object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(keys))
    if unknown:
        raise TimelineFormatError(f"{where}: unknown field {unknown[0]!r}")
    return data


@dataclass(frozen=True)
class Record:
    """One measured action: nanoseconds from the run's common origin (global rank 0's clock
    at :meth:`Timeline.align`). ``stage``, ``microbatch`` and ``peer`` are None where they do
    not apply; ``round`` is the accumulation round (``--accumulate``) of a microbatch's action."""

    step: int
    kind: str
    stage: int | None
    microbatch: int | None
    start_ns: int
    end_ns: int
    round: int = 0
    peer: int | None = None

    KEYS = ("step", "kind", "stage", "microbatch", "round", "peer", "start_ns", "end_ns")

    @property
    def name(self) -> str:
        """``F3 s1``: the forward of microbatch 3 at stage 1 (``F3.1 s1`` in accumulation round
        1); ``optimizer s1``, ``reduce``; ``send F3 s1 to rank 2``, ``recv B3 s1 from rank 2``."""
        letter = KINDS[self.kind]
        what = letter + (str(self.microbatch) if self.microbatch is not None else "")
        if self.round:
            what += f".{self.round}"
        where = f" s{self.stage}" if self.stage is not None else ""
        if self.kind not in INSTANTS:
            return what + where
        verb = self.kind.split("_")[0]
        peer = f" {'to' if verb == 'send' else 'from'} rank {self.peer}"
        return f"{verb} {what}{where}{peer if self.peer is not None else ''}"

    def to_json(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in self.KEYS}

    @classmethod
    def from_json(cls, data: object, where: str = "record") -> Record:
        fields = _fields(data, where, cls.KEYS)
        kind = fields.get("kind")
        if kind not in KINDS:
            raise TimelineFormatError(f"{where}.kind: expected one of {list(KINDS)}, got {kind!r}")
        step, start, end, round_ = (
            _int(fields, k, where) for k in ("step", "start_ns", "end_ns", "round")
        )
        assert step is not None and start is not None and end is not None and round_ is not None
        if end < start:
            raise TimelineFormatError(f"{where}: end_ns {end} before start_ns {start}")
        return cls(
            step=step,
            kind=kind,
            stage=_int(fields, "stage", where, optional=True),
            microbatch=_int(fields, "microbatch", where, optional=True),
            start_ns=start,
            end_ns=end,
            round=round_,
            peer=_int(fields, "peer", where, optional=True),
        )


@dataclass(frozen=True)
class RankTimeline:
    """What one rank recorded: where it sits, the stages it holds, how far its clock is from
    global rank 0's (0 on rank 0's host), and its records in the order they started."""

    rank: int
    pp_rank: int
    dp_rank: int
    stages: tuple[int, ...]
    device: str  # "cpu" or "cuda"
    clock_offset_ns: int
    steps: tuple[int, int]  # the traced steps, [A, B)
    records: tuple[Record, ...]

    KEYS = (
        "format",
        "version",
        "rank",
        "pp_rank",
        "dp_rank",
        "stages",
        "device",
        "clock_offset_ns",
        "steps",
        "records",
    )

    def to_json(self) -> str:
        """Compact and byte-stable: one line, fields in a fixed order."""
        data = {
            "format": FORMAT,
            "version": VERSION,
            "rank": self.rank,
            "pp_rank": self.pp_rank,
            "dp_rank": self.dp_rank,
            "stages": list(self.stages),
            "device": self.device,
            "clock_offset_ns": self.clock_offset_ns,
            "steps": list(self.steps),
            "records": [r.to_json() for r in self.records],
        }
        return json.dumps(data, separators=(",", ":")) + "\n"

    @classmethod
    def from_json(cls, text: str) -> RankTimeline:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TimelineFormatError(f"not JSON: {exc}") from None
        fields = _fields(data, "timeline", cls.KEYS)
        if fields.get("format") != FORMAT:
            raise TimelineFormatError(f"format: expected {FORMAT!r}, got {fields.get('format')!r}")
        if fields.get("version") != VERSION:
            raise TimelineFormatError(f"version: expected {VERSION}, got {fields.get('version')!r}")
        ints = {
            k: _int(fields, k, "timeline")
            for k in ("rank", "pp_rank", "dp_rank", "clock_offset_ns")
        }
        for key in ("stages", "steps", "records"):
            if not isinstance(fields.get(key), list):
                raise TimelineFormatError(f"timeline.{key}: expected a list")
        stages = fields["stages"]
        if not all(isinstance(s, int) and not isinstance(s, bool) for s in stages):
            raise TimelineFormatError(f"timeline.stages: expected integers, got {stages!r}")
        steps = fields["steps"]
        if len(steps) != 2 or not all(
            isinstance(s, int) and not isinstance(s, bool) for s in steps
        ):
            raise TimelineFormatError(f"timeline.steps: expected [A, B], got {steps!r}")
        if fields.get("device") not in ("cpu", "cuda"):
            raise TimelineFormatError(
                f"timeline.device: expected cpu or cuda, got {fields.get('device')!r}"
            )
        records = tuple(
            Record.from_json(r, f"timeline.records[{i}]") for i, r in enumerate(fields["records"])
        )
        return cls(
            rank=ints["rank"] or 0,
            pp_rank=ints["pp_rank"] or 0,
            dp_rank=ints["dp_rank"] or 0,
            stages=tuple(stages),
            device=fields["device"],
            clock_offset_ns=ints["clock_offset_ns"] or 0,
            steps=(steps[0], steps[1]),
            records=records,
        )


def chrome_trace(timelines: Sequence[RankTimeline]) -> str:
    """A Chrome / Perfetto trace (``chrome://tracing``, ui.perfetto.dev) of every rank's
    timeline: one process per rank named by its stages, one track of complete events (``X``,
    microseconds from the common origin; the step encloses its actions) and the creation of
    sends and receives as instants. Byte-stable for the same timelines."""
    events: list[dict[str, Any]] = []
    for timeline in sorted(timelines, key=lambda t: t.rank):
        pid = timeline.rank
        stages = ", ".join(str(s) for s in timeline.stages)
        label = f"rank {pid} (stage{'s' if len(timeline.stages) != 1 else ''} {stages})"
        events.append(
            {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": label}}
        )
        events.append(
            {
                "ph": "M",
                "name": "process_sort_index",
                "pid": pid,
                "tid": 0,
                "args": {"sort_index": pid},
            }
        )
        events.append(
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": 0, "args": {"name": "actions"}}
        )
        for record in timeline.records:
            args = {
                "step": record.step,
                "stage": record.stage,
                "microbatch": record.microbatch,
                "round": record.round,
            }
            if record.peer is not None:
                args["peer"] = record.peer
            event: dict[str, Any] = {
                "name": record.name,
                "cat": record.kind,
                "pid": pid,
                "tid": 0,
                "ts": record.start_ns / 1000,
                "args": args,
            }
            if record.kind in INSTANTS:
                event.update(ph="i", s="t")
            else:
                event.update(ph="X", dur=(record.end_ns - record.start_ns) / 1000)
            events.append(event)
    return (
        json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}, separators=(",", ":")) + "\n"
    )


def parse_steps(text: str) -> tuple[int, int] | None:
    """``A:B`` as (A, B); None if it is not two integers A < B, both >= 0."""
    first, colon, last = text.partition(":")
    try:
        begin, end = int(first), int(last)
    except ValueError:
        return None
    if not colon or begin < 0 or end <= begin:
        return None
    return begin, end


def default_steps(start: int, steps: int) -> tuple[int, int]:
    """The two steps after the first this run runs (``start``, which warms up: allocations,
    first calls), or the first alone in a run of one step."""
    return (start + 1, start + 3) if steps - start > 1 else (start, start + 1)


def _now() -> int:
    return time.monotonic_ns()


def _event() -> Any:
    """A CUDA event that measures time, recorded later on the current stream."""
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # torch


#: a pending CUDA interval: what it measures and its two events
_Pending = tuple[int, str, int | None, int | None, int, Any, Any]


class Timeline:
    """This rank's recorder of the steps ``steps`` (half-open), written into ``directory``.
    :meth:`align` (collective) first; then per traced step :meth:`begin_step`, spans and
    instants, :meth:`end_step`; :meth:`write` (collective) at the end of the last."""

    def __init__(
        self,
        directory: Path,
        steps: tuple[int, int],
        *,
        rank: int,
        pp_rank: int,
        dp_rank: int,
        stages: tuple[int, ...],
        device: torch.device,
    ) -> None:
        self.directory = directory
        self.steps = steps
        self.rank, self.pp_rank, self.dp_rank, self.stages = rank, pp_rank, dp_rank, stages
        self.device = device
        self.cuda = device.type == "cuda"
        self.origin_ns = 0  # this rank's clock at the common origin
        self.offset_ns = 0  # this rank's clock minus global rank 0's (0 on rank 0's host)
        self.records: list[Record] = []
        self.step: int | None = None  # the traced step running, None between them
        self.round = 0  # the accumulation round running
        self.written = False
        self._pending: list[_Pending] = []
        self._reference: Any = None  # CUDA: the event recorded at host time _reference_ns
        self._reference_ns = 0

    # -- clocks --------------------------------------------------------------------------------
    def align(self) -> None:
        """Every rank passes a barrier and reads its clock; ranks on global rank 0's host share
        its clock (system-wide), the others are offset by the difference of the readings."""
        dist.barrier()
        reading = _now()
        mine = (socket.gethostname(), reading)
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        host, zero = every[0]
        self.offset_ns = 0 if host == mine[0] else reading - zero
        self.origin_ns = zero + self.offset_ns

    def _host(self, clock_ns: int) -> int:
        """A reading of this rank's clock, from the common origin."""
        return clock_ns - self.origin_ns

    # -- recording -----------------------------------------------------------------------------
    def traces(self, step: int) -> bool:
        return self.steps[0] <= step < self.steps[1]

    @property
    def last_step(self) -> int:
        return self.steps[1] - 1

    def begin_step(self, step: int) -> None:
        self.step, self.round = step, 0
        if self.cuda:  # the reference: recorded on an idle stream at a known host time
            torch.cuda.synchronize(self.device)
            self._reference = _event()
            self._reference_ns = _now()
            self._reference.record()

    @contextlib.contextmanager
    def span(
        self, kind: str, stage: int | None = None, microbatch: int | None = None
    ) -> Iterator[None]:
        """Records the interval the ``with`` block takes (nothing between traced steps)."""
        step = self.step
        if step is None:
            yield
            return
        round_ = self.round if kind in COMPUTE else 0  # reduce, optimizer: after every round
        if self.cuda:
            begin, end = _event(), _event()
            begin.record()
            try:
                yield
            finally:
                end.record()
                self._pending.append((step, kind, stage, microbatch, round_, begin, end))
            return
        start = _now()
        try:
            yield
        finally:
            self.records.append(
                Record(step, kind, stage, microbatch, self._host(start), self._host(_now()), round_)
            )

    def instant(self, kind: str, stage: int, microbatch: int, peer: int | None) -> None:
        """An event without duration (the creation of a send or a receive), on the host clock."""
        if self.step is None:
            return
        at = self._host(_now())
        self.records.append(Record(self.step, kind, stage, microbatch, at, at, self.round, peer))

    def end_step(self) -> None:
        """Closes the traced step: CUDA intervals resolved (one synchronisation) onto the host
        clock, every record of the step in the order the actions started."""
        if self.cuda and self._pending:
            torch.cuda.synchronize(self.device)
            base = self._host(self._reference_ns)
            for step, kind, stage, microbatch, round_, begin, end in self._pending:
                start = base + round(self._reference.elapsed_time(begin) * 1e6)
                stop = base + round(self._reference.elapsed_time(end) * 1e6)
                self.records.append(Record(step, kind, stage, microbatch, start, stop, round_))
            self._pending.clear()
        self.records.sort(key=lambda r: (r.step, r.start_ns, -r.end_ns))
        self.step = None

    # -- output --------------------------------------------------------------------------------
    def timeline(self) -> RankTimeline:
        return RankTimeline(
            rank=self.rank,
            pp_rank=self.pp_rank,
            dp_rank=self.dp_rank,
            stages=self.stages,
            device=self.device.type,
            clock_offset_ns=self.offset_ns,
            steps=self.steps,
            records=tuple(self.records),
        )

    def write(self) -> None:
        """``rankR.json`` on every rank; global rank 0 gathers them all (collective) and writes
        ``trace.json``."""
        mine = self.timeline().to_json()
        write_atomically(self.directory / f"rank{self.rank}.json", mine)
        every: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, every, dst=0)
        if every is not None:
            timelines = [RankTimeline.from_json(text) for text in every]
            write_atomically(self.directory / "trace.json", chrome_trace(timelines))
        self.written = True


def recorded(
    timeline: Timeline | None, kind: str, stage: int | None = None, microbatch: int | None = None
) -> contextlib.AbstractContextManager[None]:
    """``timeline``'s record of what the ``with`` block does (see :meth:`Timeline.span`);
    nothing, at no cost, without a timeline (a run without ``--trace``)."""
    if timeline is None:
        return contextlib.nullcontext()
    return timeline.span(kind, stage, microbatch)
