"""A traced training run, read back: what ``train.py --trace DIR`` recorded on every rank.

:class:`RunTrace` reads the ``rankR.json`` timelines of one run (their format:
:mod:`autopipe.runtime.core.timeline_format`), checks that they belong together and to a
package, and derives the measured facts that ``autopipe report --run`` and ``autopipe replan
--from-trace`` compare with the prediction: each stage's forward and backward time per
microbatch, the time of each step and of each pipeline run, and the bubble. Times are seconds; a
measure is a mean over the traced steps, accumulation rounds, microbatches and data-parallel
replicas, unless it says otherwise.
"""

from __future__ import annotations

import os
import re
import statistics
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from ..errors import ArtifactError
from ..runtime.core.pipeline import Pipeline
from ..runtime.core.timeline_format import (
    COMPUTE,
    UNITS,
    RankTimeline,
    Record,
    RunLayout,
    TimelineFormatError,
)

__all__ = ["RunTrace", "MeasuredStage", "PipelineRun"]

_RANK_FILE = re.compile(r"rank(\d+)\.json")


@dataclass(frozen=True)
class MeasuredStage:
    """One stage's measured compute per microbatch: ``forward`` and ``backward`` (a full
    backward, or its input and weight parts added), means over the ``count`` microbatches the
    trace holds of it (every traced step, round and data-parallel replica)."""

    stage: int
    forward: float
    backward: float
    count: int

    @property
    def time(self) -> float:
        return self.forward + self.backward


@dataclass(frozen=True)
class PipelineRun:
    """One pipeline run (a step's accumulation round, on one data-parallel replica's ranks): from
    the first compute action's start to the last one's end over those ranks, and the
    nanoseconds each of them computed in it."""

    step: int
    round: int
    replica: int  # the data-parallel rank whose pipeline ranks ran it
    start_ns: int
    end_ns: int
    busy_ns: tuple[int, ...]  # by pipeline rank

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9

    @property
    def bubble(self) -> float:
        """The fraction of the ranks' time in the run spent idle."""
        span = (self.end_ns - self.start_ns) * len(self.busy_ns)
        return 1 - sum(self.busy_ns) / span if span > 0 else 0.0


@dataclass(frozen=True)
class RunTrace:
    """Every rank's timeline of one traced run, in rank order."""

    directory: Path
    timelines: tuple[RankTimeline, ...]

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> RunTrace:
        """The timelines in ``directory`` (the ``--trace`` directory of ``train.py``); an
        :class:`ArtifactError` names what is missing or wrong."""
        directory = Path(directory)
        if not directory.is_dir():
            raise ArtifactError(
                f"{directory} is not a directory; give the --trace directory of a train.py run"
            )
        files = {}
        for path in directory.iterdir():
            match = _RANK_FILE.fullmatch(path.name)
            if match:
                files[int(match.group(1))] = path
        if not files:
            raise ArtifactError(
                f"{directory} has no rankR.json timelines; give the --trace directory of a "
                "train.py run that reached its last traced step"
            )
        timelines = []
        for rank in sorted(files):
            try:
                timeline = RankTimeline.from_json(files[rank].read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, TimelineFormatError) as exc:
                raise ArtifactError(f"{files[rank]}: not a timeline of train.py --trace: {exc}")
            if timeline.rank != rank:
                raise ArtifactError(f"{files[rank]}: holds rank {timeline.rank}'s timeline")
            timelines.append(timeline)
        trace = cls(directory, tuple(timelines))
        trace._check_together()
        return trace

    def _check_together(self) -> None:
        first = self.timelines[0]
        world = first.run.pp_size * first.run.dp_size
        ranks = {t.rank for t in self.timelines}
        beyond = sorted(r for r in ranks if r >= world)
        if beyond:
            raise ArtifactError(
                f"{self.directory}: rank 0's timeline is of a run of {world} ranks, but it holds "
                f"rank{'s' if len(beyond) > 1 else ''} {', '.join(map(str, beyond))}'s too, of "
                "another run: trace each run into a directory of its own"
            )
        missing = sorted(set(range(world)) - ranks)
        if missing:
            raise ArtifactError(
                f"{self.directory}: a run of {world} ranks, but the timelines of rank(s) "
                f"{', '.join(map(str, missing))} are missing (every rank writes rankR.json at "
                "its last traced step)"
            )
        for timeline in self.timelines[1:]:
            if (timeline.run, timeline.steps) != (first.run, first.steps):
                raise ArtifactError(
                    f"{self.directory}: rank {timeline.rank}'s timeline is of another run than "
                    f"rank 0's (run {timeline.run}, steps {timeline.steps} against {first.run}, "
                    f"{first.steps}); trace each run into a directory of its own"
                )
        if not self.steps:
            raise ArtifactError(
                f"{self.directory}: no traced step ran (--trace-steps {first.steps[0]}:"
                f"{first.steps[1]}); trace steps the run runs"
            )

    def check(self, pipeline: Pipeline, package: str | os.PathLike[str]) -> None:
        """That this run ran the package ``package`` (whose description is ``pipeline``): its
        ``pipeline.json``, split included, is the one the trace records."""
        if self.run.pipeline == pipeline.digest():
            return
        differs = (
            f"it ran {self.run.num_stages} stages, {package} has {pipeline.num_stages}"
            if self.run.num_stages != pipeline.num_stages
            else "another split or build of it, or another model"
        )
        raise ArtifactError(
            f"{self.directory} traced a run of another package than {package} ({differs}; "
            f"pipeline digest {self.run.pipeline}, the package's {pipeline.digest()}): give the "
            "package the run trained (a recompiled or replanned package is another one)"
        )

    # -- what the run was ----------------------------------------------------------------------
    @property
    def run(self) -> RunLayout:
        return self.timelines[0].run

    @cached_property
    def steps(self) -> tuple[int, ...]:
        """The steps with records, in order."""
        return tuple(sorted({r.step for t in self.timelines for r in t.records}))

    @property
    def device(self) -> str:
        return self.timelines[0].device

    def compute(self, rank: int) -> list[Record]:
        """Rank ``rank``'s compute actions (forward, backward and its parts), in start order."""
        return [r for r in self.timelines[rank].records if r.kind in COMPUTE]

    # -- measures ------------------------------------------------------------------------------
    @cached_property
    def stage_times(self) -> tuple[MeasuredStage, ...]:
        """Each stage's measured forward and backward per microbatch, by stage."""
        forward: dict[int, list[int]] = {}
        backward: dict[tuple[int, int, int, int, int], int] = {}  # a microbatch's B or I + W
        for timeline in self.timelines:
            for r in timeline.records:
                if r.kind not in COMPUTE or r.stage is None or r.microbatch is None:
                    continue
                duration = r.end_ns - r.start_ns
                if r.kind == "forward":
                    forward.setdefault(r.stage, []).append(duration)
                else:
                    key = (timeline.rank, r.step, r.round, r.stage, r.microbatch)
                    backward[key] = backward.get(key, 0) + duration
        by_stage: dict[int, list[int]] = {}
        for (_, _, _, stage, _), duration in backward.items():
            by_stage.setdefault(stage, []).append(duration)
        return tuple(
            MeasuredStage(
                stage=s,
                forward=statistics.fmean(forward.get(s, [0])) / 1e9,
                backward=statistics.fmean(by_stage.get(s, [0])) / 1e9,
                count=len(forward.get(s, [])),
            )
            for s in range(self.run.num_stages)
        )

    @cached_property
    def runs(self) -> tuple[PipelineRun, ...]:
        """Every pipeline run of the traced steps: one per step, accumulation round and
        data-parallel replica (each replica's ranks run their own pipeline)."""
        spans: dict[tuple[int, int, int], list[int]] = {}
        busy: dict[tuple[int, int, int], list[int]] = {}
        ranks = self.run.pp_size
        for timeline in self.timelines:
            for r in timeline.records:
                if r.kind not in COMPUTE:
                    continue
                key = (r.step, r.round, timeline.dp_rank)
                span = spans.setdefault(key, [r.start_ns, r.end_ns])
                span[0], span[1] = min(span[0], r.start_ns), max(span[1], r.end_ns)
                busy.setdefault(key, [0] * ranks)[timeline.pp_rank] += r.end_ns - r.start_ns
        return tuple(
            PipelineRun(step, round_, replica, start, end, tuple(busy[step, round_, replica]))
            for (step, round_, replica), (start, end) in sorted(spans.items())
        )

    @property
    def run_time(self) -> float:
        """A pipeline run's measured seconds (what the simulator predicts as the step)."""
        return statistics.fmean(run.seconds for run in self.runs) if self.runs else 0.0

    @property
    def bubble(self) -> float:
        """The measured fraction of rank time idle during the pipeline runs."""
        return statistics.fmean(run.bubble for run in self.runs) if self.runs else 0.0

    @cached_property
    def step_times(self) -> dict[int, float]:
        """Each traced step's seconds, from the first rank's start to the last rank's end."""
        spans: dict[int, list[int]] = {}
        for timeline in self.timelines:
            for r in timeline.records:
                if r.kind == "step":
                    span = spans.setdefault(r.step, [r.start_ns, r.end_ns])
                    span[0], span[1] = min(span[0], r.start_ns), max(span[1], r.end_ns)
        return {step: (end - start) / 1e9 for step, (start, end) in sorted(spans.items())}

    @cached_property
    def unit_times(self) -> dict[str, float]:
        """FSDP2's seconds per rank and step by kind (unshard, reshard, fsdp_reduce), those
        recorded (none without data parallelism); on a rank they overlap the compute they
        happen in."""
        totals: dict[str, int] = {}
        for timeline in self.timelines:
            for r in timeline.records:
                if r.kind in UNITS:
                    totals[r.kind] = totals.get(r.kind, 0) + r.end_ns - r.start_ns
        per = len(self.timelines) * max(len(self.steps), 1)
        return {kind: totals[kind] / per / 1e9 for kind in sorted(totals)}

    @property
    def step_time(self) -> float:
        """A step's measured seconds (pipeline runs, gradient reduction and optimizer)."""
        return statistics.fmean(self.step_times.values()) if self.step_times else 0.0
