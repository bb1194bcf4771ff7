"""The measured timeline of a training run (``train.py --trace DIR --trace-steps A:B``).

Copied into every generated pipeline as ``runtime/timeline.py``; it needs only torch. A
:class:`Timeline` on each rank records when every schedule action of the traced steps starts and
ends: each stage's forward, full backward, input backward and weight backward of each microbatch
(:class:`~.parallel.DataParallelStage` reports them through ``activity.recorded`` when a
timeline is attached), the data-parallel gradient reduction the schedule runs after the last
backward (FSDP2's, per stage), the gradient reduction of the step (scaling, tied sums, the
norm and clipping), each stage's optimizer step and the step itself; the creation of a send as an
instant, and a receive from its creation to the start of the action that consumes it (which
waits for it first), both with the peer rank. On CPU the clock is
``CLOCK_MONOTONIC`` (system-wide: the ranks of one host agree on it); on CUDA each interval is a
pair of timing events, resolved once at the end of a traced step and placed on the host clock by
a reference event recorded at a known host time. Ranks on other hosts than global rank 0 are
aligned by a barrier at the start (:meth:`Timeline.align`). With FSDP2-managed stages
(``fsdp_root``: the path of the stage module in the module FSDP2 was applied to last, its root),
each unit's unshard, reshard and gradient reduction are recorded too (``fsdp_timeline.py``: read
from the profiler during the traced steps only), each placed in the action it happened in.

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

from .core.timeline_format import (
    COMPUTE,
    RECEIVES,
    TENSOR_PARALLEL,
    RankTimeline,
    Record,
    RunLayout,
    chrome_trace,
)
from .fsdp_timeline import UnitAction, UnitRecorder
from .guards import write_atomically

__all__ = ["Timeline", "default_steps", "parse_steps"]


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


#: a pending CUDA interval: what it measures (step, kind, stage, microbatch, round), its two
#: events, and the peer of a receive
_Pending = tuple[int, str, int | None, int | None, int, Any, Any, int | None]
#: the receive each compute action consumes (waits for before it starts)
_CONSUMES = {
    "forward": "recv_activation",
    "backward": "recv_gradient",
    "backward_input": "recv_gradient",
}


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
        run: RunLayout,
        fsdp_root: str | None = None,
        tensor_parallel: bool = False,
    ) -> None:
        self.directory = directory
        self.run = run
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
        #: receives created and not yet consumed: (kind, stage, microbatch, round) -> (step,
        #: the host clock or a CUDA event at their creation, peer)
        self._receiving: dict[tuple[str, int, int, int], tuple[int, Any, int | None]] = {}
        self._reference: Any = None  # CUDA: the event recorded at host time _reference_ns
        self._reference_ns = 0
        #: FSDP2's actions and tensor parallelism's collectives, read from the profiler (None:
        #: the stages are neither FSDP2-managed nor tensor parallel)
        self._units = (
            UnitRecorder(self.cuda, fsdp_root or "", collectives=tensor_parallel)
            if fsdp_root is not None or tensor_parallel
            else None
        )
        #: the host interval of each span of the step (kind, stage, microbatch, round), to
        #: place FSDP2's actions in
        self._hosted: list[tuple[int, int, str, int | None, int | None, int]] = []

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
        if self._units is not None:
            self._units.start()

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
        consumed = (
            self._receiving.pop((_CONSUMES[kind], stage, microbatch, round_), None)
            if kind in _CONSUMES and stage is not None and microbatch is not None
            else None
        )
        hosted = (  # where FSDP2's actions are placed
            self._host_interval(kind, stage, microbatch, round_)
            if self._units is not None
            else contextlib.nullcontext()
        )
        with hosted:
            yield from self._measured(step, kind, stage, microbatch, round_, consumed)

    @contextlib.contextmanager
    def _host_interval(
        self, kind: str, stage: int | None, microbatch: int | None, round_: int
    ) -> Iterator[None]:
        start = _now()
        try:
            yield
        finally:
            self._hosted.append((start, _now(), kind, stage, microbatch, round_))

    def _measured(
        self,
        step: int,
        kind: str,
        stage: int | None,
        microbatch: int | None,
        round_: int,
        consumed: tuple[int, Any, int | None] | None,
    ) -> Iterator[None]:
        """The body of :meth:`span`: the interval on the device (CUDA) or the host clock."""
        if self.cuda:
            begin, end = _event(), _event()
            begin.record()  # on the stream, after the wait for the receive it consumes
            if consumed is not None:
                self._pending.append(
                    (
                        step,
                        _CONSUMES[kind],
                        stage,
                        microbatch,
                        round_,
                        consumed[1],
                        begin,
                        consumed[2],
                    )
                )
            try:
                yield
            finally:
                end.record()
                self._pending.append((step, kind, stage, microbatch, round_, begin, end, None))
            return
        start = _now()
        if consumed is not None:
            self.records.append(
                Record(
                    step,
                    _CONSUMES[kind],
                    stage,
                    microbatch,
                    self._host(consumed[1]),
                    self._host(start),
                    round_,
                    consumed[2],
                )
            )
        try:
            yield
        finally:
            self.records.append(
                Record(step, kind, stage, microbatch, self._host(start), self._host(_now()), round_)
            )

    def instant(self, kind: str, stage: int, microbatch: int, peer: int | None) -> None:
        """The creation of a transfer: a send's is an event without duration; a receive's opens
        its interval, closed when the action consuming it starts (see :meth:`span`). On CUDA
        both are read off the device's stream, as the spans are (the host runs ahead of the GPU:
        a send's host time would precede the forward that made what it sends)."""
        if self.step is None:
            return
        created: Any = _now()
        if self.cuda:
            created = _event()
            created.record()
        if kind in RECEIVES:
            self._receiving[kind, stage, microbatch, self.round] = (self.step, created, peer)
        elif self.cuda:
            self._pending.append(
                (self.step, kind, stage, microbatch, self.round, created, created, peer)
            )
        else:
            at = self._host(created)
            self.records.append(
                Record(self.step, kind, stage, microbatch, at, at, self.round, peer)
            )

    def end_step(self) -> None:
        """Closes the traced step: CUDA intervals resolved (one synchronisation) onto the host
        clock, every record of the step in the order the actions started. A receive no action
        consumed (none should be left) is kept as an instant at its creation."""
        for (kind, at_stage, at_microbatch, round_), (
            step,
            created,
            peer,
        ) in self._receiving.items():
            if self.cuda:
                self._pending.append(
                    (step, kind, at_stage, at_microbatch, round_, created, created, peer)
                )
            else:
                at = self._host(created)
                self.records.append(
                    Record(step, kind, at_stage, at_microbatch, at, at, round_, peer)
                )
        self._receiving.clear()
        if self.cuda and self._pending:
            torch.cuda.synchronize(self.device)
            base = self._host(self._reference_ns)
            for step, kind, stage, microbatch, round_, begin, end, peer in self._pending:
                start = base + round(self._reference.elapsed_time(begin) * 1e6)
                stop = base + round(self._reference.elapsed_time(end) * 1e6)
                self.records.append(
                    Record(step, kind, stage, microbatch, start, stop, round_, peer)
                )
            self._pending.clear()
        if self._units is not None:
            self._place(self._units.stop())
        # in the order they started; at one instant a send or receive before the span starting
        # then (it was posted first), an enclosing span before what it encloses
        self.records.sort(key=lambda r: (r.step, r.start_ns, r.end_ns != r.start_ns, -r.end_ns))
        self.step = None

    def _place(self, actions: Sequence[UnitAction]) -> None:
        """FSDP2's actions as records of the step running, each in the innermost span its host
        start fell in: the stage of that span, and its microbatch and round for a compute
        action (none for a reduction after the backward)."""
        assert self.step is not None
        hosted = sorted(self._hosted, key=lambda h: (h[0], -h[1]))
        self._hosted.clear()
        for action in actions:
            start = action.start_ns
            stage, microbatch, round_ = None, None, 0
            for begin, end, kind, at_stage, at_microbatch, at_round in hosted:
                if begin > start:
                    break
                if start <= end and at_stage is not None:  # later starts are inner ones
                    stage = at_stage
                    microbatch, round_ = (at_microbatch, at_round) if kind in COMPUTE else (None, 0)
            self.records.append(
                Record(
                    self.step,
                    action.kind,
                    stage,
                    microbatch,
                    self._host(action.start_ns),
                    self._host(action.end_ns),
                    round_,
                    unit=None if action.kind in TENSOR_PARALLEL else action.unit,
                )
            )

    # -- output --------------------------------------------------------------------------------
    def timeline(self) -> RankTimeline:
        return RankTimeline(
            rank=self.rank,
            pp_rank=self.pp_rank,
            dp_rank=self.dp_rank,
            stages=self.stages,
            device=self.device.type,
            run=self.run,
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
