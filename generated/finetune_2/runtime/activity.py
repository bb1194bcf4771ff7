"""What this rank is doing now, and how long its stages compute.

Copied into every generated pipeline as ``runtime/activity.py``; it needs only torch. Every
schedule action and driver phase passes through one hook: :func:`recorded` (an action the
``--trace`` timeline also records) or :func:`doing` (a driver phase, or one collective of it),
and the creation of a send or a receive through :func:`transfer`. Each makes the action this
rank's current one in :data:`ACTIVITY`, always and at the cost of a few attribute writes: what
a hang diagnosis (``hangs.py``) reports of the rank, and since when. A transfer's creation means
that the rank waits for that peer from then on (until its next action); a collective names the
ranks it waits with. The forward and backward passes of a training step also add their time to
the rank's busy time per stage (:class:`BusyTimes`), which the straggler report
(``stragglers.py``) compares across ranks at the ``--log-every`` steps.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from .core.fields import FieldReader
from .core.timeline_format import COMPUTE
from .core.timeline_format import KINDS as TIMELINE_KINDS
from .timeline import Timeline

__all__ = [
    "ACTIVITY",
    "ACTION_KEYS",
    "ACTION_KINDS",
    "COLLECTIVES",
    "ORDER",
    "READING",
    "UNTIMED",
    "WITHIN",
    "Action",
    "Activity",
    "BusyTimes",
    "CudaBusyTimes",
    "doing",
    "recorded",
    "rank_list",
    "transfer",
]

#: a training step's phases, in the order every rank runs them: a rank at a later phase of a
#: step than a collective it was to take part in went past it. The pipeline's actions (compute,
#: transfers, the data-parallel reduction) take the order of the phase they run in.
ORDER = {
    kind: index
    for index, kind in enumerate(
        (
            "step",
            "data",  # the step's batch read, its dynamic sizes agreed
            "pipeline",  # the schedule's runs (every --accumulate round)
            "reduce",  # gradients scaled, tied copies summed, the norm taken and clipped
            "tied_sum",
            "partial_sum",  # tensor parallelism's partial gradients summed over tp ranks
            "norm",
            "loss_mean",  # the loss averaged over the data-parallel ranks
            "finite_check",  # whether the loss and the gradient norm are finite
            "optimizer",
            "metrics",  # peak memory, state and busy times gathered
            "checkpoint",
            "evaluation",
        )
    )
}
#: the actions that are (or hold) a collective: ``Action.ranks`` take part in it
COLLECTIVES = frozenset(
    {
        "dp_reduce",
        "tied_sum",
        "partial_sum",
        "norm",
        "loss_mean",
        "finite_check",
        "metrics",
        "data",
    }
)
#: driver actions that take the place in the step of the phase they run inside (reading a
#: batch, within the step's "data" phase or an evaluation), or run before the first step (the
#: first preparation of a dataset file, and the other ranks' wait for it)
WITHIN = frozenset({"read_batch", "prepare_data", "wait_data"})
#: actions that read data: a rank that waits for one waits for its data
READING = frozenset({"read_batch", "prepare_data"})
#: actions no --timeout limits (the preparation of a dataset file before the first step takes
#: as long as the file takes to read and tokenize; no rank waits for it in a collective)
UNTIMED = frozenset({"prepare_data", "wait_data"})


class Action(NamedTuple):
    """One action of a rank: what it is (``kind``), in which step (-1 before the first) and
    accumulation round, at which stage and microbatch; the peers of a transfer and the shapes
    it sends or receives into; the ranks of a collective; its phase's place in the step
    (:data:`ORDER`). A named tuple, as one is made at every action and must cost little."""

    kind: str
    step: int
    round: int = 0
    stage: int | None = None
    microbatch: int | None = None
    peers: tuple[int, ...] = ()
    ranks: tuple[int, ...] = ()
    shapes: tuple[tuple[int, ...], ...] = ()
    order: int = 0

    def describe(self) -> str:
        """What the rank does, in words: ``waits for rank 2's forward of microbatch 3 (stage
        3's input, step 5)``, ``is inside stage 2's forward of microbatch 3 (step 5)``."""
        verb, _ = _WORDS[self.kind]
        return verb.format(what=self.what())

    def what(self) -> str:
        """The action, in words: ``stage 2's forward of microbatch 3 (step 5)``."""
        _, noun = _WORDS[self.kind]
        what = noun.format(
            stage=self.stage,
            microbatch=self.microbatch,
            peer=", ".join(str(p) for p in dict.fromkeys(self.peers)) or "?",
            ranks=rank_list(self.ranks),
        )
        if self.kind == "data" and self.ranks:
            what += f", agreeing on its sizes with {rank_list(self.ranks)}"
        when = f"step {self.step}" if self.step >= 0 else "before the first step"
        if self.round:
            when += f", accumulation round {self.round}"
        if what.endswith(")"):  # (stage 3's input) -> (stage 3's input, step 5)
            return f"{what[:-1]}, {when})"
        return f"{what} ({when})"

    def to_json(self) -> dict[str, Any]:
        """A JSON object of :data:`ACTION_KEYS`, its tuples as lists."""
        return {
            **self._asdict(),
            "peers": list(self.peers),
            "ranks": list(self.ranks),
            "shapes": [list(shape) for shape in self.shapes],
        }

    @classmethod
    def from_json(cls, data: object, where: str, read: FieldReader) -> Action:
        """The action :meth:`to_json` made ``data`` of, checked by ``read`` (the reader of
        the format holding it, which names its errors)."""
        fields = read.fields(data, where, ACTION_KEYS)
        shapes = read.items(
            fields["shapes"], f"{where}.shapes", lambda v: isinstance(v, list), "shape"
        )
        return cls(
            kind=read.check(
                fields["kind"], f"{where}.kind", ACTION_KINDS.__contains__, "an action"
            ),
            step=read.integer(fields["step"], f"{where}.step", minimum=-1),
            round=read.integer(fields["round"], f"{where}.round", minimum=0),
            stage=read.optional_integer(fields["stage"], f"{where}.stage"),
            microbatch=read.optional_integer(fields["microbatch"], f"{where}.microbatch"),
            peers=read.ints(fields["peers"], f"{where}.peers"),
            ranks=read.ints(fields["ranks"], f"{where}.ranks"),
            shapes=tuple(read.ints(s, f"{where}.shapes[{i}]") for i, s in enumerate(shapes)),
            order=read.integer(fields["order"], f"{where}.order", minimum=0),
        )


#: the fields of an :class:`Action`, in order: the keys of its JSON object
ACTION_KEYS: tuple[str, ...] = Action._fields


#: Action.describe's words per kind: what the rank does (around ``{what}``), and the action
_WORDS = {
    "forward": ("is inside {what}", "stage {stage}'s forward of microbatch {microbatch}"),
    "backward": ("is inside {what}", "stage {stage}'s backward of microbatch {microbatch}"),
    "backward_input": (
        "is inside {what}",
        "stage {stage}'s input backward of microbatch {microbatch}",
    ),
    "backward_weight": (
        "is inside {what}",
        "stage {stage}'s weight backward of microbatch {microbatch}",
    ),
    "recv_activation": (
        "waits for {what}",
        "rank {peer}'s forward of microbatch {microbatch} (stage {stage}'s input)",
    ),
    "recv_gradient": (
        "waits for {what}",
        "rank {peer}'s backward of microbatch {microbatch} (the gradient of stage {stage}'s "
        "output)",
    ),
    "send_activation": (
        "sends {what}",
        "stage {stage}'s output of microbatch {microbatch} to rank {peer}",
    ),
    "send_gradient": (
        "sends {what}",
        "the gradient of stage {stage}'s input of microbatch {microbatch} to rank {peer}",
    ),
    "dp_reduce": (
        "is in {what}",
        "stage {stage}'s data-parallel gradient reduction with {ranks}",
    ),
    "step": ("is in {what}", "the step"),
    "data": ("is at {what}", "the step's batch"),
    "read_batch": ("is {what}", "reading the batch"),
    "prepare_data": (
        "is {what}",
        "preparing the dataset files' rows (reading, tokenizing and packing them)",
    ),
    "wait_data": ("waits for {what}", "the dataset files' preparation, with {ranks}"),
    "pipeline": ("is in {what}", "the pipeline schedule"),
    "reduce": ("is in {what}", "the gradient reduction"),
    "tied_sum": ("waits in {what}", "the sum of tied gradients with {ranks}"),
    "partial_sum": (
        "waits in {what}",
        "the sum of partial gradients (sequence parallel, replicated heads) with the "
        "tensor-parallel {ranks}",
    ),
    "norm": ("waits in {what}", "the gradient norm's all-reduce with {ranks}"),
    "loss_mean": ("waits in {what}", "the loss's mean over the data-parallel {ranks}"),
    "finite_check": (
        "waits in {what}",
        "the check that loss and gradient norm are finite, with {ranks}",
    ),
    "optimizer": ("is in {what}", "stage {stage}'s optimizer step"),
    "metrics": ("waits in {what}", "the metrics' gather with {ranks}"),
    "checkpoint": ("is {what}", "writing a checkpoint"),
    "evaluation": ("is in {what}", "an evaluation on held-out batches"),
}
#: every kind of action
ACTION_KINDS = frozenset(_WORDS)


def rank_list(ranks: Sequence[int]) -> str:
    """``ranks 0-3, 6``: ranks in words, runs of consecutive ones as ranges."""
    if not ranks:
        return "no rank"
    runs: list[list[int]] = []
    for rank in sorted(ranks):
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    parts = [f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs]
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(parts)}"


class BusyTimes:
    """Seconds each stage of this rank spent in forward and backward passes (input and weight
    backward included) since :meth:`take` last, on the host's monotonic clock."""

    def __init__(self) -> None:
        self.forward: dict[int, float] = {}
        self.backward: dict[int, float] = {}

    def begin(self) -> Any:
        """A mark at the start of a compute action, handed back to :meth:`end`."""
        return time.monotonic_ns()

    def end(self, mark: Any, kind: str, stage: int) -> None:
        self._add(kind, stage, (time.monotonic_ns() - mark) / 1e9)

    def _add(self, kind: str, stage: int, seconds: float) -> None:
        table = self.forward if kind == "forward" else self.backward
        table[stage] = table.get(stage, 0.0) + seconds

    def take(self) -> tuple[dict[int, float], dict[int, float]]:
        """The forward and backward seconds per stage so far, and a fresh start."""
        taken = self.forward, self.backward
        self.forward, self.backward = {}, {}
        return taken


class CudaBusyTimes(BusyTimes):
    """:class:`BusyTimes` on CUDA, where the host only queues the work: each compute action is
    a pair of timing events on the current stream, resolved at :meth:`take` (one
    synchronisation, at the ``--log-every`` steps only)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self._pending: list[tuple[str, int, Any, Any]] = []

    def begin(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # torch
        event.record()
        return event

    def end(self, mark: Any, kind: str, stage: int) -> None:
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # torch
        event.record()
        self._pending.append((kind, stage, mark, event))

    def take(self) -> tuple[dict[int, float], dict[int, float]]:
        if self._pending:
            torch.cuda.synchronize(self.device)
            for kind, stage, begin, end in self._pending:
                self._add(kind, stage, begin.elapsed_time(end) / 1e3)  # milliseconds
            self._pending.clear()
        return super().take()


class Activity:
    """This rank's current action (:attr:`now`), kept by the hooks as the rank moves on: the
    phases and actions it is inside form a stack; a transfer's creation replaces the current
    action until the next hook; leaving an action returns to the one around it, from then on.
    ``busy`` adds up the compute of training steps (not evaluations)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self, busy: BusyTimes | None = None) -> None:
        """A fresh start (a new run in this process)."""
        self.step = -1  # the step running, or the last one (-1 before the first)
        self.round = 0  # its accumulation round
        #: (the current action, when the rank began it or returned to it (monotonic ns), the
        #: action it left last when it returned to this one), or None outside any action
        self.now: tuple[Action, int, Action | None] | None = None
        self.busy = busy
        self._stack: list[tuple[Action, Any]] = []  # entered actions, and their busy marks
        #: the innermost action an exception left, the first time one did (what a --dry-run
        #: rank's error happened in), or None
        self.failed: Action | None = None

    def begin_step(self, step: int) -> None:
        self.step, self.round = step, 0

    def enter(
        self,
        kind: str,
        stage: int | None = None,
        microbatch: int | None = None,
        ranks: tuple[int, ...] = (),
    ) -> None:
        stack = self._stack
        order = ORDER.get(kind)
        if order is None:
            order = stack[-1][0].order if stack else 0
        action = Action(
            kind, self.step, self.round if kind in COMPUTE else 0, stage, microbatch, (),
            ranks, (), order,
        )  # fmt: skip
        mark = None
        if self.busy is not None and kind in COMPUTE and stack and stack[0][0].kind == "step":
            mark = self.busy.begin()  # a training step's compute (evaluations are not timed)
        stack.append((action, mark))
        self.now = (action, time.monotonic_ns(), None)

    def leave(self, failed: bool = False) -> None:
        """Back to the action around the one left (``failed``: left by an exception)."""
        left, mark = self._stack.pop()
        if failed and self.failed is None:
            self.failed = left
        if mark is not None and self.busy is not None and left.stage is not None:
            self.busy.end(mark, left.kind, left.stage)
        self.now = (self._stack[-1][0], time.monotonic_ns(), left) if self._stack else None

    def instant(
        self,
        kind: str,
        stage: int,
        microbatch: int,
        peers: tuple[int, ...],
        shapes: tuple[tuple[int, ...], ...],
    ) -> None:
        order = self._stack[-1][0].order if self._stack else 0
        action = Action(kind, self.step, self.round, stage, microbatch, peers, (), shapes, order)
        self.now = (action, time.monotonic_ns(), None)


#: this process's (this rank's) activity, which every hook updates
ACTIVITY = Activity()


class _Recorded:
    """The context of :func:`recorded` and :func:`doing` (a class: entered at every action)."""

    __slots__ = ("timeline", "kind", "stage", "microbatch", "ranks", "span")

    def __init__(
        self,
        timeline: Timeline | None,
        kind: str,
        stage: int | None,
        microbatch: int | None,
        ranks: tuple[int, ...],
    ) -> None:
        self.timeline = timeline
        self.kind, self.stage, self.microbatch, self.ranks = kind, stage, microbatch, ranks
        self.span: Any = None

    def __enter__(self) -> None:
        ACTIVITY.enter(self.kind, self.stage, self.microbatch, self.ranks)
        if self.timeline is not None:
            self.span = self.timeline.span(self.kind, self.stage, self.microbatch)
            self.span.__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            if self.span is not None:
                self.span.__exit__(*exc)
        finally:
            ACTIVITY.leave(exc[0] is not None)


def recorded(
    timeline: Timeline | None,
    kind: str,
    stage: int | None = None,
    microbatch: int | None = None,
    ranks: tuple[int, ...] = (),
) -> _Recorded:
    """The hook of a schedule action or driver phase the timeline knows (``timeline.KINDS``):
    the ``with`` block is this rank's current action, and ``timeline``'s record of a traced
    step (see :meth:`Timeline.span`; nothing more without a timeline)."""
    assert kind in TIMELINE_KINDS, kind
    return _Recorded(timeline, kind, stage, microbatch, ranks)


def doing(kind: str, stage: int | None = None, ranks: tuple[int, ...] = ()) -> _Recorded:
    """The hook of a driver phase the timeline does not record (:data:`ORDER`, or an action
    within one, :data:`WITHIN`): the ``with`` block is this rank's current action; ``ranks``:
    those it waits with in a collective, or for."""
    assert kind in ORDER or kind in WITHIN, kind
    return _Recorded(None, kind, stage, None, ranks)


def transfer(
    timeline: Timeline | None, kind: str, stage: int, microbatch: int, ops: list[dist.P2POp]
) -> list[dist.P2POp]:
    """``ops``, the sends or receives of a transfer just created: from now on this rank waits
    for their peers (with the shapes sent, or those the receive buffers expect); an instant of
    ``timeline`` in a traced step."""
    if ops:
        peers = tuple(op.peer for op in ops)
        ACTIVITY.instant(kind, stage, microbatch, peers, tuple(op.tensor.shape for op in ops))
        if timeline is not None:
            timeline.instant(kind, stage, microbatch, peers[0])
    return ops
