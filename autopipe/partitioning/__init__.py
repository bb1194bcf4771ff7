"""Partitioning: assign units to pipeline stages and stages to devices.

Methods (``--method``): ``dp`` the exact optimum over contiguous splits of the program order;
``metis`` pymetis k-way, repaired into acyclic stages; ``acyclic`` multilevel refinement of
acyclic partitions; ``mpipe`` Mixed-Pipe, which may put several non-adjacent stages on one device.
Every result is a chain of stages (every edge points to the same or a later stage), judged by a
simulated training step under the schedule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from collections.abc import Callable

from ..checks import is_int
from ..errors import DeviceMemoryError, PartitionError
from ..ir import Graph
from ..profiling.profile import Profile
from .acyclic import solve_acyclic
from .blocks import align_to_blocks
from .cost import STATE_FACTOR, CostModel, Prediction
from .dp import solve_contiguous
from .metis import solve_metis
from .mpipe import solve_mpipe
from .partition import Partition, PartitionSettings, stage_costs
from .refine import looped_devices
from ..runtime.core.pipeline import default_microbatches
from ..runtime.core.schedules import COMPILE_SCHEDULES, MULTI_STAGE
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


def default_schedule(device_of_stage: list[int]) -> str:
    """1F1B for one stage per device; the greedy schedule (run by torch's runtime) otherwise."""
    return "1f1b" if device_of_stage == list(range(len(device_of_stage))) else "auto"


@dataclass(frozen=True)
class RecomputePlan:
    """What recomputes its activations in backward: whole stages, and blocks of other stages."""

    stages: frozenset[int]
    blocks: frozenset[str]
    prediction: Prediction


def plan_recompute(
    model: CostModel, stage_of_unit: list[int], device_of_stage: list[int], schedule: str
) -> RecomputePlan:
    """The cheapest recomputation that makes every device fit its memory: on each device short
    of it, blocks one by one, those saving the most bytes per second of forward first, until it
    fits; where all its blocks are not enough, its whole stages. Raises when even that does not
    make them fit."""
    capacity = model.device.memory

    def evaluate(stages: frozenset[int], blocks: frozenset[str]) -> Prediction:
        return model.evaluate(stage_of_unit, device_of_stage, schedule, stages, blocks)

    prediction = evaluate(frozenset(), frozenset())
    short = {d for d, m in enumerate(prediction.device_memory) if m > capacity}
    stages: frozenset[int] = frozenset()
    blocks: frozenset[str] = frozenset()
    for device in sorted(short):
        chosen: frozenset[str] = frozenset()
        for block in _blocks_by_value(model, stage_of_unit, device_of_stage, device):
            chosen |= {block}
            prediction = evaluate(stages, blocks | chosen)
            if prediction.device_memory[device] <= capacity:
                break
        if prediction.device_memory[device] <= capacity:
            blocks |= chosen
        else:  # its blocks are not enough: its stages, whole
            stages |= {s for s, d in enumerate(device_of_stage) if d == device}
    prediction = evaluate(stages, blocks)
    needed = prediction.device_memory
    worst = max(range(len(needed)), key=needed.__getitem__)
    if needed[worst] > capacity:
        raise PartitionError(
            f"device {worst} needs {needed[worst] / 2**30:.2f} GiB even with its activations "
            f"recomputed, but {model.device.name} has {capacity / 2**30:.2f} GiB. "
            + state_advice(model)
        )
    return RecomputePlan(stages, blocks, prediction)


def state_advice(model: CostModel) -> str:
    """How much the model's training state takes, and what makes it fit."""
    state = sum(model.param_bytes) * STATE_FACTOR[model.optimizer]
    capacity = model.device.memory
    shards = model.dp_shard
    sharded = (
        f", {state / shards / 2**30:.2f} GiB per rank sharded over --dp-shard {shards}"
        if shards > 1
        else ""
    )
    return (
        f"The model's parameters, gradients and optimizer state alone take "
        f"{state / 2**30:.2f} GiB{sharded}: use at least "
        f"{math.ceil(state / shards / capacity)} devices (more stages and --devices), shard "
        f"each stage over more ranks (--dp-shard {max(2, 2 * shards)}: about "
        f"{state / max(2, 2 * shards) / 2**30:.2f} GiB per rank), fewer microbatches, or a "
        "device with more memory (--device-spec)"
    )


def _blocks_by_value(
    model: CostModel, stage_of_unit: list[int], device_of_stage: list[int], device: int
) -> list[str]:
    """The whole blocks of a device's stages that recomputing saves memory on, the most bytes
    saved per second of forward recomputed first."""
    ranked = []
    for fqn, block in model.blocks.items():
        stage = block.stage(stage_of_unit)
        if stage is None or device_of_stage[stage] != device:
            continue
        saved = sum(model.activations[u] for u in block.units) - block.inputs
        seconds = sum(model.forward[u] for u in block.units)
        if saved > 0:
            ranked.append((-saved / max(seconds, 1e-12), fqn))
    return [fqn for _, fqn in sorted(ranked)]


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
) -> Partition:
    """Split ``graph`` into ``num_stages`` stages on ``num_devices`` devices (default: one each),
    each stage's training state sharded over ``dp_shard`` data-parallel ranks."""
    num_devices = num_stages if num_devices is None else num_devices
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
    )
    solve = METHODS[method]
    try:
        stage_of_unit, device_of_stage = solve(model, num_stages, num_devices, placement)
    except DeviceMemoryError:  # recomputation may make room: search as if every stage did
        recomputing = model.assuming_recomputation()
        stage_of_unit, device_of_stage = solve(recomputing, num_stages, num_devices, placement)
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
        settings=PartitionSettings(
            schedule=schedule,
            microbatches=microbatches or default_microbatches(num_stages),
            optimizer=optimizer,
            dp_shard=dp_shard,
            device=profile.device.name,
            link=profile.device.link,
            profile=profile.mode,
            measured_on=profile.measured_on or None,
            timed_at=dict(profile.timed_at) if profile.timed_at else None,
        ),
        predicted=prediction.record(),
        costs=stage_costs(costs),
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
