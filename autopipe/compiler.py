"""The compiler pipeline: trace -> profile -> partition -> generate, and the public API over it."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Callable

from torch import nn

from .artifacts import artifact_text
from .partitioning.byte_units import format_bytes
from .errors import ArtifactError, AutopipeError, PartitionError
from .report.progress import QUIET, Phases
from .codegen import check_output_dir, package_files, with_manifest, write_package
from .codegen.output_lock import output_lock
from .ir import Graph
from .partitioning import Partition, partition
from .partitioning.partition import PARTITION_KIND, RequestedSplit
from .partitioning.split_points import SplitPoints, requested_split
from .partitioning.search import (
    Plan,
    SearchProgress,
    default_workers,
    plan_table,
    search,
    state_floor,
    unsearched_note,
)
from .profiling import DeviceSpec, Profile, profile, with_link
from .partitioning.network import Network, node_layout
from .partitioning.tensor_parallel import TensorParallelCost, sharded_profile
from .tensor_parallel import ShardingPlan, TensorParallelRegions, find_regions, sharding_plan
from .profiling.calibrate import resolve_device_spec
from .profiling.profile import PROFILE_KIND
from .report import write_report
from .spec import Example, load_example, load_function
from .tracing import trace
from .tracing.loss import trace_loss
from .ir.analysis import check_replay
from .ir.batch_dims import batch_dims_of
from .options import CompileOptions

ARTIFACTS = "artifacts"
TOP_PLANS = 10  # plans a searched partition records (the report shows them)


@dataclass
class CompileResult:
    out: Path
    graph: Graph
    profile: Profile
    partition: Partition
    timings: dict[str, float] = field(default_factory=dict)


def load_graph(path: str | Path) -> Graph:
    """A graph artefact, checked field by field (:meth:`Graph.lint`) and by running every
    operator on fake tensors (:func:`check_replay`), loss function included."""
    graph = Graph.load(path)
    try:
        for checked in filter(None, (graph, graph.loss)):
            check_replay(checked)
    except ArtifactError as exc:
        raise ArtifactError(
            f"{path}: the graph artefact is invalid: {exc}; write it again with `autopipe trace`"
        ) from None
    return graph


def trace_step(
    example: Example,
    options: CompileOptions,
    source: str | None = None,
    loss: str | Callable | None = None,
) -> Graph:
    if loss is not None and options.dynamic:
        raise AutopipeError(
            "--dynamic with --loss is not supported yet: the loss function is traced for the "
            "example's fixed shapes. Train with the model's own loss output (Hugging Face "
            "models: pass labels), or compile without --dynamic"
        )
    graph = trace(
        example,
        depth=options.depth,
        basic_blocks=tuple(options.basic_blocks),
        inline_blocks=options.inline_blocks,
        source=source,
        dynamic=options.dynamic,
        keep_whole=tuple(options.keep_whole),
    )
    batch_dims = batch_dims_of(graph, options.batch_dims or {})
    if batch_dims:  # recorded where an input's batch is not along dimension 0
        graph.model = graph.model.updated(batch_dims=batch_dims)
    if loss is not None:
        loss_fn = load_function(loss, "loss spec") if isinstance(loss, str) else loss
        graph.loss = trace_loss(example, loss_fn)
    return graph


def target_device(options: CompileOptions) -> DeviceSpec:
    """The device spec the options name, with their link (``cpu`` / ``cuda``: this machine's,
    calibrated on first use)."""
    return with_link(
        resolve_device_spec(options.device_spec, log=_say), options.link, options.network
    )


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def profile_step(graph: Graph, options: CompileOptions, example: Example | None = None) -> Profile:
    return profile(
        graph, options.profile, target_device(options), example, options.expected, options.bf16
    )


def plan_step(
    graph: Graph,
    prof: Profile,
    options: CompileOptions,
    progress: Callable[[SearchProgress], None] | None = None,
) -> list[Plan]:
    """Every plan for ``options.devices`` devices, best first (see :mod:`.partitioning.search`),
    within ``--search-seconds``; ``progress`` is told after each candidate."""
    devices = options.devices
    assert devices is not None, "a plan is for --devices devices (CompileOptions checks it)"
    sequence = options.sequence_parallel_asked
    if options.tp is not None:
        check_tensor_parallel(graph, options.tp, sequence)
    return search(
        graph,
        rank_profile(prof, options),
        devices,
        global_batch=options.global_batch or 2 * devices,
        method=options.method,
        optimizer=options.optimizer,
        margin=options.memory_margin,
        max_stages_per_rank=options.max_stages_per_device,
        seconds=options.search_seconds,
        progress=progress,
        workers=options.search_workers or default_workers(),
        gpus_per_node=options.gpus_per_node,
        tp_degrees=tensor_parallel_degrees(graph, options),
        sequence_parallel=sequence,
    )


def partition_step(
    graph: Graph, prof: Profile, options: CompileOptions, phases: Phases | None = None
) -> Partition:
    """The partition the options ask for; with ``search``, the best plan's, which records the
    plans it was chosen from (``phases`` shows the search's progress and says when
    ``--search-seconds`` stopped it); with ``--tp``, the degree it is sharded at."""
    if not options.search or options.tp is not None:
        check_tensor_parallel(graph, options.tp or 1, options.sequence_parallel_asked)
    return _partition(graph, prof, options, phases)


def recorded_plans(plans: list[Plan]) -> list[Plan]:
    """The plans a searched partition records: the best :data:`TOP_PLANS`, then the best of
    each tensor-parallel degree not among them (the summary says why the degree was chosen)."""
    recorded = plans[:TOP_PLANS]
    for degree in sorted({plan.candidate.tp for plan in plans}):
        best = next(p for p in plans if p.candidate.tp == degree)  # fitting ones first
        if all(p is not best for p in recorded):
            recorded.append(best)
    return recorded


def check_tensor_parallel(
    graph: Graph, degree: int, sequence_parallel: bool | None = None
) -> ShardingPlan:
    """What ``graph`` shards at ``--tp degree``; refused where it shards nothing, naming the
    degrees its regions allow and why they stay replicated, or where ``--sequence-parallel
    on`` (``sequence_parallel`` True) cannot be."""
    regions = find_regions(graph)
    plan = sharding_plan(graph, regions, degree, sequence_parallel)
    if degree > 1 and not plan.modules:
        sharding = [d for d in regions.degrees() if sharding_plan(graph, regions, d).modules]
        allowed = ", ".join(map(str, sharding)) or "none"
        why = "; ".join(f"{scope}: {reason}" for scope, reason in plan.replicated[:3])
        raise PartitionError(
            f"--tp {degree} shards no region of {graph.model.cls.rsplit('.', 1)[-1]} (the "
            f"degrees that shard one: {allowed}; {why or 'no attention or MLP region found'}); "
            "use one of those degrees, or --tp 1"
        )
    return plan


def tensor_parallel_degrees(graph: Graph, options: CompileOptions) -> tuple[int, ...]:
    """The tensor-parallel degrees a plan search tries: ``--tp``'s, else 1 and each of 2, 4
    and 8 up to ``--gpus-per-node`` that shards a region of ``graph`` (and with
    ``--sequence-parallel on``, runs sequence parallel)."""
    if options.tp is not None:
        return (options.tp,)
    regions = find_regions(graph)
    found = [t for t in (2, 4, 8) if t <= options.gpus_per_node and t in regions.degrees()]
    sequence = options.sequence_parallel_asked
    return (1, *(t for t in found if _shards(graph, regions, t, sequence)))


def _shards(
    graph: Graph, regions: TensorParallelRegions, degree: int, sequence: bool | None
) -> bool:
    """Whether ``degree`` shards a region of ``graph`` (sequence parallel, if asked on)."""
    try:
        return bool(sharding_plan(graph, regions, degree, sequence).modules)
    except PartitionError:  # --sequence-parallel on, which this degree cannot be
        return False


def tensor_parallel_profile(
    graph: Graph,
    prof: Profile,
    degree: int,
    gpus_per_node: int,
    sequence_parallel: bool | None = None,
) -> tuple[Profile, TensorParallelCost, ShardingPlan]:
    """``prof`` as each of ``degree`` tensor-parallel ranks runs it (itself at degree 1), what
    that costs and the plan it runs."""
    plan = sharding_plan(graph, find_regions(graph), degree, sequence_parallel)
    changed, cost = sharded_profile(graph, prof, plan, Network(prof.device, gpus_per_node))
    return changed, cost, plan


def _partition(
    graph: Graph, prof: Profile, options: CompileOptions, phases: Phases | None = None
) -> Partition:
    """:func:`partition_step`'s partition."""
    if options.search:
        phases = phases or Phases(QUIET)
        plans = plan_step(graph, prof, options, progress=lambda done: phases.progress(str(done)))
        stopped = unsearched_note(plans)
        if stopped:
            phases.note(stopped)
        best = plans[0]
        if not best.fits:
            margin = options.memory_margin
            shared = rank_profile(prof, options)
            floor = state_floor(graph, shared, optimizer=options.optimizer, margin=margin)
            each = "per device" if shared is prof else "per process (its share of a node's)"
            raise PartitionError(
                f"no plan for {options.devices} devices fits {prof.device.name}'s "
                f"{format_bytes(shared.device.memory)} {each} "
                f"({format_bytes(shared.device.memory * (1 - margin))} less the {margin:.0%} "
                f"margin):\n{plan_table([p.to_json() for p in plans[:TOP_PLANS]])}\n"
                f"{floor[:1].upper()}{floor[1:]}. Use "
                "more devices, a smaller --global-batch, a smaller --memory-margin or a device "
                "with more memory (--device-spec)"
            )
        assert best.partition is not None  # a plan that fits has its partition
        tp = best.candidate.tp
        sequence = options.sequence_parallel_asked
        sliced = tp > 1 and sharding_plan(graph, find_regions(graph), tp, sequence).sequence
        return best.partition.with_settings(
            sequence_parallel=True if sliced else None,
            gpus_per_node=options.gpus_per_node,
            accumulate=best.candidate.accumulate,
            global_batch=best.global_batch,
            memory_margin=options.memory_margin,
            plans=tuple(plan.to_json() for plan in recorded_plans(plans)),
        )
    prof = rank_profile(prof, options)
    asked = SplitPoints.parse(options.split_points) if options.split_points else None
    tp = options.tp or 1
    places = max(1, options.gpus_per_node // tp)  # a node's places of tp ranks each
    sequence = options.sequence_parallel_asked
    prof, _, sharded = tensor_parallel_profile(graph, prof, tp, options.gpus_per_node, sequence)
    part = partition(
        graph,
        prof,
        options.stages,
        num_devices=options.devices,
        method=options.method,
        schedule=options.schedule,
        microbatches=options.microbatches,
        optimizer=options.optimizer,
        dp_shard=options.dp_shard,
        split=None if asked is None else requested_split(graph, asked),
        gpus_per_node=places,
    )
    if asked is None and graph.model.split_markers:
        microbatches = part.settings.microbatches
        requested = markers_split(graph, prof, options, microbatches)
        part = dataclasses.replace(part, requested=requested)
    if tp > 1:  # the node size of the cluster, not of its places
        part = part.with_settings(
            tp=tp,
            gpus_per_node=options.gpus_per_node,
            sequence_parallel=True if sharded.sequence is not None else None,
        )
    return part.with_settings(accumulate=options.accumulate) if options.accumulate > 1 else part


def rank_profile(prof: Profile, options: CompileOptions) -> Profile:
    """``prof`` on the device as each rank has it (:meth:`DeviceSpec.shared_by`: a CPU's ranks
    share a node's memory) when nodes of ``--gpus-per-node`` run the plan's processes as its
    launch script places them (:func:`.partitioning.network.node_layout`): every device a
    search plans for, else the pipeline's ranks x ``--dp-shard`` x ``--tp``."""
    tp = 1 if options.search else options.tp or 1
    processes = options.devices or options.stages
    if not options.search:
        processes *= options.dp_shard * tp
    device = prof.device.shared_by(node_layout(processes, options.gpus_per_node, tp)[1])
    return prof if device is prof.device else dataclasses.replace(prof, device=device)


def markers_split(
    graph: Graph, prof: Profile, options: CompileOptions, microbatches: int | None
) -> RequestedSplit:
    """The stages the model's ``pipe_split()`` markers ask for, partitioned (what they
    recompute) and predicted under ``options``' other settings with ``microbatches`` (the
    partition's, so that both steps train on the same batch): one stage per device."""
    asked = SplitPoints(markers=True)
    stages = len(graph.model.split_markers) + 1
    try:
        theirs = partition(
            graph,
            prof,
            stages,
            method=options.method,
            schedule=options.schedule if options.schedule in ("1f1b", "gpipe") else None,
            microbatches=microbatches,
            optimizer=options.optimizer,
            dp_shard=options.dp_shard,
            split=requested_split(graph, asked),
            compare=False,
            gpus_per_node=options.gpus_per_node,
        )
    except PartitionError as exc:  # DeviceMemoryError included
        return RequestedSplit(str(asked), stages, None, None, str(exc).split(". ")[0])
    assert theirs.predicted is not None  # partition() predicts every partition it makes
    return RequestedSplit(
        str(asked), stages, theirs.predicted.bottleneck, theirs.predicted.step_time
    )


def generate_step(
    graph: Graph,
    part: Partition,
    out: str | Path,
    *,
    prof: Profile | None = None,
    force: bool = False,
    gpus_per_node: int = 8,
) -> Path:
    """Write the pipeline package (with the artefacts that produced it under ``artifacts/``);
    its SLURM script asks for nodes of ``gpus_per_node`` GPUs."""
    part.validate()
    part.check_graph(graph)
    if prof is not None:
        prof.check_graph(graph)
    files = package_files(graph, part, gpus_per_node=gpus_per_node)
    files[f"{ARTIFACTS}/graph.json"] = graph.json_text()
    files[f"{ARTIFACTS}/partition.json"] = artifact_text(PARTITION_KIND, part.to_json())
    files[f"{ARTIFACTS}/tp_regions.json"] = find_regions(graph).text()
    if prof is not None:
        files[f"{ARTIFACTS}/profile.json"] = artifact_text(PROFILE_KIND, prof.to_json())
    return write_package(out, with_manifest(files), force=force)


def compile_example(
    example: Example,
    out: str | Path,
    options: CompileOptions,
    *,
    source: str | None = None,
    loss: str | Callable | None = None,
    force: bool = False,
    report: bool = True,
    phases: Phases | None = None,
) -> CompileResult:
    """Trace, profile, partition and generate in one go; with ``report``, also write
    ``out/report/report.html`` and its figures. ``phases`` shows progress (default: silent)."""
    out = Path(out)
    phases = phases or Phases(QUIET)
    with output_lock(out, note=phases.note):  # another compile into ``out`` is refused
        return _compile_locked(example, out, options, source, loss, force, report, phases)


def _compile_locked(
    example: Example,
    out: Path,
    options: CompileOptions,
    source: str | None,
    loss: str | Callable | None,
    force: bool,
    report: bool,
    phases: Phases,
) -> CompileResult:
    """The steps of :func:`compile_example`, ``out``'s lock held."""
    check_output_dir(out, force)  # fail before the expensive steps
    target_device(options)
    with phases.phase("trace") as details:
        graph = trace_step(example, options, source, loss)
        details.append(f"{len(graph.calls)} operators in {len(graph.units)} units")
    if graph.unused_inputs:
        phases.note(
            f"the model does not read its input(s) {', '.join(graph.unused_inputs)}: train.py "
            "accepts them in --data batches and drops them"
        )
    with phases.phase("profile") as details:
        prof = profile_step(graph, options, example)
        details.append(prof.source)
    with phases.phase("partition") as details:
        part = partition_step(graph, prof, options, phases)
        predicted = part.predicted
        assert predicted is not None  # partition() always predicts
        details.append(
            f"method {part.method}, bottleneck {predicted.bottleneck * 1e3:.3f} ms "
            f"(lower bound {predicted.lower_bound * 1e3:.3f} ms)"
        )
    with phases.phase("generate") as details:
        generate_step(graph, part, out, prof=prof, force=force, gpus_per_node=options.gpus_per_node)
        details.append(f"{part.num_stages} stage modules in {out}")
    if report:
        with phases.phase("report") as details:
            details.append(str(write_report(out)))
    timings = dict(phases.timings)
    return CompileResult(out, graph, prof, part, timings)


def compile_spec(
    spec: str, out: str | Path, options: CompileOptions, **kwargs: Any
) -> CompileResult:
    """:func:`compile_example` for a model spec ``FILE.py:FUNCTION`` / ``package.module:FUNCTION``."""
    check_output_dir(Path(out), kwargs.get("force", False))
    return compile_example(load_example(spec), out, options, source=spec, **kwargs)


def pipe_model(
    model: nn.Module,
    args: tuple = (),
    kwargs: dict[str, Any] | None = None,
    *,
    stages: int,
    out: str | Path,
    target: Any = None,
    loss: str | Callable | None = None,
    force: bool = False,
    **options: Any,
) -> Path:
    """Compile ``model`` into a ``stages``-stage pipeline package written to ``out``.

    ``args`` / ``kwargs`` are one example microbatch. ``loss`` is an optional ``FN(output, target)``
    (with an example ``target``); without it the model's own ``loss`` output is trained. Other
    options are the fields of :class:`CompileOptions` (``profile``, ``method``, ``depth``, ...).
    Returns the package directory.
    """
    example = Example(model, tuple(args), dict(kwargs or {}), target)
    result = compile_example(
        example, out, CompileOptions(stages=stages, **options), loss=loss, force=force
    )
    return result.out


__all__ = [
    "pipe_model",
    "compile_example",
    "compile_spec",
    "load_graph",
    "CompileOptions",
    "CompileResult",
]
