"""FSDP2's own actions in a traced step (``train.py --trace`` with data parallelism): each unit's
unshard (its parameters all-gathered and copied out), reshard (the gathered copy freed) and
gradient reduction (reduce-scatter, and the all-reduce across replicas of hybrid sharding).

Copied into every generated pipeline as ``runtime/fsdp_timeline.py``; it needs only torch. FSDP2
marks its work with ``torch.profiler.record_function`` ranges (``FSDP::all_gather (blocks.0)``,
``FSDP::post_forward (blocks.0)``, ...); a :class:`UnitRecorder` runs torch's profiler over those
ranges alone (and on a GPU the kernels they launch) during a traced step only and turns them
into :class:`UnitAction` s with :func:`unit_actions`:

* **unshard**: from the start of a unit's all-gather to the end of its copy-out, whether the
  gather was issued by the unit's own pre-forward or pre-backward or prefetched earlier. Only
  real gathers count: FSDP2 issues no all-gather for a unit already gathered, nor over one
  shard (``--dp`` alone: nothing is sharded, nothing gathered).
* **reshard**: FSDP2 offers to free a unit after every forward and backward, and frees it
  only where it must be gathered again (``--gather block``) or at the step's end (``--gather
  step``); the offer recorded is the unit's last one before its next all-gather, or of the
  step, of a unit gathered since.
* **fsdp_reduce**: a unit's gradient reduction after its backward.

On CPU each action is its range on the host clock. On CUDA an action that launched kernels
(gathers, copies, reductions) is the span of those kernels on the device (the profiler puts
them on the host clock); one that launched none (a reshard only frees memory) is its host range.
"""

from __future__ import annotations

import re
import time
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torch._C._profiler import RecordScope, _ExperimentalConfig
from torch.autograd import (
    DeviceType,
    ProfilerConfig,
    ProfilerState,
    _disable_profiler,
    _enable_profiler,
    _prepare_profiler,
)
from torch.profiler import ProfilerActivity

__all__ = [
    "COLLECTIVE_KINDS",
    "UNIT_KINDS",
    "Mark",
    "UnitAction",
    "UnitRecorder",
    "collective_actions",
    "unit_actions",
]

#: the kinds of FSDP2's actions a timeline records
UNIT_KINDS = ("unshard", "reshard", "fsdp_reduce")

#: ``FSDP::<what> (<unit>)``, with `` [pg=N]`` when a unit holds several parameter groups; the
#: root unit (the stage's own parameters) has no name
_LABEL = re.compile(r"FSDP::(?P<what>\w+)(?: \((?P<unit>[^)]*)\))?(?: \[pg=\d+\])?")
#: the ranges a reshard is offered in
_OFFERS = frozenset({"post_forward", "post_backward_reshard"})
#: DTensor's functional collectives (tensor parallelism), by the timeline kind they make
COLLECTIVE_KINDS = {
    "_c10d_functional::all_gather_into_tensor": "tp_gather",
    "_c10d_functional::reduce_scatter_tensor": "tp_reduce_scatter",
    "_c10d_functional::all_reduce": "tp_all_reduce",
}
#: the operator that waits for a functional collective (on CPU: where its time goes)
_WAIT = "_c10d_functional::wait_tensor"


@dataclass(frozen=True)
class Mark:
    """One profiler event on the host clock (``time.monotonic_ns``). Host events (ranges and
    operators) carry the ``correlation`` id the kernels they launch are ``linked`` to; a device
    event (a kernel, a copy) carries the id of the host operator that launched it."""

    name: str
    start_ns: int
    end_ns: int
    thread: int
    correlation: int = 0
    linked: int = 0
    device: bool = False


@dataclass(frozen=True)
class UnitAction:
    """One FSDP2 action of one unit (``""``: the stage's own parameters outside its blocks)."""

    kind: str
    unit: str
    start_ns: int
    end_ns: int


class _Spans:
    """Where the work a host range started ran: its kernels' span on the device, if it launched
    any (CUDA), else the range itself."""

    def __init__(self, marks: Sequence[Mark]) -> None:
        self.kernels: dict[int, list[Mark]] = {}
        for mark in marks:
            if mark.device and mark.linked:
                self.kernels.setdefault(mark.linked, []).append(mark)
        #: per thread, the host operators that launched kernels, by start
        self.launches: dict[int, list[Mark]] = {}
        for mark in marks:
            if not mark.device and mark.correlation in self.kernels:
                self.launches.setdefault(mark.thread, []).append(mark)
        self.starts = {thread: [op.start_ns for op in ops] for thread, ops in self.launches.items()}

    def of(self, range_: Mark) -> tuple[int, int]:
        ops = self.launches.get(range_.thread, [])
        starts = self.starts.get(range_.thread, [])
        within = ops[bisect_left(starts, range_.start_ns) : bisect_right(starts, range_.end_ns)]
        launched = [kernel for op in within for kernel in self.kernels[op.correlation]]
        if not launched:
            return range_.start_ns, range_.end_ns
        return min(k.start_ns for k in launched), max(k.end_ns for k in launched)


def unit_actions(marks: Iterable[Mark], root: str = "") -> list[UnitAction]:
    """The unshards, reshards and reductions of FSDP2's units in one traced step's events (see
    the module's notes), in the order they started. Units are named as FSDP2 names them (their
    path in the module it was applied to last), less ``root``: the path of the module whose
    parameters are in question (``stage``: ``stage.transformer.h.0`` is ``transformer.h.0``)."""
    prefix = f"{root}." if root else ""
    ordered = sorted(marks, key=lambda m: (m.start_ns, -m.end_ns))
    spans = _Spans(ordered)
    actions: list[UnitAction] = []
    gathering: dict[str, int] = {}  # unit -> the start of its all-gather in flight
    gathered: set[str] = set()  # units gathered since their last recorded reshard
    offer: dict[str, Mark] = {}  # unit -> its latest offer to reshard since it was gathered

    def reshard(unit: str) -> None:
        if unit in gathered and unit in offer:
            mark = offer.pop(unit)
            actions.append(UnitAction("reshard", unit, *spans.of(mark)))
            gathered.discard(unit)

    for mark in ordered:
        label = None if mark.device else _LABEL.fullmatch(mark.name)
        if label is None:
            continue
        what, unit = label["what"], label["unit"] or ""
        unit = "" if unit == root else unit.removeprefix(prefix)
        if what == "all_gather":
            reshard(unit)
            gathering[unit] = spans.of(mark)[0]
        elif what == "all_gather_copy_out" and unit in gathering:
            actions.append(UnitAction("unshard", unit, gathering.pop(unit), spans.of(mark)[1]))
            gathered.add(unit)
            offer.pop(unit, None)
        elif what in _OFFERS and unit in gathered:
            offer[unit] = mark
        elif what == "post_backward_reduce":
            actions.append(UnitAction("fsdp_reduce", unit, *spans.of(mark)))
    for unit in sorted(offer):
        reshard(unit)
    actions.sort(key=lambda a: (a.start_ns, a.end_ns, a.kind, a.unit))
    return actions


def collective_actions(marks: Iterable[Mark], cuda: bool) -> list[UnitAction]:
    """Tensor parallelism's collectives in one traced step's events (unit ``""``): on CUDA the
    span of the kernels each launched; on CPU from the operator's start to the end of the
    wait that consumed it (the waits of a thread take its collectives in the order issued)."""
    ordered = sorted(marks, key=lambda m: (m.start_ns, -m.end_ns))
    spans = _Spans(ordered)
    actions: list[UnitAction] = []
    issued: dict[int, list[tuple[str, int, int]]] = {}  # thread -> (kind, start, end) waiting
    for mark in ordered:
        if mark.device:
            continue
        kind = COLLECTIVE_KINDS.get(mark.name)
        if kind is not None:
            if cuda:
                actions.append(UnitAction(kind, "", *spans.of(mark)))
            else:
                issued.setdefault(mark.thread, []).append((kind, mark.start_ns, mark.end_ns))
        elif mark.name == _WAIT and issued.get(mark.thread):
            kind, start, _ = issued[mark.thread].pop(0)
            actions.append(UnitAction(kind, "", start, max(mark.end_ns, start)))
    for waiting in issued.values():  # never waited for within the step: their own span
        actions += [UnitAction(kind, "", start, end) for kind, start, end in waiting]
    actions.sort(key=lambda a: (a.start_ns, a.end_ns, a.kind))
    return actions


class UnitRecorder:
    """torch's profiler over one traced step at a time (:meth:`start`, :meth:`stop`), recording
    the ``record_function`` ranges only (the user scope: FSDP2's marks, not every operator,
    which would slow a step by microseconds per operator), and on CUDA the kernels they
    launched. ``torch.profiler.profile`` records every operator and has no way to say
    otherwise; its own entry points below it take the scopes. ``root``: see
    :func:`unit_actions`."""

    def __init__(self, cuda: bool, root: str = "", collectives: bool = False) -> None:
        self.root = root
        self.cuda = cuda
        #: tensor parallelism: record every operator too, to find DTensor's collectives
        #: (:func:`collective_actions`), a few microseconds each
        self.collectives = collectives
        self.activities = {ProfilerActivity.CPU} | ({ProfilerActivity.CUDA} if cuda else set())
        self._realtime_minus_monotonic = 0

    def start(self) -> None:
        config = ProfilerConfig(
            ProfilerState.KINETO, False, False, False, False, False, _ExperimentalConfig(), ""
        )
        _prepare_profiler(config, self.activities)
        scopes = {RecordScope.USER_SCOPE} | ({RecordScope.FUNCTION} if self.collectives else set())
        _enable_profiler(config, self.activities, scopes)  # type: ignore[call-arg]  # stub
        # the profiler stamps events in nanoseconds since the epoch; the timeline's clock is
        # the monotonic one
        self._realtime_minus_monotonic = time.time_ns() - time.monotonic_ns()

    def stop(self) -> list[UnitAction]:
        """Stops the profiler; FSDP2's actions (and tensor parallelism's collectives) since
        :meth:`start`, on the monotonic clock."""
        result = _disable_profiler()
        shift = self._realtime_minus_monotonic
        marks = [
            Mark(
                name=event.name(),
                start_ns=event.start_ns() - shift,
                end_ns=event.end_ns() - shift,
                thread=event.start_thread_id(),
                correlation=event.correlation_id(),
                linked=event.linked_correlation_id(),
                device=event.device_type() != DeviceType.CPU,
            )
            for event in result.events()
        ]
        found = unit_actions(marks, self.root)
        if self.collectives:
            found += collective_actions(marks, self.cuda)
        return found
