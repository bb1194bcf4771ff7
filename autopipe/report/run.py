"""A traced run against its prediction: what ``autopipe report DIR --run TRACE`` adds.

:class:`RunComparison` reads the ``--trace`` directory of a ``train.py`` run
(:class:`~autopipe.run_trace.RunTrace`), checks that it ran this package's pipeline, and
simulates the run as it ran -- its schedule and microbatch count, which ``train.py --schedule``
and ``--microbatches`` may have changed from the package's -- with the package's stage costs.
It sets the two side by side: each stage's forward and backward per microbatch, a pipeline run's
time and bubble, and the actions whose measured time is furthest from the prediction.

The prediction's profile is often of another device than the one the run ran on (an H100
analytic profile against a CPU run), so deviations are judged against the *scale*: the run's
measured compute per microbatch over the predicted, all stages together. A stage deviates when
its own measured / predicted ratio is far from the other stages' together, an action when its
ratio is far from the scale.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from ..errors import ArtifactError, PartitionError
from ..partitioning.simulator import Simulation, schedule_orders, simulate
from .run_trace import PipelineRun, RunTrace
from ..runtime.core.schedules import Action
from ..runtime.core.timeline_format import COMPUTE, KINDS
from .data import KIND_NAMES, ReportData

__all__ = [
    "DEVIATIONS",
    "DRAW_SCALED",
    "FAR",
    "Deviation",
    "Event",
    "RunComparison",
    "StageComparison",
]

#: a measured / predicted ratio this many times the reference (or 1/this) is called a deviation
FAR = 1.5
#: the actions listed as deviating most
DEVIATIONS = 10
#: the predicted timeline is drawn scaled to the run's when the scale is beyond this (or 1/this)
DRAW_SCALED = 2.0

#: (row, action, start, end), seconds: a box of a Gantt chart
Event = tuple[int, Action, float, float]


def _ratio(measured: float, predicted: float) -> float:
    return measured / predicted if predicted > 0 else math.inf


def _times(factor: float) -> str:
    """``2.1x slower``, ``1.7x faster``; what a factor of 0 or infinity means (a part measured
    as taking no time, or predicted to)."""
    if factor <= 0:
        return "no time measured"
    if math.isinf(factor):
        return "no time predicted"
    return f"{factor:.1f}x slower" if factor >= 1 else f"{1 / factor:.1f}x faster"


@dataclass(frozen=True)
class StageComparison:
    """One stage's measured and predicted forward and backward per microbatch (seconds), and
    ``others``: the measured / predicted compute of the other stages together (0 when there are
    none), which the stage's own ratio is judged against."""

    stage: int
    rank: int  # the pipeline rank that runs it
    measured_forward: float
    measured_backward: float
    predicted_forward: float
    predicted_backward: float
    count: int  # the measured microbatches averaged
    others: float

    @property
    def forward_ratio(self) -> float:
        return _ratio(self.measured_forward, self.predicted_forward)

    @property
    def backward_ratio(self) -> float:
        return _ratio(self.measured_backward, self.predicted_backward)

    @property
    def ratio(self) -> float:
        """Measured over predicted forward + backward."""
        return _ratio(
            self.measured_forward + self.measured_backward,
            self.predicted_forward + self.predicted_backward,
        )

    @property
    def relative(self) -> float:
        """The stage's ratio over the other stages' (1.0 for a pipeline of one stage)."""
        return self.ratio / self.others if self.others > 0 else 1.0

    @property
    def deviates(self) -> bool:
        return not 1 / FAR < self.relative < FAR

    @property
    def verdict(self) -> str:
        """``in line with the other stages``, or how far off it is and which part most."""
        if self.others <= 0:
            return "the only stage"
        if not self.deviates:
            return "in line with the other stages"
        if not 0 < self.relative < math.inf:
            return f"{_times(self.relative)} for it, unlike the other stages"
        part, ratio = max(
            (("forward", self.forward_ratio), ("backward", self.backward_ratio)),
            key=lambda p: abs(math.log(p[1] / self.others)) if 0 < p[1] < math.inf else math.inf,
        )
        return (
            f"{_times(self.relative)} than the other stages against the prediction "
            f"(its {part}: {_times(ratio / self.others)})"
        )


@dataclass(frozen=True)
class Deviation:
    """One measured action against its predicted duration (seconds): where and when it ran,
    and ``scale``, the run's measured / predicted compute its ratio is judged against."""

    rank: int
    action: Action
    step: int
    round: int
    measured: float
    predicted: float
    scale: float

    @property
    def ratio(self) -> float:
        return _ratio(self.measured, self.predicted)

    @property
    def relative(self) -> float:
        """The action's ratio over the scale: 1.0 where it is as the prediction, scaled."""
        return self.ratio / self.scale

    @property
    def kind(self) -> str:
        return KIND_NAMES[self.action.kind]

    @property
    def against_scale(self) -> str:
        """``2.1x slower`` (than the prediction, scaled), ``1.7x faster``."""
        return _times(self.relative)


@dataclass(frozen=True)
class RunComparison:
    """A compiled pipeline (``data``), a traced run of it (``trace``) and the prediction of
    that run (``simulation``: one pipeline run under the run's schedule and microbatches)."""

    data: ReportData
    trace: RunTrace
    simulation: Simulation

    @classmethod
    def load(cls, data: ReportData, directory: str | os.PathLike[str]) -> RunComparison:
        """The run traced into ``directory`` against the pipeline of ``data``; an
        :class:`ArtifactError` says why they do not go together."""
        trace = RunTrace.load(directory)
        trace.check(data.pipeline, data.directory)
        run = trace.run
        try:
            orders = schedule_orders(run.schedule, data.costs, run.microbatches)
            simulation = simulate(orders, data.costs)
        except PartitionError as exc:
            raise ArtifactError(
                f"{trace.directory}: the run's {run.schedule} schedule with {run.microbatches} "
                f"microbatches cannot be predicted for {data.directory}: {exc}"
            ) from None
        return cls(data, trace, simulation)

    # -- the whole run -------------------------------------------------------------------------
    @cached_property
    def scale(self) -> float:
        """The run's measured compute per microbatch over the predicted, all stages together."""
        measured = sum(s.time for s in self.trace.stage_times)
        predicted = sum(self.data.costs.forward) + sum(self.data.costs.backward)
        return measured / predicted if predicted > 0 and measured > 0 else 1.0

    @property
    def drawn_scale(self) -> float:
        """What the predicted timeline's times are multiplied by to be drawn beside the
        measured one: the scale when it is beyond :data:`DRAW_SCALED` either way (a prediction
        for another device), else 1."""
        return self.scale if not 1 / DRAW_SCALED <= self.scale <= DRAW_SCALED else 1.0

    @property
    def predicted_run_time(self) -> float:
        return self.simulation.step_time

    @property
    def outside_runs(self) -> float:
        """A step's measured seconds outside its pipeline runs (gradient reduction, optimizer)."""
        return max(self.trace.step_time - self.trace.run.accumulate * self.trace.run_time, 0.0)

    @property
    def predicted_outside_runs(self) -> float | None:
        """The plan's seconds of a step outside its pipeline runs (the gradients, the collectives
        no compute hides, the optimizer step), where neither the plan nor the run had data
        parallelism; None where the partition predicted none, or either had: a trace records
        its data-parallel ranks (replicas x shards) but not how they split, and FSDP2's
        once-a-step gather is timed inside the first forward."""
        partition = self.data.partition
        predicted, planned = partition.predicted, partition.settings.dp_shard or 1
        if predicted is None or predicted.optimizer_time is None:
            return None
        return predicted.once_per_step if self.trace.run.dp_size == planned == 1 else None

    def summary_rows(self) -> list[tuple[str, str]]:
        """The section's header table (also the start of :meth:`summary`)."""
        run, trace = self.trace.run, self.trace
        steps = trace.steps
        replicas = f"{run.dp_size} data-parallel replica{'s' if run.dp_size > 1 else ''}"
        accumulate = f", {run.accumulate} runs per step" if run.accumulate > 1 else ""
        outside, predicted = self.predicted_outside_runs, self.data.partition.predicted
        if outside is not None:
            besides = f"predicted {outside * 1e3:.3f} ms"
        elif predicted is None or predicted.optimizer_time is None:
            besides = "not predicted by this partition"
        else:
            besides = "not compared under data parallelism"
        return [
            ("trace", str(trace.directory)),
            (
                "run",
                f"{run.schedule}, {run.microbatches} microbatches{accumulate}; "
                f"{run.pp_size} pipeline ranks x {replicas}, on {trace.device}; "
                f"steps {steps[0]}-{steps[-1]} traced",
            ),
            ("prediction", f"{self.data.partition.profile_source}, simulated for this run"),
            (
                "pipeline run",
                f"measured {trace.run_time * 1e3:.3f} ms, predicted "
                f"{self.predicted_run_time * 1e3:.3f} ms "
                f"(x{_ratio(trace.run_time, self.predicted_run_time):.2f})",
            ),
            (
                "bubble",
                f"measured {trace.bubble * 100:.1f}% idle, predicted "
                f"{self.simulation.bubble * 100:.1f}% idle",
            ),
            (
                "step",
                f"measured {trace.step_time * 1e3:.3f} ms: {run.accumulate} pipeline "
                f"run{'s' if run.accumulate > 1 else ''} and {self.outside_runs * 1e3:.3f} ms "
                f"besides (gradients, optimizer: {besides})",
            ),
            (
                "scale",
                f"measured / predicted compute x{self.scale:.2f}; stages and actions are "
                "judged against it",
            ),
        ] + self._unit_rows()

    def _unit_rows(self) -> list[tuple[str, str]]:
        """FSDP2's time per rank and step, where the run recorded it."""
        times = self.trace.unit_times
        if not times:
            return []
        parts = ", ".join(
            f"{KINDS[kind]} {seconds * 1e3:.3f} ms" for kind, seconds in times.items()
        )
        return [("FSDP2", f"per rank and step: {parts} (within the actions above)")]

    # -- stages --------------------------------------------------------------------------------
    @cached_property
    def stages(self) -> tuple[StageComparison, ...]:
        costs = self.data.costs
        measured = self.trace.stage_times
        rows = []
        for s, times in enumerate(measured):
            others_measured = sum(t.time for t in measured if t.stage != s)
            others_predicted = sum(
                costs.forward[o] + costs.backward[o] for o in range(len(measured)) if o != s
            )
            rows.append(
                StageComparison(
                    stage=s,
                    rank=costs.device_of_stage[s],
                    measured_forward=times.forward,
                    measured_backward=times.backward,
                    predicted_forward=costs.forward[s],
                    predicted_backward=costs.backward[s],
                    count=times.count,
                    others=(
                        others_measured / others_predicted
                        if others_measured > 0 and others_predicted > 0
                        else 0.0
                    ),
                )
            )
        return tuple(rows)

    # -- actions -------------------------------------------------------------------------------
    @cached_property
    def _predicted(self) -> dict[tuple[int, str, int], float]:
        """Each simulated action's compute seconds, by (stage, kind, microbatch): without the
        wait on its receives, which the simulation charges to the action and a trace to the
        receive (its span of the action begins once the tensors are there)."""
        costs = self.data.costs
        return {
            (a.stage, a.kind, a.microbatch): costs.compute(a)
            for _, a, _, _ in self.simulation.events
        }

    @cached_property
    def actions(self) -> tuple[Deviation, ...]:
        """Every measured compute action with its prediction, in rank then start order."""
        found = []
        for timeline in self.trace.timelines:
            for r in timeline.records:
                if r.kind not in COMPUTE or r.stage is None or r.microbatch is None:
                    continue
                action = Action(r.stage, KINDS[r.kind], r.microbatch)
                predicted = self._predicted.get((action.stage, action.kind, action.microbatch))
                if predicted is None or predicted <= 0:
                    continue
                found.append(
                    Deviation(
                        rank=timeline.rank,
                        action=action,
                        step=r.step,
                        round=r.round,
                        measured=(r.end_ns - r.start_ns) / 1e9,
                        predicted=predicted,
                        scale=self.scale,
                    )
                )
        return tuple(found)

    @cached_property
    def deviations(self) -> tuple[Deviation, ...]:
        """The :data:`DEVIATIONS` actions furthest from the prediction, scaled, furthest first."""

        def distance(d: Deviation) -> float:
            return abs(math.log(d.relative)) if d.measured > 0 else math.inf

        ranked = sorted(
            self.actions,
            key=lambda d: (
                -distance(d),
                d.step,
                d.round,
                d.rank,
                d.action.stage,
                d.action.kind,
                d.action.microbatch,
            ),
        )
        return tuple(ranked[:DEVIATIONS])

    # -- timelines -----------------------------------------------------------------------------
    @property
    def shown_run(self) -> PipelineRun:
        """The pipeline run the measured timeline shows: the first traced step's first."""
        return self.trace.runs[0]

    @cached_property
    def measured_events(self) -> list[Event]:
        """The shown run's compute actions on the ranks of data-parallel replica 0, by pipeline
        rank, in seconds from the first one's start, in start order."""
        run = self.shown_run
        spans: list[tuple[int, Action, int, int]] = []
        for timeline in self.trace.timelines:
            if timeline.dp_rank != 0:
                continue
            for r in timeline.records:
                if r.kind not in COMPUTE or r.stage is None or r.microbatch is None:
                    continue
                if (r.step, r.round) == (run.step, run.round):
                    action = Action(r.stage, KINDS[r.kind], r.microbatch)
                    spans.append((timeline.pp_rank, action, r.start_ns, r.end_ns))
        origin = min((s[2] for s in spans), default=0)
        events = [
            (rank, a, (start - origin) / 1e9, (end - origin) / 1e9) for rank, a, start, end in spans
        ]
        return sorted(events, key=lambda e: (e[2], e[0]))

    @property
    def predicted_events(self) -> list[Event]:
        """The simulated run's actions, times multiplied by :attr:`drawn_scale`."""
        factor = self.drawn_scale
        return [(d, a, start * factor, end * factor) for d, a, start, end in self.simulation.events]

    # -- text ----------------------------------------------------------------------------------
    def summary(self) -> str:
        """What ``autopipe report DIR --run TRACE`` prints: the run against the prediction,
        each stage, the stages that deviate and the actions that deviate most."""
        lines = [f"{key}: {value}" for key, value in self.summary_rows()[1:]]
        header = ("stage", "fwd ms", "predicted", "ratio", "bwd ms", "predicted", "ratio")
        rows = [
            (
                str(s.stage),
                f"{s.measured_forward * 1e3:.3f}",
                f"{s.predicted_forward * 1e3:.3f}",
                f"x{s.forward_ratio:.2f}",
                f"{s.measured_backward * 1e3:.3f}",
                f"{s.predicted_backward * 1e3:.3f}",
                f"x{s.backward_ratio:.2f}",
            )
            for s in self.stages
        ]
        lines.append("per microbatch, measured and predicted:")
        lines += _columns(header, rows)
        off = [s for s in self.stages if s.deviates and s.others > 0]
        lines += [f"stage {s.stage}: {s.verdict}" for s in off] or [
            f"no stage is more than {FAR}x off the other stages against the prediction"
        ]
        lines.append("most deviating actions, against the scale:")
        lines += _columns(
            ("rank", "action", "step", "measured ms", "predicted ms", "ratio", "vs scale"),
            [
                (
                    str(d.rank),
                    str(d.action) + (f".{d.round}" if d.round else ""),
                    str(d.step),
                    f"{d.measured * 1e3:.3f}",
                    f"{d.predicted * 1e3:.3f}",
                    f"x{d.ratio:.2f}",
                    d.against_scale,
                )
                for d in self.deviations
            ],
        )
        return "\n".join(lines)


def _columns(header: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> list[str]:
    """``header`` and ``rows`` as right-aligned columns, indented by two spaces."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return ["  " + " ".join(c.rjust(w) for c, w in zip(row, widths)) for row in [header, *rows]]
