"""Re-partition a pipeline package from the measured times of a real run: ``autopipe replan
PKG --from-trace TRACE_DIR --out NEWPKG``.

A run of ``train.py --trace TRACE_DIR`` measures each stage's forward and backward per
microbatch on the real devices, under the real communication (see :mod:`autopipe.run_trace`).
:func:`replan` turns those into a profile (:func:`traced_profile`): each stage's measured
forward is spread over its units in proportion to the package profile's unit forwards, and so is
its backward (less the forward it recomputed, when the run recomputed activations), so a
stage measured three times slower than predicted has every one of its units three times slower,
forward and backward scaled apart; memory and transfers keep the package profile's model (the
trace records only when sends and receives were created). It then partitions the graph again
under that profile, with the package's settings (stage and device count, method, optimizer,
sharding, memory margin) and the traced run's schedule, microbatches and accumulation, and
simulates the old split under the same profile, so the two predicted steps compare like with
like. :func:`write_replan` writes the new package as ``autopipe compile`` writes one (atomically,
under the output's lock, an existing output replaced only with ``force``), only when its
predicted step is shorter by the asked-for margin. The new package trains the same graph, so its
checkpoints are the old run's: ``train.py --resume`` continues the old run's checkpoint directory
(DCP reshards the tensors onto the new stages).

Unit times are what the run measured on the stage that ran them: the slowness of a slow device
is attributed to the units it ran, so a unit moved off it keeps its slow time in the prediction
(the gain predicted for moving work away from a straggler is a lower bound), and a unit moved
onto it keeps its fast one.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from .codegen import check_output_dir
from .codegen.output_lock import output_lock
from .compiler import generate_step, load_graph, tensor_parallel_profile
from .errors import ArtifactError, AutopipeError
from .ir import Graph
from .partitioning import DEFAULT_METHOD, METHODS, CostModel, Partition, partition
from .partitioning.cost import block_costs, iteration_time, unit_passes
from .partitioning.network import Network
from .partitioning.partition import PredictedStep
from .profiling.profile import TRACED, Profile
from .report import ReportData, write_report
from .report.run_trace import MeasuredStage, RunTrace
from .runtime.core.pipeline import PIPELINE_INNERMOST
from .runtime.core.timeline_format import RunLayout
from .report.summary import stage_span

__all__ = [
    "MIN_GAIN",
    "NoGainError",
    "Replan",
    "replan",
    "replan_text",
    "traced_profile",
    "write_replan",
]

#: the smallest predicted gain :func:`write_replan` writes a package for, by default
MIN_GAIN = 0.01


class NoGainError(AutopipeError):
    """The new split does not predict a step shorter by the asked-for margin: nothing written."""


@dataclass(frozen=True)
class Replan:
    """A package's split and a new one, both predicted under the profile measured in a traced
    run of the package."""

    package: Path
    trace: RunTrace
    graph: Graph
    old: Partition  # the package's partition, as it was compiled
    old_profile: Profile  # the package's profile
    profile: Profile  # the traced profile (the device's whole memory)
    before: PredictedStep  # the old split under the traced profile and the run's schedule
    new: Partition  # the new split; its prediction is under the traced profile

    @property
    def accumulate(self) -> int:
        return self.trace.run.accumulate

    @property
    def old_step(self) -> float:
        """The old split's predicted seconds per optimizer step under the traced profile."""
        return iteration_time(self.before, self.accumulate)

    @property
    def new_step(self) -> float:
        """The new split's predicted seconds per optimizer step under the traced profile."""
        assert self.new.predicted is not None  # partition() predicts every partition it makes
        return iteration_time(self.new.predicted, self.accumulate)

    @property
    def gain(self) -> float:
        """The fraction of the old split's predicted step the new one saves (negative: slower)."""
        return 1 - self.new_step / self.old_step if self.old_step > 0 else 0.0

    @property
    def moved(self) -> bool:
        """Whether the new split differs from the old one."""
        return (self.new.stage_of_unit, self.new.device_of_stage) != (
            self.old.stage_of_unit,
            self.old.device_of_stage,
        )


def replan(
    package: str | os.PathLike[str],
    trace_dir: str | os.PathLike[str],
    *,
    method: str | None = None,
) -> Replan:
    """The package in ``package`` re-partitioned under the times its run traced in
    ``trace_dir`` measured (``method``: the partitioning method; default the package's)."""
    package = Path(package)
    data = ReportData.load(package)
    if data.profile is None:
        raise ArtifactError(
            f"{package} has no artifacts/profile.json (it was generated without "
            "--profile-file): replan spreads each stage's measured time over its units by the "
            "profile's unit times; compile the package with autopipe compile, or generate it "
            "with --profile-file"
        )
    trace = RunTrace.load(trace_dir)
    trace.check(data.pipeline, package)
    if trace.run.bf16 != data.profile.bf16:
        ran = "ran" if trace.run.bf16 else "did not run"
        planned = "for" if data.profile.bf16 else "without"
        wanted = "--bf16" if data.profile.bf16 else "--no-bf16"
        raise ArtifactError(
            f"the run traced in {trace_dir} {ran} --bf16, and {package} was planned {planned} "
            "it: the run's stage times are of another precision than the profile's unit times "
            f"replan would spread them over; trace a run at the plan's (train.py {wanted})"
        )
    graph = load_graph(package / "artifacts" / "graph.json")
    old, run = data.partition, trace.run
    settings = old.settings
    tp = settings.tp or 1
    cluster = settings.gpus_per_node or 8
    # each tensor-parallel rank's profile: its share of the sharded units' times and memory,
    # over which the measured stage times are spread
    sequence = bool(settings.sequence_parallel)
    profiled = (
        tensor_parallel_profile(graph, data.profile, tp, cluster, sequence)[0] if tp > 1 else None
    )
    optimizer, dp_shard = settings.optimizer or "adamw", settings.dp_shard or 1
    base = profiled or data.profile
    added = _added_gradients(graph, base, run, dp_shard)
    measured = traced_profile(graph, old, base, trace, _under_fsdp(run), added)
    margin = settings.memory_margin or 0.0
    device = measured.device.shared_by(old.processes_per_node)  # a CPU's ranks share a node's
    usable = dataclasses.replace(  # the memory the old partition was made to fit
        measured, device=dataclasses.replace(device, memory=device.memory * (1 - margin))
    )
    gpus_per_node = max(1, cluster // tp)  # a node's places of tp ranks each
    mesh = settings.mesh or PIPELINE_INNERMOST
    model = CostModel(
        graph,
        usable,
        schedule=run.schedule,
        microbatches=run.microbatches,
        optimizer=optimizer,
        dp_shard=dp_shard,
        network=Network(usable.device, gpus_per_node, mesh),
        pipeline_ranks=len(set(old.device_of_stage)),
    )
    before = model.evaluate(
        old.stage_of_unit,
        old.device_of_stage,
        run.schedule,
        frozenset(run.recompute),
        frozenset(run.recompute_blocks),
    ).record()
    new = partition(
        graph,
        usable,
        old.num_stages,
        num_devices=len(set(old.device_of_stage)),
        # a split the user fixed (--split-points) is replanned by the default method
        method=method or (old.method if old.method in METHODS else DEFAULT_METHOD),
        schedule=run.schedule,
        microbatches=run.microbatches,
        optimizer=optimizer,
        dp_shard=dp_shard,
        gpus_per_node=gpus_per_node,
        mesh=mesh,  # the ranks stay where the package puts them
    )
    new = new.with_settings(
        accumulate=run.accumulate if run.accumulate > 1 else None,
        memory_margin=settings.memory_margin,
        tp=settings.tp,  # the measured stages ran sharded; the new package is sharded alike
        sequence_parallel=settings.sequence_parallel,
    )
    if tp > 1:  # the cluster's node size, not its places'
        new = new.with_settings(gpus_per_node=cluster)
    return Replan(package, trace, graph, old, data.profile, measured, before, new)


def _under_fsdp(run: RunLayout) -> bool:
    """Whether FSDP2 managed the traced run's stages: any data parallelism (its bf16 policy
    gathers bf16 weights, which autocast then does not cast)."""
    return run.dp_size > 1


def _added_gradients(graph: Graph, profile: Profile, run: RunLayout, dp_shard: int) -> list[float]:
    """Per unit, the seconds the traced run's backwards spent adding gradients into the step's
    (:meth:`CostModel.accumulation_time`): none where FSDP2 sharded the stages (the plan's
    ``--dp-shard``, which a run of more than one data-parallel rank is taken to have run) and
    reduced every microbatch."""
    sharded = dp_shard if run.dp_size > 1 else 1
    return CostModel(graph, profile, schedule=run.schedule, dp_shard=sharded).accumulation


def traced_profile(
    graph: Graph,
    part: Partition,
    profile: Profile,
    trace: RunTrace,
    fsdp: bool = False,
    added: list[float] | None = None,
) -> Profile:
    """``profile`` with its unit times replaced by what ``trace`` measured of the stages of
    ``part`` that ran them: each stage's forward per microbatch spread over its units in
    proportion to their profiled forwards (evenly where the profile gives them none), and its
    backward, less the forward it recomputed, in proportion to their profiled backwards. Memory,
    FLOPs and bytes stay the profile's. With ``fsdp`` (FSDP2 managed the stages) a bf16 run's
    forwards did not cast the weights: each unit's casts (``cast_time``) are added to its
    forward, which holds them as a profile's does. ``added``: per unit, what the run's
    backwards spent adding gradients into the step's, taken off them (a profile's backward
    does not hold it: the cost model adds it for the layout it plans)."""
    profile.check_graph(graph)
    times = {t.stage: t for t in trace.stage_times}
    recomputed = _recomputed_units(graph, part, trace.run)
    units = list(profile.units)
    ran = unit_passes(profile, fsdp)[0]  # the forwards as the run ran them
    for stage in range(part.num_stages):
        mine = [u for u, s in enumerate(part.stage_of_unit) if s == stage]
        measured = times.get(stage)
        if measured is None or measured.count == 0:
            raise ArtifactError(
                f"{trace.directory} holds no forward of stage {stage}: trace steps the run "
                "trained (train.py --trace-steps A:B)"
            )
        forward = _spread(measured.forward, [ran[u] for u in mine])
        rerun = sum(f for u, f in zip(mine, forward) if u in recomputed)
        adding = sum(added[u] for u in mine) if added else 0.0
        backward = _spread(
            max(measured.backward - rerun - adding, 0.0), [profile.units[u].backward for u in mine]
        )
        for u, f, b in zip(mine, forward, backward):
            cast = profile.units[u].cast_time if fsdp and profile.bf16 else 0.0
            units[u] = dataclasses.replace(profile.units[u], forward=f + cast, backward=b)
    return Profile(
        mode=TRACED,
        device=profile.device,
        units=units,
        graph_digest=profile.graph_digest,
        measured_on=_run_text(trace),
        timed_at=dict(profile.timed_at),
        divided=dict(profile.divided),  # the parts of tensor-parallel ranks
        bf16=profile.bf16,
        autocast_dtypes=dict(profile.autocast_dtypes),
    )


def _spread(total: float, weights: list[float]) -> list[float]:
    """``total`` split in proportion to ``weights`` (evenly when they are all 0)."""
    whole = sum(weights)
    if whole > 0:
        return [total * w / whole for w in weights]
    return [total / len(weights)] * len(weights)


def _recomputed_units(graph: Graph, part: Partition, run: RunLayout) -> set[int]:
    """The units whose forward the traced run ran again in backward: those of the stages and
    of the blocks its ``--recompute`` recomputed."""
    units = {u for u, s in enumerate(part.stage_of_unit) if s in run.recompute}
    blocks = block_costs(graph)
    for fqn in run.recompute_blocks:
        if fqn in blocks and blocks[fqn].stage(part.stage_of_unit) is not None:
            units.update(blocks[fqn].units)
    return units


def _run_text(trace: RunTrace) -> str:
    """``the run traced in DIR (steps 1-3 on 2 cpu ranks)``: where a traced profile's times
    come from."""
    steps = trace.steps
    span = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
    ranks = len(trace.timelines)
    where = " ".join(str(trace.directory).split())  # one line, whatever the path holds
    return f"the run traced in {where} ({span} on {ranks} {trace.device} rank{'s' * (ranks > 1)})"


# -- what replan prints ------------------------------------------------------------------------
def replan_text(plan: Replan) -> str:
    """The measured stage times against the package's profile, each split's stages (units,
    predicted time per microbatch) and predicted step under the traced profile, and the gain."""
    trace, run, old = plan.trace, plan.trace.run, plan.old
    assert plan.new.predicted is not None  # partition() predicts every partition it makes
    measured = f"pipeline run {_ms(trace.run_time)}"
    if trace.step_times:
        measured = f"step {_ms(trace.step_time)}, {measured}"
    rows = [
        f"{_run_text(trace)}: {run.schedule}, {run.microbatches} microbatches"
        + (f" x {run.accumulate} accumulation" if run.accumulate > 1 else "")
        + f"; measured {measured}",
        f"measured per microbatch, against the package's {plan.old_profile.source}:",
    ]
    forward, backward = unit_passes(plan.old_profile, _under_fsdp(run))
    dp_shard = old.settings.dp_shard or 1
    added = _added_gradients(plan.graph, plan.old_profile, run, dp_shard)
    backward = [b + a for b, a in zip(backward, added)]  # as the run's backward adds them
    for times in trace.stage_times:
        rows.append(_measured_row(times, old, forward, backward))
    rows.append(
        f"old split, predicted under the measured profile: step {_ms(plan.old_step)} "
        f"(pipeline run {_ms(plan.before.step_time)})"
    )
    rows += _split_rows(plan.graph, old, plan.before)
    shorter = f"{plan.gain:.1%} shorter" if plan.gain >= 0 else f"{-plan.gain:.1%} longer"
    rows.append(
        f"new split ({plan.new.method}): step {_ms(plan.new_step)} "
        f"(pipeline run {_ms(plan.new.predicted.step_time)}), {shorter}"
        + ("" if plan.moved else "; the same split")
    )
    rows += _split_rows(plan.graph, plan.new, plan.new.predicted)
    return "\n".join(rows)


def _measured_row(
    times: MeasuredStage, part: Partition, forward: list[float], backward: list[float]
) -> str:
    """A stage's measured forward and backward, each against the package profile's units'
    (``forward``, ``backward``: as the run ran them, :func:`.partitioning.cost.unit_passes`)."""
    mine = [u for u, s in enumerate(part.stage_of_unit) if s == times.stage]
    profiled = (sum(forward[u] for u in mine), sum(backward[u] for u in mine))
    forward_text, backward_text = (
        f"{_ms(t)}" + (f" (x{t / p:.3g})" if p > 0 else "")
        for t, p in zip((times.forward, times.backward), profiled)
    )
    rank = part.device_of_stage[times.stage]
    return f"  stage {times.stage} on rank {rank}: forward {forward_text}, backward {backward_text}"


def _split_rows(graph: Graph, part: Partition, predicted: PredictedStep) -> list[str]:
    rows = []
    for stage in range(part.num_stages):
        units = [u for u, s in enumerate(part.stage_of_unit) if s == stage]
        first, last = stage_span(graph, part.stage_of_unit, stage)
        ends = first if len(units) == 1 else f"{first} .. {last}"
        rows.append(
            f"  stage {stage} on rank {part.device_of_stage[stage]}: "
            f"{len(units)} unit{'s' * (len(units) > 1)} {_ranges(units)} ({ends}), "
            f"{_ms(predicted.stages[stage].time)} per microbatch"
        )
    return rows


def _ranges(units: list[int]) -> str:
    """``0-3, 7``: sorted unit numbers as ranges."""
    spans: list[list[int]] = []
    for u in units:
        if spans and spans[-1][1] == u - 1:
            spans[-1][1] = u
        else:
            spans.append([u, u])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _ms(seconds: float) -> str:
    """``12.3 ms``, or ``4.56 s`` from a second on."""
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


# -- the new package ---------------------------------------------------------------------------
def write_replan(
    plan: Replan,
    out: str | os.PathLike[str],
    *,
    force: bool = False,
    report: bool = True,
    min_gain: float = MIN_GAIN,
    gpus_per_node: int = 8,
) -> Path:
    """Write the new split's package to ``out`` as ``autopipe compile`` does (with the traced
    profile as ``artifacts/profile.json`` and, with ``report``, its report), under ``out``'s
    lock, replacing a generated package there only with ``force``. Raises
    :class:`NoGainError`, writing nothing, when the new split does not predict a step at least
    ``min_gain`` (a fraction) shorter than the old one's."""
    out = Path(out)
    if plan.gain < min_gain:
        raise NoGainError(
            f"the new split predicts a step of {_ms(plan.new_step)} against the old split's "
            f"{_ms(plan.old_step)} under the measured profile ("
            + (f"{plan.gain:.1%} shorter" if plan.gain >= 0 else f"{-plan.gain:.1%} longer")
            + f"), less than the --min-gain of {min_gain:g} ({min_gain * 100:g}%)"
            + ("" if plan.moved else ": it is the same split")
            + f"; nothing was written to {out}. The package's split already suits this run; "
            "pass --min-gain 0 to write the new split anyway"
        )
    with output_lock(out):
        check_output_dir(out, force)
        generate_step(
            plan.graph, plan.new, out, prof=plan.profile, force=force, gpus_per_node=gpus_per_node
        )
        if report:
            write_report(out)
    return out
