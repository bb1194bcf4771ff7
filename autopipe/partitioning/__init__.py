"""Partitioning: assign units to pipeline stages and stages to devices.

Methods (``--method``): ``dp`` the exact optimum over contiguous splits of the program order;
``metis`` pymetis k-way, repaired into acyclic stages; ``acyclic`` multilevel refinement of
acyclic partitions; ``mpipe`` Mixed-Pipe, which may put several non-adjacent stages on one device.
Every result is a chain of stages (every edge points to the same or a later stage), judged by a
simulated training step under the schedule.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from dataclasses import dataclass

from collections.abc import Callable

from .byte_units import format_bytes, format_bytes_each
from ..checks import is_int
from ..errors import DeviceMemoryError, PartitionError
from ..ir import Graph
from ..profiling.profile import Profile
from .acyclic import solve_acyclic
from .blocks import align_to_blocks
from .cost import CostModel, Prediction, iteration_time
from .dp import solve_contiguous
from .metis import solve_metis
from .network import Network
from .mpipe import solve_mpipe
from .partition import Comparison, Partition, PartitionSettings, stage_costs
from .recompute import plan_recompute
from .refine import looped_devices
from ..runtime.core.pipeline import PIPELINE_INNERMOST, SHARDS_INNERMOST, default_microbatches
from ..runtime.core.schedules import COMPILE_SCHEDULES, MULTI_STAGE, SPLIT_BACKWARD
from ..runtime.core.schedules import placement as torch_placement


def solve_dp(
    model: CostModel, num_stages: int, num_devices: int, placement: list[int] | None = None
) -> tuple[list[int], list[int]]:
    return solve_contiguous(model, num_stages), placement or looped_devices(num_stages, num_devices)


#: --method names -> solvers taking (cost model, stages, devices, placement or None), returning
#: (stage_of_unit, device_of_stage); a given placement (stage -> device) is kept
METHODS: dict[str, Callable[..., tuple[list[int], list[int]]]] = {
    "acyclic": solve_acyclic,
    "dp": solve_dp,
    "metis": solve_metis,
    "mpipe": solve_mpipe,
}
DEFAULT_METHOD = "mpipe"
#: the method a partition records when its stages are the user's (--split-points)
SPLIT_POINTS_METHOD = "split-points"


def default_schedule(device_of_stage: list[int]) -> str:
    """1F1B for one stage per device; the greedy schedule (run by torch's runtime) otherwise."""
    return "1f1b" if device_of_stage == list(range(len(device_of_stage))) else "auto"


@dataclass(frozen=True)
class PartitionRequest:
    """What :func:`partition` is asked for (its arguments but the graph and the profile)."""

    num_stages: int
    num_devices: int | None = None  # default: one stage each
    method: str = DEFAULT_METHOD
    schedule: str | None = None
    microbatches: int | None = None
    optimizer: str = "adamw"
    dp_shard: int = 1
    #: the stage of every unit, where the user fixed it (--split-points); else the method's
    split: tuple[int, ...] | None = None
    gpus_per_node: int = 8  # the cluster's node size
    #: the device mesh's order (which ranks share a node); None: the faster of the two orders
    #: (the pipeline's ranks or each stage's shards next to each other), where they differ
    mesh: tuple[str, ...] | None = None

    @property
    def devices(self) -> int:
        return self.num_stages if self.num_devices is None else self.num_devices


def partition(
    graph: Graph,
    profile: Profile,
    num_stages: int,
    *,
    num_devices: int | None = None,
    method: str = DEFAULT_METHOD,
    schedule: str | None = None,
    microbatches: int | None = None,
    optimizer: str = "adamw",
    dp_shard: int = 1,
    advise: bool = True,
    compare: bool = True,
    split: list[int] | None = None,
    gpus_per_node: int = 8,
    mesh: tuple[str, ...] | None = None,
) -> Partition:
    """Split ``graph`` into ``num_stages`` stages on ``num_devices`` devices (default: one each),
    each stage's training state sharded over ``dp_shard`` data-parallel ranks. Stages may
    recompute activations to be balanced where that predicts a faster step than shrinking the
    stages short of memory; with ``compare``, a partition that recomputes is compared with the
    one that recomputes only where nothing fits without, the faster kept and the other
    recorded (:attr:`Partition.compared`). When no partition
    fits the device's memory, the error says what each rank needs against its capacity and, with
    ``advise``, the smallest changes that fit (:func:`memory_advice`). With ``split`` (the stage
    of every unit, :func:`.split_points.requested_split`), the stages are those: the
    partition's method is ``split-points``, and only what they recompute is chosen. The
    devices are GPUs of nodes of ``gpus_per_node`` (:mod:`.network`), their ranks in the mesh
    order ``mesh`` (default: the order whose network the step is fastest on)."""
    request = PartitionRequest(
        num_stages,
        num_devices,
        method,
        schedule,
        microbatches,
        optimizer,
        dp_shard,
        None if split is None else tuple(split),
        gpus_per_node,
        mesh,
    )
    try:
        part = _partition(graph, profile, request)
    except DeviceMemoryError as exc:
        if not advise or split is not None:
            raise
        advice = memory_advice(graph, profile, request)
        raise DeviceMemoryError(exc.need, advice, peak=exc.peak) from None
    if compare and part.recomputed:
        plain = _partition(graph, profile, request, balance=False)
        assert part.predicted is not None and plain.predicted is not None  # always predicted
        if plain.predicted.step_time < part.predicted.step_time:
            part, plain = plain, part
        assert plain.predicted is not None
        if (plain.stage_of_unit, plain.recompute, plain.recompute_blocks) != (
            part.stage_of_unit,
            part.recompute,
            part.recompute_blocks,
        ):  # two plans to compare
            compared = Comparison(plain.predicted.step_time, plain.recomputed)
            part = dataclasses.replace(part, compared=compared)
    return part


def mesh_orders(request: PartitionRequest) -> tuple[tuple[str, ...], ...]:
    """The mesh orders a partition of ``request`` is costed under: the one it names, else the
    pipeline's ranks next to each other and, where that places ranks on other nodes (sharded
    over more ranks than a node holds with the pipeline), each stage's shards next to each
    other."""
    if request.mesh is not None:
        return (request.mesh,)
    if request.dp_shard > 1 and request.devices > 1:
        if request.devices * request.dp_shard > request.gpus_per_node:
            return (PIPELINE_INNERMOST, SHARDS_INNERMOST)
    return (PIPELINE_INNERMOST,)


def _partition(
    graph: Graph, profile: Profile, request: PartitionRequest, balance: bool = True
) -> Partition:
    """:func:`partition`'s work, under each of :func:`mesh_orders` (the fastest step kept,
    the first of equal ones); ``balance``: stages may recompute to be balanced (else only where
    no split fits without)."""
    best: Partition | None = None
    failure: Exception | None = None
    for mesh in mesh_orders(request):
        try:
            part = _partition_in(graph, profile, dataclasses.replace(request, mesh=mesh), balance)
        except DeviceMemoryError as exc:
            failure = failure or exc
            continue
        if best is None or _iteration(part) < _iteration(best):
            best = part
    if best is None:
        assert failure is not None
        raise failure
    return best


def _iteration(part: Partition) -> float:
    """Seconds per pipeline run of a partition, with what its data parallelism adds once."""
    assert part.predicted is not None  # partition() predicts every partition it makes
    return iteration_time(part.predicted)


def _partition_in(
    graph: Graph, profile: Profile, request: PartitionRequest, balance: bool
) -> Partition:
    """One partition of ``request``, whose mesh order is given."""
    assert request.mesh is not None
    num_stages, num_devices, method = request.num_stages, request.devices, request.method
    schedule, microbatches = request.schedule, request.microbatches
    optimizer, dp_shard = request.optimizer, request.dp_shard
    if not is_int(num_stages, 1):
        raise PartitionError(f"--stages must be at least 1, got {num_stages!r}")
    if not (is_int(num_devices, 1) and num_devices <= num_stages):
        raise PartitionError(
            f"--devices must be between 1 and the number of stages ({num_stages}), got {num_devices!r}"
        )
    if microbatches is not None and not is_int(microbatches, 1):
        raise PartitionError(f"--microbatches must be at least 1, got {microbatches!r}")
    if not is_int(dp_shard, 1):
        raise PartitionError(f"--dp-shard must be at least 1, got {dp_shard!r}")
    if method not in METHODS:
        raise PartitionError(f"unknown method {method!r}; available: {', '.join(sorted(METHODS))}")
    if schedule is not None and schedule not in COMPILE_SCHEDULES:
        raise PartitionError(
            f"unknown schedule {schedule!r}; available: {', '.join(COMPILE_SCHEDULES)}"
        )
    if num_stages > len(graph.units):
        raise PartitionError(
            f"{num_stages} stages need at least {num_stages} units, but the graph has {len(graph.units)}; use "
            "fewer stages, or a larger --depth / fewer --basic-blocks so the model splits into more units"
        )
    placement = None
    if schedule in MULTI_STAGE:  # torch's multi-stage schedules fix the placement
        if num_stages % num_devices or num_stages == num_devices:
            raise PartitionError(
                f"--schedule {schedule} runs several stages per device: --stages must be a multiple "
                f"of --devices (at least twice), got {num_stages} stages on {num_devices} devices"
            )
        placement = torch_placement(schedule, num_stages, num_devices)
    elif schedule in ("gpipe", "1f1b") and num_devices != num_stages:
        raise PartitionError(
            f"--schedule {schedule} runs one stage per device; with {num_stages} stages on "
            f"{num_devices} devices use --schedule auto, interleaved-1f1b or looped-bfs"
        )
    model = CostModel(
        graph,
        profile,
        schedule=schedule or "1f1b",
        microbatches=microbatches,
        optimizer=optimizer,
        dp_shard=dp_shard,
        network=Network(profile.device, request.gpus_per_node, request.mesh),
        pipeline_ranks=num_devices,
    )
    if not balance:
        model = model.without_balancing_recomputation()
    if request.split is not None:
        stage_of_unit, method = list(request.split), SPLIT_POINTS_METHOD
        if max(stage_of_unit) + 1 != num_stages:
            raise PartitionError(
                f"the split points make {max(stage_of_unit) + 1} stages; pass --stages "
                f"{max(stage_of_unit) + 1}, or change the split points"
            )
        device_of_stage = placement or looped_devices(num_stages, num_devices)
        schedule = schedule or default_schedule(device_of_stage)
    else:
        try:
            stage_of_unit, device_of_stage = _solved(profile, model, request, placement)
        except DeviceMemoryError:  # recomputation may make room: search as if every stage did
            recomputing = model.assuming_recomputation()
            stage_of_unit, device_of_stage = _solved(profile, recomputing, request, placement)
        schedule = schedule or default_schedule(device_of_stage)
        stage_of_unit = align_to_blocks(model, stage_of_unit, device_of_stage, schedule)
    model.check_monotone(stage_of_unit)
    if sorted(set(stage_of_unit)) != list(range(num_stages)):
        raise PartitionError(
            f"method {method} did not produce {num_stages} non-empty stages (a bug: please report)"
        )
    plan = plan_recompute(model, stage_of_unit, device_of_stage, schedule)
    prediction = plan.prediction
    costs = model.pipeline_costs(stage_of_unit, device_of_stage, plan.stages, plan.blocks)
    return Partition(
        method=method,
        stage_of_unit=stage_of_unit,
        device_of_stage=device_of_stage,
        graph_digest=profile.graph_digest,
        recompute=sorted(plan.stages),
        recompute_blocks=sorted(plan.blocks),
        recomputed_values=list(model.recomputed_values),
        settings=PartitionSettings(
            schedule=schedule,
            microbatches=microbatches or default_microbatches(num_stages),
            optimizer=optimizer,
            dp_shard=dp_shard,
            device=profile.device.name,
            device_type="cpu" if profile.device.device_type == "cpu" else None,
            link=profile.device.link,
            mesh=request.mesh if request.mesh != PIPELINE_INNERMOST else None,
            gpus_per_node=request.gpus_per_node,
            calibrated=profile.device.calibrated,
            profile=profile.mode,
            measured_on=profile.measured_on or None,
            timed_at=dict(profile.timed_at) if profile.timed_at else None,
            bf16=True if profile.bf16 else None,
        ),
        predicted=prediction.record(),
        costs=stage_costs(costs),
    )


#: the splits the methods made for each live profile (by its id), by what their solvers read
#: of the request and the cost model (see :func:`_solved`)
_SOLVED: dict[int, dict[tuple[object, ...], tuple[list[int], list[int]]]] = {}


def _solved_for(profile: Profile) -> dict[tuple[object, ...], tuple[list[int], list[int]]]:
    """The splits made for ``profile``, forgotten when it is (a profile is not hashable)."""
    known = _SOLVED.get(id(profile))
    if known is None:
        known = _SOLVED[id(profile)] = {}
        weakref.finalize(profile, _SOLVED.pop, id(profile), None)
    return known


def _solved(
    profile: Profile, model: CostModel, request: PartitionRequest, placement: list[int] | None
) -> tuple[list[int], list[int]]:
    """``METHODS[request.method]``'s split of ``model`` (stage_of_unit, device_of_stage), made
    once per profile and what the solver reads: a plan search partitions one profile under
    several schedules, and where torch's multi-stage schedules fix the placement, the solvers
    (the acyclic refinement of the contiguous optimum) see a schedule only through the
    microbatches it keeps in flight, the same for all of them, and whether it gathers FSDP2's
    parameters once per step (split backward, sharded)."""
    if placement is None:
        facet: object = model.schedule
    else:
        facet = (model.schedule == "gpipe", model.dp_shard > 1 and model.schedule in SPLIT_BACKWARD)
    key = (
        request.method,
        request.num_stages,
        request.devices,
        None if placement is None else tuple(placement),
        facet,
        model.microbatches,
        model.optimizer,
        model.dp_shard,
        model.recomputes_all,
        model.recomputes_to_balance,
        model.network.gpus_per_node,
        model.network.mesh,
    )
    known = _solved_for(profile)
    if key not in known:
        known[key] = METHODS[request.method](model, request.num_stages, request.devices, placement)
    stage_of_unit, device_of_stage = known[key]
    return list(stage_of_unit), list(device_of_stage)


#: values :func:`smallest_fitting` tries one by one before it doubles them
LINEAR_TRIES = 4
#: the most ranks per stage :func:`memory_advice` tries
MAX_DP_SHARD = 1024


@dataclass(frozen=True)
class Attempt:
    """A changed request, partitioned: the partition if it fits, and its fullest rank's need
    (NaN where the request itself is refused)."""

    request: PartitionRequest
    partition: Partition | None
    peak: float

    @property
    def fits(self) -> bool:
        return self.partition is not None


def attempt(graph: Graph, profile: Profile, request: PartitionRequest) -> Attempt:
    """``request`` partitioned, or why not in bytes."""
    try:
        part = _partition(graph, profile, request)
    except DeviceMemoryError as exc:
        return Attempt(request, None, exc.peak)
    except PartitionError:  # the changed request is not a valid one
        return Attempt(request, None, math.nan)
    assert part.predicted is not None  # partition() predicts every partition it makes
    return Attempt(request, part, max(part.predicted.device_memory))


def smallest_fitting(
    low: int, high: int, attempt_with: Callable[[int], Attempt]
) -> tuple[int | None, Attempt | None]:
    """The smallest value in ``low .. high`` whose attempt fits, found by trying
    ``LINEAR_TRIES`` values one by one, then doubling, then bisecting between the last that did
    not fit and the first that did (memory falls as the value grows); with its attempt. None if
    none fits, with the attempt of the largest value tried (None if none was)."""
    failed, value, last = low - 1, low, None
    while True:
        if value > high:
            return None, last
        result = attempt_with(value)
        if result.fits:
            break
        last = result
        if value == high:
            return None, last
        failed, value = value, min(high, value + 1 if value - low + 1 < LINEAR_TRIES else 2 * value)
    while value - failed > 1:
        middle = (failed + value) // 2
        trial = attempt_with(middle)
        if trial.fits:
            value, result = middle, trial
        else:
            failed = middle
    return value, result


def memory_advice(graph: Graph, profile: Profile, request: PartitionRequest) -> str:
    """The smallest changes to ``request`` that make every rank fit the device's memory, each
    partitioned to prove it, with its fullest rank's need: more devices (and as many more stages
    as they need), and more data-parallel ranks sharing each stage's state
    (``--dp-shard``). Recomputation needs no advice: :func:`partition` already recomputes
    wherever a rank is short of memory."""
    model = CostModel(
        graph,
        profile,
        schedule=request.schedule or "1f1b",
        microbatches=request.microbatches,
        optimizer=request.optimizer,
        dp_shard=request.dp_shard,
        network=Network(profile.device, request.gpus_per_node, request.mesh or PIPELINE_INNERMOST),
        pipeline_ranks=request.devices,
    )
    capacity = profile.device.memory
    stages, devices = request.num_stages, request.devices
    state = model.training_state_bytes  # unsharded

    def stages_on(count: int) -> int:
        """Stages on ``count`` devices: as many per device as the schedule's placement runs,
        else the stages requested while there are more of them, one each beyond."""
        if request.schedule in MULTI_STAGE:
            return count * (stages // devices)
        return max(stages, count)

    unit_state = [
        model.state_bytes(sum(p.values()), sum(b for n, b in p.items() if n not in model.frozen))
        for p in model.unit_params
    ]
    largest = max(range(model.num_units), key=unit_state.__getitem__)
    most = max((d for d in range(devices, model.num_units + 1) if stages_on(d) <= model.num_units))
    if unit_state[largest] > capacity:
        more_devices = (
            f"no number of devices does: unit {graph.units[largest].label} alone holds "
            f"{format_bytes(unit_state[largest])} of parameters, gradients and optimizer state"
        )
    elif devices == most:
        more_devices = (
            f"more devices cannot: each stage needs one of the graph's {model.num_units} units"
        )
    else:
        fewest = max(devices + 1, math.ceil(state / request.dp_shard / capacity))
        count, result = smallest_fitting(
            fewest,
            most,
            lambda d: attempt(
                graph, profile, dataclasses.replace(request, num_stages=stages_on(d), num_devices=d)
            ),
        )
        if count is not None and result is not None:
            flags = f"--stages {stages_on(count)}" + (
                f" --devices {count}" if count != stages_on(count) else ""
            )
            more_devices = f"{flags} ({count} devices, at most {format_bytes(result.peak)} each)"
        else:
            more_devices = f"no number of devices up to {most} does"
            if fewest > most:
                more_devices += f" (the training state alone needs {fewest})"
            elif result is not None and math.isfinite(result.peak):
                more_devices += (
                    f" (on {result.request.devices} a device still needs "
                    f"{format_bytes(result.peak)})"
                )
    fewest_shards = max(request.dp_shard + 1, math.ceil(state / devices / capacity))
    shards, result = smallest_fitting(
        fewest_shards,
        MAX_DP_SHARD,
        lambda k: attempt(graph, profile, dataclasses.replace(request, dp_shard=k)),
    )
    if shards is not None and result is not None:
        more_shards = (
            f"--dp-shard {shards} ({devices * shards} devices in all, at most "
            f"{format_bytes(result.peak)} each)"
        )
    else:
        more_shards = f"no --dp-shard up to {MAX_DP_SHARD} does"
        if result is not None and math.isfinite(result.peak):
            more_shards += (
                f" (with --dp-shard {result.request.dp_shard} a device still needs "
                f"{format_bytes(result.peak)}: the parameters FSDP2 gathers and the activations "
                "are not sharded)"
            )
    return (
        f"What fits, the smallest change of each kind (partitioned to check): {more_devices}; "
        f"{more_shards}; or a device with more memory (--device-spec)"
    )


__all__ = [
    "partition",
    "Partition",
    "CostModel",
    "Prediction",
    "METHODS",
    "DEFAULT_METHOD",
    "default_schedule",
]
