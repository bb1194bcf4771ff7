"""Stragglers: the rank slowest against its plan, and a rank consistently slower than its peers.

Copied into every generated pipeline as ``runtime/stragglers.py``; it needs only torch. Each
rank adds up the forward and backward seconds of its stages during training steps
(``activity.BusyTimes``, fed by the hooks every action passes through) and its step times; at
the ``--log-every`` steps one all-gather brings every rank's to the reporting rank
(:class:`StepTimes`), which sets each rank's compute against what the plan predicts for its
stages (the schedule's per-microbatch costs in ``pipeline.json`` times the microbatches it ran).
The log line names the slowest rank against its plan (:func:`slowest`); a rank whose ratio stays
above its peers' (the other data-parallel ranks of its pipeline rank, which do the same work; else
the median of the other ranks) by a clear margin over :data:`STRAGGLER_LINES` consecutive log lines
is named once as a straggler (:class:`Stragglers`).
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .activity import BusyTimes, rank_list
from .core.fields import FieldReader, is_number, is_object
from .core.mesh import RankMesh
from .core.pipeline import Pipeline

__all__ = [
    "OTHERS_MARGIN",
    "REPLICA_MARGIN",
    "STRAGGLER_LINES",
    "RankTimes",
    "RankTimesError",
    "StageTimes",
    "StepTimes",
    "Stragglers",
    "cores_shared",
    "slowest",
]

#: consecutive log lines a rank must be slower than its peers on to be named a straggler
STRAGGLER_LINES = 3
#: how much slower than its data-parallel replicas (the same work) a straggler is, at least
REPLICA_MARGIN = 1.5
#: ... than the median of the other ranks (other stages: less alike), without replicas
OTHERS_MARGIN = 2.0


class RankTimesError(ValueError):
    """A ``rank_times`` entry that breaks its format; the message names the first bad field."""


_read = FieldReader(RankTimesError, "rank times")


@dataclass(frozen=True)
class StageTimes:
    """One stage's compute per step on its rank: forward and backward seconds (input and weight
    backward included), and what the plan predicts for both (0: no prediction)."""

    stage: int
    forward: float
    backward: float
    planned: float

    KEYS = ("stage", "forward", "backward", "planned")

    def to_json(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in self.KEYS}

    @classmethod
    def from_json(cls, data: object, where: str) -> StageTimes:
        fields = _read.fields(data, where, cls.KEYS)
        return cls(
            stage=_read.integer(fields["stage"], f"{where}.stage", minimum=0),
            **{k: _read.number(fields[k], f"{where}.{k}", minimum=0) for k in cls.KEYS[1:]},
        )


@dataclass(frozen=True)
class RankTimes:
    """One rank's times per step, means over the steps since the previous ``--log-every`` line:
    the step, and each of its stages' compute."""

    rank: int
    step: float
    stages: tuple[StageTimes, ...]

    KEYS = ("rank", "step", "busy", "planned", "vs_plan", "stages")

    @property
    def busy(self) -> float:
        """Seconds of compute (forward and backward of every stage) per step."""
        return sum(s.forward + s.backward for s in self.stages)

    @property
    def planned(self) -> float:
        """What the plan predicts for :attr:`busy` (0: no prediction)."""
        return sum(s.planned for s in self.stages)

    @property
    def vs_plan(self) -> float | None:
        """How many times its plan the rank's compute takes, or None without a prediction."""
        return self.busy / self.planned if self.planned > 0 else None

    @property
    def label(self) -> str:
        """``rank 2 (stage 2)``."""
        stages = ", ".join(str(s.stage) for s in self.stages)
        return f"rank {self.rank} (stage{'s' if len(self.stages) != 1 else ''} {stages})"

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "step": self.step,
            "busy": self.busy,
            "planned": self.planned,
            "vs_plan": self.vs_plan,
            "stages": [s.to_json() for s in self.stages],
        }

    @classmethod
    def from_json(cls, data: object, where: str = "rank_times") -> RankTimes:
        """An entry of the ``rank_times`` of a ``--log-json`` line; ``busy``, ``planned`` and
        ``vs_plan`` must be what its stages add up to."""
        fields = _read.fields(data, where, cls.KEYS)
        stages = _read.items(fields["stages"], f"{where}.stages", is_object, "stage")
        times = cls(
            rank=_read.integer(fields["rank"], f"{where}.rank", minimum=0),
            step=_read.number(fields["step"], f"{where}.step", minimum=0),
            stages=tuple(
                StageTimes.from_json(s, f"{where}.stages[{i}]") for i, s in enumerate(stages)
            ),
        )
        for key in ("busy", "planned", "vs_plan"):
            value, derived = fields[key], getattr(times, key)
            if (value is None) != (derived is None) or (
                derived is not None
                and not (is_number(value) and abs(value - derived) <= 1e-9 * max(1.0, derived))
            ):
                raise _read.fail(f"{where}.{key}", value, f"{derived} (from its stages)")
        return times


def slowest(times: Sequence[RankTimes]) -> tuple[RankTimes, str]:
    """The slowest rank, and how slow in the terms ranks were compared by (see
    :func:`_by_plan`): ``1.8x its plan``, or ``0.41 s of compute per step``."""
    late = max(times, key=_slowness(times))
    if _by_plan(times) and late.vs_plan is not None:
        return late, f"{_figure(late.vs_plan)}x its plan"
    return late, f"{late.busy:.3g} s of compute per step"


def _by_plan(times: Sequence[RankTimes]) -> bool:
    """Whether ranks are compared by their compute against their plans (every rank has a
    prediction), else by their compute alone."""
    return all(t.vs_plan is not None for t in times)


def _slowness(times: Sequence[RankTimes]) -> Any:
    """What ranks are compared by (see :func:`_by_plan`)."""
    if _by_plan(times):
        return lambda t: t.vs_plan
    return lambda t: t.busy


def cores_shared(device: torch.device) -> tuple[int, int] | None:
    """On the CPU, when this machine's ranks outnumber the cores they may run on: (ranks, cores).
    A plan made for the CPU gives each rank a core of its own (one thread, as torchrun runs
    it); ranks sharing cores compute ranks / cores times slower. None on a GPU or with a core
    for every rank."""
    if device.type != "cpu":
        return None
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (ranks, cores) if cores and ranks > cores else None


class StepTimes:
    """This rank's step times and its stages' compute between ``--log-every`` steps;
    :meth:`gather` (collective) hands every rank's to each rank."""

    def __init__(
        self,
        pipeline: Pipeline,
        busy: BusyTimes,
        ranks: RankMesh,
        microbatches_per_step: int,
        device: torch.device,
        with_plan: bool = True,
        plan_scale: float = 1.0,
    ) -> None:
        """``busy``: this rank's compute, fed by the hooks; ``ranks``: the run's mesh (which
        stages each global rank runs); ``microbatches_per_step``: the microbatches each rank
        runs per step (--microbatches x --accumulate); ``with_plan`` False: the plan is another
        device's, ranks are compared by their compute alone;
        ``plan_scale``: how much slower than planned the device runs each rank (ranks sharing
        CPU cores, :func:`cores_shared`)."""
        self.pipeline = pipeline
        self.busy = busy
        self.ranks = ranks
        self.microbatches_per_step = microbatches_per_step
        self.device = device
        costs = pipeline.schedule.costs
        # per microbatch; none when the plan is another device's
        self.planned = [
            (f + b) * with_plan * plan_scale for f, b in zip(costs.forward, costs.backward)
        ]
        self.steps = 0
        self.seconds = 0.0
        self.scale = 0.0  # the steps' FLOPs relative to the plan's, added up

    def add_step(self, seconds: float, scale: float = 1.0) -> None:
        """A training step of ``seconds``, of ``scale`` times the plan's FLOPs (dynamic
        dimensions)."""
        self.steps += 1
        self.seconds += seconds
        self.scale += scale

    def gather(self) -> list[RankTimes]:
        """Every rank's times since the last gather, in rank order (one all-gather); then a
        fresh start."""
        num_stages = self.pipeline.num_stages
        forward, backward = self.busy.take()
        mine = torch.tensor(
            [
                float(self.steps),
                self.seconds,
                self.scale,
                *(forward.get(s, 0.0) for s in range(num_stages)),
                *(backward.get(s, 0.0) for s in range(num_stages)),
            ],
            dtype=torch.float64,
            device=self.device,
        )
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        self.steps, self.seconds, self.scale = 0, 0.0, 0.0
        times = []
        for rank, values in enumerate(torch.stack(every).tolist()):  # one copy to the host
            steps, seconds, scale, *rest = values
            steps = max(steps, 1.0)
            stages = tuple(
                StageTimes(
                    stage=s.index,
                    forward=rest[s.index] / steps,
                    backward=rest[num_stages + s.index] / steps,
                    planned=self.planned[s.index] * self.microbatches_per_step * scale / steps,
                )
                for s in self.pipeline.stages_on(self.ranks.pp_rank_of(rank))
            )
            times.append(RankTimes(rank, seconds / steps, stages))
        return times


class Stragglers:
    """Names a rank consistently slower than its peers: the other data-parallel ranks of its
    pipeline rank (on the run's mesh ``ranks``) when there are any, else the other ranks."""

    def __init__(self, ranks: RankMesh, lines: int = STRAGGLER_LINES) -> None:
        self.ranks = ranks
        self.dp_size = ranks.dp_size
        self.lines = lines
        #: each rank's consecutive log lines slower than its peers: (its figure, theirs)
        self.slower: dict[int, list[tuple[float, float]]] = {}
        self.named: set[int] = set()

    def peers(self, rank: int) -> list[int]:
        """The global ranks global rank ``rank`` is compared with, ascending."""
        if self.dp_size > 1:
            replicas = self.ranks.dp_ranks(self.ranks.pp_rank_of(rank), self.ranks.tp_rank_of(rank))
            return sorted(r for r in replicas if r != rank)
        return [r for r in range(self.ranks.world) if r != rank]

    def observe(self, times: Sequence[RankTimes]) -> str | None:
        """The note naming a straggler, the first time one has been slower than its peers on
        :attr:`lines` consecutive log lines (its figures and theirs: medians over those
        lines); None otherwise."""
        if len(times) < 2:
            return None
        value = _slowness(times)
        margin = REPLICA_MARGIN if self.dp_size > 1 else OTHERS_MARGIN
        note = None
        for mine in times:
            peers = self.peers(mine.rank)
            typical = statistics.median(value(times[r]) for r in peers)
            if typical <= 0 or value(mine) < margin * typical:
                self.slower[mine.rank] = []
                continue
            lines = self.slower.setdefault(mine.rank, [])
            lines.append((value(mine), typical))
            if len(lines) >= self.lines and mine.rank not in self.named:
                self.named.add(mine.rank)
                note = self._note(mine, peers, lines, _by_plan(times))
        return note

    def _note(
        self, mine: RankTimes, peers: list[int], lines: list[tuple[float, float]], by_plan: bool
    ) -> str:
        """The note naming ``mine`` a straggler; ``by_plan``: its ``lines`` are figures against
        the plans (:func:`_by_plan`), else seconds of compute."""
        ours = statistics.median(v for v, _ in lines)
        theirs = statistics.median(t for _, t in lines)
        whose = (
            f"its data-parallel replicas ({rank_list(peers)})"
            if self.dp_size > 1
            else "the other ranks (median)"
        )
        if by_plan:
            figures = f"{_figure(ours)}x its plan against {_figure(theirs)}x"
        else:
            figures = f"{ours:.3g} s of compute per step against {theirs:.3g} s"
        return (
            f"{mine.label} is a straggler: {figures} for {whose} over the last {len(lines)} log "
            f"steps, {_figure(ours / theirs)} times slower"
        )


def _figure(value: float) -> str:
    """``1.8``, ``24``: two significant figures, no exponent."""
    return f"{value:.2g}" if value < 10 else f"{value:.0f}"
