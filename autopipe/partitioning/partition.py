"""The partition artefact: which stage each unit runs in, which device each stage runs on.

Beside the assignment, a partition records the settings it was made for
(:class:`PartitionSettings`), what the cost model predicts for it (:class:`PredictedStep`) and the
per-stage costs the ``auto`` schedule orders actions by (the runtime's
:class:`~autopipe.runtime.core.pipeline.StageCosts`). ``Partition.from_json`` checks a payload
(raising :class:`ArtifactError` naming the first bad field) and builds these frozen objects;
``to_json`` writes the payload back, key for key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..artifacts import read_artifact, write_artifact
from ..checks import is_int, is_number, is_text, require
from ..errors import ArtifactError, PartitionError
from ..ir import Graph
from ..ir.ordering import order_edges
from ..profiling.profile import graph_digest, profile_source
from .network import node_layout
from ..runtime.core.pipeline import (
    DETAIL_TABLES,
    MESH_DIMENSIONS,
    PIPELINE_INNERMOST,
    StageCosts,
)
from ..runtime.core.schedules import (
    MULTI_STAGE,
    SCHEDULES,
    SINGLE_STAGE,
    MemoryPeak,
    PipelineCosts,
)
from ..runtime.core.schedules import placement as torch_placement

__all__ = [
    "PARTITION_KIND",
    "Partition",
    "PartitionSettings",
    "PredictedStage",
    "PredictedStep",
    "TRAFFIC_KINDS",
    "Traffic",
    "costs_from_json",
    "costs_to_json",
    "stage_costs",
]

PARTITION_KIND = "partition"
#: per-stage cost lists (runtime.core.schedules.PipelineCosts fields): stage counts less the offset
_STAGE_COSTS = {
    "forward": 0,
    "backward": 0,
    "activations": 0,
    "static_memory": 0,
    "send_forward": 1,
    "send_backward": 1,
}
#: predicted figures of the memory and throughput model, optional
_PREDICTED_OPTIONAL = ("optimizer_time", "data_parallel_time", "flops", "peak_flops")
_MEMORY_PEAK = set(MemoryPeak.__dataclass_fields__)


def _unknown(data: dict[str, Any], known: Any, where: str) -> None:
    """Raise an :class:`ArtifactError` for the first key of ``data`` not among ``known``."""
    for key in data:
        if key not in known:
            raise ArtifactError(f"{where}.{key} is not a field of the partition artefact")


@dataclass(frozen=True)
class PartitionSettings:
    """What the partition was made for: train.py's defaults (schedule, microbatches, optimizer,
    sharding), the device it was costed on, and with the plan search, the plans it was chosen
    from. Fields are None where the artefact omits them (partitions from before them)."""

    schedule: str | None = None
    microbatches: int | None = None
    optimizer: str | None = None
    dp_shard: int | None = None  # data-parallel ranks per stage
    device: str | None = None
    #: "cpu" for a plan costed on a CPU spec (its ranks are processes, not GPUs); None: a GPU
    device_type: str | None = None
    link: str | None = None
    profile: str | None = None  # the profile's mode
    measured_on: str | None = None
    timed_at: dict[str, int] | None = None  # dynamic dimensions: the sizes the profile timed
    accumulate: int | None = None  # pipeline runs per optimizer step
    global_batch: int | None = None
    memory_margin: float | None = None
    plans: tuple[dict[str, Any], ...] | None = None  # search.Plan.to_json(), best first
    #: the device mesh's dimensions, outermost first (which ranks share a node): train.py
    #: builds its mesh in this order; None: the pipeline innermost (PIPELINE_INNERMOST)
    mesh: tuple[str, ...] | None = None
    gpus_per_node: int | None = None  # the node size the network was costed for
    #: whether the device spec held measured rates (None: a partition from before calibration)
    calibrated: bool | None = None
    #: the tensor-parallel degree (``--tp``): ranks each stage's regions are sharded over
    tp: int | None = None
    #: with ``tp``: whether the values between regions are sliced along the sequence
    sequence_parallel: bool | None = None
    #: planned for bf16 autocast (train.py ``--bf16``, the package's default); None: the
    #: model's dtype
    bf16: bool | None = None

    @classmethod
    def from_json(cls, data: Any, where: str) -> PartitionSettings:
        require(isinstance(data, dict), where, data, "an object")
        microbatches = data.get("microbatches")
        require(
            microbatches is None or is_int(microbatches, 1),
            f"{where}.microbatches",
            microbatches,
            "a number of microbatches (1 or more)",
        )
        dp_shard = data.get("dp_shard", 1)
        require(is_int(dp_shard, 1), f"{where}.dp_shard", dp_shard, "a number of ranks (1 or more)")
        for key in ("accumulate", "global_batch"):
            value = data.get(key, 1)
            require(is_int(value, 1), f"{where}.{key}", value, "a count (1 or more)")
        margin = data.get("memory_margin", 0.0)
        require(is_number(margin, 0) and margin < 1, f"{where}.memory_margin", margin, "in [0, 1)")
        plans = data.get("plans", [])
        require(
            isinstance(plans, list) and all(isinstance(p, dict) for p in plans),
            f"{where}.plans",
            plans,
            "a list of plans (objects)",
        )
        for key in ("optimizer", "device", "link", "profile", "measured_on"):
            value = data.get(key, "")
            require(is_text(value), f"{where}.{key}", value, "a one-line text")
        timed_at = data.get("timed_at", {})
        require(
            isinstance(timed_at, dict) and all(is_int(v, 2) for v in timed_at.values()),
            f"{where}.timed_at",
            timed_at,
            "sizes of dynamic dimensions by name",
        )
        schedule = data.get("schedule")
        require(
            schedule is None or schedule in SCHEDULES,
            f"{where}.schedule",
            schedule,
            f"one of {SCHEDULES}",
        )
        mesh = data.get("mesh", list(PIPELINE_INNERMOST))
        require(
            isinstance(mesh, list)
            and all(isinstance(name, str) for name in mesh)
            and sorted(mesh) == sorted(MESH_DIMENSIONS),
            f"{where}.mesh",
            mesh,
            f"an order of the mesh dimensions {', '.join(MESH_DIMENSIONS)}",
        )
        gpus_per_node = data.get("gpus_per_node", 1)
        require(is_int(gpus_per_node, 1), f"{where}.gpus_per_node", gpus_per_node, "1 or more")
        calibrated = data.get("calibrated", False)
        require(isinstance(calibrated, bool), f"{where}.calibrated", calibrated, "true or false")
        tp = data.get("tp", 1)
        require(is_int(tp, 1), f"{where}.tp", tp, "a tensor-parallel degree (1 or more)")
        sequence = data.get("sequence_parallel", False)
        require(isinstance(sequence, bool), f"{where}.sequence_parallel", sequence, "true or false")
        bf16 = data.get("bf16", False)
        require(isinstance(bf16, bool), f"{where}.bf16", bf16, "true or false")
        device_type = data.get("device_type", "cpu")
        require(device_type == "cpu", f"{where}.device_type", device_type, '"cpu" (or absent)')
        _unknown(data, cls.__dataclass_fields__, where)
        special = ("timed_at", "plans", "mesh")
        return cls(
            **{k: data.get(k) for k in cls.__dataclass_fields__ if k not in special},
            timed_at=None if "timed_at" not in data else dict(timed_at),
            plans=None if "plans" not in data else tuple(dict(p) for p in plans),
            mesh=None if "mesh" not in data else tuple(mesh),
        )

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {}
        for key in self.__dataclass_fields__:
            value = getattr(self, key)
            if key == "timed_at" and value is not None:
                value = dict(value)
            elif key == "plans" and value is not None:
                value = [dict(plan) for plan in value]
            elif key == "mesh" and value is not None:
                value = list(value)
            if value is not None:
                data[key] = value
        return data


@dataclass(frozen=True)
class PredictedStage:
    """One stage's predicted costs for one microbatch (seconds and bytes)."""

    forward: float
    backward: float
    comm_forward: float  # seconds receiving and sending activations off-device
    comm_backward: float  # seconds receiving and sending gradients off-device
    memory: float  # its static memory plus its activations in flight
    parameters: float  # parameter bytes
    communication: float  # comm_forward + comm_backward
    time: float  # one microbatch through the stage, transfers overlapping compute

    @classmethod
    def from_json(cls, data: Any, where: str) -> PredictedStage:
        require(isinstance(data, dict), where, data, "an object")
        for key in cls.__dataclass_fields__:
            value = data.get(key)
            require(is_number(value, 0), f"{where}.{key}", value, ">= 0")
        _unknown(data, cls.__dataclass_fields__, where)
        return cls(**data)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


#: the kinds of traffic a prediction accounts: activations and their gradients between stages,
#: FSDP2's gathers of parameters and reductions of gradients, tied parameters' gradient sums
TRAFFIC_KINDS = ("pipeline", "fsdp2", "tied")


@dataclass(frozen=True)
class Traffic:
    """One kind of traffic of a pipeline run on the rank that moves the most of it, over one
    kind of link: the bytes it sends (and receives), and the seconds the link takes for them
    (before compute hides them)."""

    kind: str  # one of TRAFFIC_KINDS
    link: str  # the link's name (the slowest it crosses)
    crosses_nodes: bool
    bytes: float
    seconds: float

    @classmethod
    def from_json(cls, data: Any, where: str) -> Traffic:
        require(isinstance(data, dict), where, data, "an object")
        _unknown(data, cls.__dataclass_fields__, where)
        kind = data.get("kind")
        require(kind in TRAFFIC_KINDS, f"{where}.kind", kind, f"one of {TRAFFIC_KINDS}")
        require(is_text(data.get("link")), f"{where}.link", data.get("link"), "a link's name")
        crosses = data.get("crosses_nodes")
        require(isinstance(crosses, bool), f"{where}.crosses_nodes", crosses, "true or false")
        for key in ("bytes", "seconds"):
            require(is_number(data.get(key), 0), f"{where}.{key}", data.get(key), ">= 0")
        return cls(kind, data["link"], crosses, data["bytes"], data["seconds"])

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class PredictedStep:
    """What the cost model predicts for the partition: one pipeline run (seconds), the memory of
    each device at its peak (bytes), and each stage's costs. The optional figures are None in
    partitions made before them."""

    bottleneck: float  # the busiest device's compute + communication for one microbatch
    lower_bound: float  # max(total compute / devices, heaviest unit)
    step_time: float  # simulated pipeline run under the schedule
    schedule: str | None  # the schedule simulated
    bubble: float  # idle fraction of device time in the simulated step
    device_memory: tuple[float, ...]  # peak bytes per device
    memory_peaks: tuple[MemoryPeak, ...] | None  # what each device's peak holds
    optimizer_time: float | None  # the slowest device's gradients and optimizer step
    data_parallel_time: float | None  # once a step, no compute hiding it: collectives, tied sums
    flops: float | None  # forward + backward FLOPs per microbatch (no recomputation)
    peak_flops: float | None  # one device's peak FLOP/s for the model's parameter dtype
    stages: tuple[PredictedStage, ...]
    #: the run's traffic by kind and link (empty: none, or a partition from before it)
    traffic: tuple[Traffic, ...] = ()

    @classmethod
    def from_json(
        cls, data: Any, num_stages: int, num_devices: int, where: str
    ) -> PredictedStep | None:
        """The prediction ``data`` describes, or None for an empty object (no prediction)."""
        require(isinstance(data, dict), where, data, "an object")
        if not data:
            return None
        for key in ("bottleneck", "lower_bound", "step_time", "bubble"):
            require(is_number(data.get(key), 0), f"{where}.{key}", data.get(key), ">= 0")
        for key in _PREDICTED_OPTIONAL:  # absent from partitions made before them
            if key in data:
                value = data[key]
                require(is_number(value, 0), f"{where}.{key}", value, ">= 0")
        device_memory = _numbers(data.get("device_memory"), f"{where}.device_memory", num_devices)
        peaks = data.get("memory_peaks", [])
        require(
            isinstance(peaks, list) and len(peaks) in (0, num_devices),
            f"{where}.memory_peaks",
            peaks,
            f"a list of {num_devices} device peaks",
        )
        for device, peak in enumerate(peaks):
            at = f"{where}.memory_peaks[{device}]"
            require(isinstance(peak, dict) and set(peak) == _MEMORY_PEAK, at, peak, "a memory peak")
            for key in _MEMORY_PEAK - {"moment"}:
                require(is_number(peak[key], 0), f"{at}.{key}", peak[key], ">= 0")
            require(is_text(peak["moment"]), f"{at}.moment", peak["moment"], "an action")
        rows = data.get("stages")
        require(
            isinstance(rows, list) and len(rows) == num_stages,
            f"{where}.stages",
            rows,
            f"a list of {num_stages} stage costs",
        )
        stages = tuple(
            PredictedStage.from_json(row, f"{where}.stages[{s}]") for s, row in enumerate(rows)
        )
        schedule = data.get("schedule")
        require(schedule is None or is_text(schedule), f"{where}.schedule", schedule, "a schedule")
        traffic = data.get("traffic", [])
        require(isinstance(traffic, list), f"{where}.traffic", traffic, "a list of traffic")
        _unknown(data, cls.__dataclass_fields__, where)
        return cls(
            bottleneck=data["bottleneck"],
            lower_bound=data["lower_bound"],
            step_time=data["step_time"],
            schedule=schedule,
            bubble=data["bubble"],
            device_memory=device_memory,
            memory_peaks=(
                None if "memory_peaks" not in data else tuple(MemoryPeak(**p) for p in peaks)
            ),
            optimizer_time=data.get("optimizer_time"),
            data_parallel_time=data.get("data_parallel_time"),
            flops=data.get("flops"),
            peak_flops=data.get("peak_flops"),
            stages=stages,
            traffic=tuple(
                Traffic.from_json(t, f"{where}.traffic[{i}]") for i, t in enumerate(traffic)
            ),
        )

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "bottleneck": self.bottleneck,
            "lower_bound": self.lower_bound,
            "step_time": self.step_time,
        }
        if self.schedule is not None:
            data["schedule"] = self.schedule
        data |= {"bubble": self.bubble, "device_memory": list(self.device_memory)}
        if self.memory_peaks is not None:
            data["memory_peaks"] = [dataclasses.asdict(peak) for peak in self.memory_peaks]
        for key in _PREDICTED_OPTIONAL:
            if getattr(self, key) is not None:
                data[key] = getattr(self, key)
        data["stages"] = [stage.to_json() for stage in self.stages]
        if self.traffic:
            data["traffic"] = [t.to_json() for t in self.traffic]
        return data

    @property
    def once_per_step(self) -> float:
        """Seconds an optimizer step spends once, after its pipeline runs: the collectives no
        compute hides and the optimizer step (0 where the partition predates them)."""
        return (0.0 if self.data_parallel_time is None else self.data_parallel_time) + (
            0.0 if self.optimizer_time is None else self.optimizer_time
        )


def costs_from_json(data: Any, num_stages: int, where: str) -> StageCosts | None:
    """The per-stage costs a partition records (None for an empty object: partitions from
    before them), checked as the partition artefact requires: every table, and the capacity."""
    require(isinstance(data, dict), where, data, "an object")
    if not data:
        return None
    required = {*_STAGE_COSTS, "memory_capacity"}
    require(
        required <= set(data) <= required | set(DETAIL_TABLES),
        where,
        sorted(data),
        f"the per-stage costs {sorted(required)} (and optionally {list(DETAIL_TABLES)})",
    )
    tables = {
        key: _numbers(data[key], f"{where}.{key}", num_stages - offset)
        for key, offset in _STAGE_COSTS.items()
    }
    detail = {
        key: _numbers(data[key], f"{where}.{key}", num_stages)
        for key in DETAIL_TABLES
        if key in data
    }
    capacity = data["memory_capacity"]
    require(is_number(capacity, 0, strict=True), f"{where}.memory_capacity", capacity, "> 0")
    return StageCosts(**tables, memory_capacity=capacity, detail=detail)


def stage_costs(costs: PipelineCosts) -> StageCosts:
    """The simulator's per-stage costs as the partition records them (every memory table, and
    the receive waits where there are any)."""
    return StageCosts(
        **{key: tuple(getattr(costs, key)) for key in _STAGE_COSTS},
        memory_capacity=costs.memory_capacity,
        # every table the cost model filled (the receive waits only where the spec has them)
        detail={key: tuple(getattr(costs, key)) for key in DETAIL_TABLES if getattr(costs, key)},
    )


def costs_to_json(costs: StageCosts | None) -> dict[str, Any]:
    """The per-stage costs as the partition artefact writes them (the capacity before the
    memory model's tables)."""
    if costs is None:
        return {}
    data: dict[str, Any] = {key: list(getattr(costs, key)) for key in _STAGE_COSTS}
    data["memory_capacity"] = costs.memory_capacity
    return data | {key: list(values) for key, values in costs.detail.items()}


@dataclass(frozen=True)
class Comparison:
    """Another plan, for the summary to compare with: its predicted step, and how many blocks
    and whole stages it recomputes."""

    step_time: float
    recomputed: int

    def to_json(self) -> dict[str, Any]:
        return {"step_time": self.step_time, "recomputed": self.recomputed}

    @classmethod
    def from_json(cls, data: Any, where: str) -> Comparison:
        require(
            isinstance(data, dict) and set(data) == {"step_time", "recomputed"},
            where,
            data,
            "an object with step_time and recomputed",
        )
        step, recomputed = data["step_time"], data["recomputed"]
        require(is_number(step, 0, strict=True), f"{where}.step_time", step, "seconds > 0")
        require(is_int(recomputed, 0), f"{where}.recomputed", recomputed, "a count >= 0")
        return cls(float(step), recomputed)


@dataclass(frozen=True)
class RequestedSplit:
    """The stages the model's author asked for (its ``pipe_split()`` markers), predicted
    under the same settings, for the summary to compare with the partition: ``asked`` in
    words, its stages, and its bottleneck and step (None, and ``problem``, where it cannot
    run: a device short of memory even recomputing, a boundary inside a unit)."""

    asked: str
    stages: int
    bottleneck: float | None
    step_time: float | None
    problem: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "asked": self.asked,
            "stages": self.stages,
            "bottleneck": self.bottleneck,
            "step_time": self.step_time,
            "problem": self.problem,
        }

    @classmethod
    def from_json(cls, data: Any, where: str) -> RequestedSplit:
        keys = {"asked", "stages", "bottleneck", "step_time", "problem"}
        require(isinstance(data, dict) and set(data) == keys, where, data, f"an object of {keys}")
        require(is_text(data["asked"]), f"{where}.asked", data["asked"], "text")
        require(is_int(data["stages"], 1), f"{where}.stages", data["stages"], "a count >= 1")
        for name in ("bottleneck", "step_time"):
            value = data[name]
            require(
                value is None or is_number(value, 0, strict=True),
                f"{where}.{name}",
                value,
                "seconds > 0, or null",
            )
        require(isinstance(data["problem"], str), f"{where}.problem", data["problem"], "text")
        runs = data["step_time"] is not None and data["bottleneck"] is not None
        require(
            runs != bool(data["problem"]),
            f"{where}.problem",
            data["problem"],
            "why the split cannot run, exactly when it has no step",
        )
        return cls(
            data["asked"], data["stages"], data["bottleneck"], data["step_time"], data["problem"]
        )


@dataclass(frozen=True)
class Partition:
    """Which stage each unit runs in and which device each stage runs on, with the settings,
    prediction and per-stage costs it was made with."""

    method: str
    stage_of_unit: list[int]
    device_of_stage: list[int]
    graph_digest: str
    #: schedule, microbatches, optimizer, dp_shard ...
    settings: PartitionSettings = field(default_factory=PartitionSettings)
    predicted: PredictedStep | None = None
    #: per-stage costs the ``auto`` schedule orders actions by
    costs: StageCosts | None = None
    #: stages whose activations are recomputed in backward, to fit device memory
    recompute: list[int] = field(default_factory=list)
    #: blocks (original names) of other stages recomputed one by one, to fit device memory
    recompute_blocks: list[str] = field(default_factory=list)
    #: the other of the two partitions a method makes when one recomputes activations: with
    #: stages balanced by recomputing, or shrunk where short of memory (recomputing only where
    #: nothing fits without); this is the faster (None: not compared)
    compared: Comparison | None = None
    #: the stages the model's pipe_split() markers ask for, predicted alike (None: it has none,
    #: or they are the partition's stages)
    requested: RequestedSplit | None = None
    #: values each stage reading them recomputes instead of receiving (computed from sizes and
    #: constants, cheaper than a transfer: autopipe/partitioning/recomputed_values.py)
    recomputed_values: list[str] = field(default_factory=list)

    @property
    def profile_source(self) -> str:
        """Where the costs came from: ``analytic profile for H100``, or ``measured on cpu (...,
        1 thread), memory and link of H100``."""
        settings = self.settings
        return profile_source(
            "?" if settings.profile is None else settings.profile,
            str(settings.device),  # "None" where the partition does not say
            "" if settings.measured_on is None else settings.measured_on,
            bool(settings.bf16),
        )

    @property
    def num_stages(self) -> int:
        return len(self.device_of_stage)

    @property
    def processes_per_node(self) -> int:
        """The ranks of the plan each node runs (its pipeline ranks x --dp-shard x --tp on
        nodes of ``gpus_per_node``, 8 where the partition does not say, as the package's launch
        script places them: :func:`.network.node_layout`)."""
        settings = self.settings
        ranks = len(set(self.device_of_stage)) * (settings.dp_shard or 1) * (settings.tp or 1)
        return node_layout(ranks, settings.gpus_per_node or 8, settings.tp or 1)[1]

    @property
    def recomputed(self) -> int:
        """How many blocks and whole stages recompute their activations."""
        return len(self.recompute) + len(self.recompute_blocks)

    def stage_of_nodes(self, graph: Graph) -> dict[str, int]:
        """Each node of ``graph`` (by name) -> the stage its unit runs in."""
        return {n: self.stage_of_unit[u] for u, unit in enumerate(graph.units) for n in unit.nodes}

    def check_graph(self, graph: Graph) -> None:
        """Check that the partition belongs to ``graph`` and that every data edge and every
        in-place write's order goes to the same or a later stage (no cycle between stages)."""
        if self.graph_digest != graph_digest(graph) or len(self.stage_of_unit) != len(graph.units):
            raise ArtifactError(
                "the partition was made for a different graph; run `autopipe partition` on this graph again"
            )
        for name in self.recomputed_values:
            if name not in graph.dag or graph[name].kind != "call":
                raise ArtifactError(
                    f"the partition recomputes {name!r}, which this graph does not compute; "
                    "run `autopipe partition` on this graph again"
                )
        edges = [
            (src, n.name) for n in graph.calls for src in n.inputs if graph[src].kind == "call"
        ]
        for before, after in edges + order_edges(graph):
            first, then = graph[before].unit, graph[after].unit
            if self.stage_of_unit[first] > self.stage_of_unit[then]:
                raise PartitionError(
                    f"unit {then} ({graph.units[then].label}, stage {self.stage_of_unit[then]}) "
                    f"must run after unit {first} ({graph.units[first].label}), which the partition "
                    f"puts in the later stage {self.stage_of_unit[first]}: the stages would form a "
                    "cycle. Run `autopipe partition` again, or move the units so that stage "
                    "numbers never decrease along the model's data flow"
                )

    def with_settings(self, **settings: Any) -> Partition:
        """This partition with more settings recorded (train.py's defaults, the plan search)."""
        return dataclasses.replace(self, settings=dataclasses.replace(self.settings, **settings))

    def validate(self) -> None:
        """Check the partition on its own: stage and device numbers, settings, costs.
        Raises :class:`ArtifactError` naming the first field that is wrong."""
        _parse(self.to_json())

    def to_json(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "graph_digest": self.graph_digest,
            "settings": self.settings.to_json(),
            "device_of_stage": self.device_of_stage,
            "stage_of_unit": self.stage_of_unit,
            "predicted": {} if self.predicted is None else self.predicted.to_json(),
            "costs": costs_to_json(self.costs),
            "recompute": self.recompute,
            "recompute_blocks": self.recompute_blocks,
        } | (
            ({} if self.compared is None else {"compared": self.compared.to_json()})
            | ({} if self.requested is None else {"requested": self.requested.to_json()})
            | ({"recomputed_values": self.recomputed_values} if self.recomputed_values else {})
        )

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Partition:
        """The partition a ``autopipe.partition`` payload describes, checked with :meth:`validate`."""
        try:
            return _parse(data)
        except KeyError as exc:
            raise ArtifactError(
                f"the partition artefact has no {exc}; run `autopipe partition` again"
            ) from None
        except ArtifactError as exc:
            raise ArtifactError(
                f"the partition artefact is invalid: {exc}; run `autopipe partition` again"
            ) from None

    def save(self, path: str | Path) -> None:
        write_artifact(path, PARTITION_KIND, self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Partition:
        data = read_artifact(path, PARTITION_KIND)
        try:
            return cls.from_json(data)
        except ArtifactError as exc:
            raise ArtifactError(f"{path}: {exc}") from None


def _parse(data: dict[str, Any]) -> Partition:
    """The partition ``data`` describes; raises :class:`KeyError` for a missing required field
    and :class:`ArtifactError` naming the first wrong one."""
    method = data["method"]
    stage_of_unit = _ints(data["stage_of_unit"], "stage_of_unit")
    device_of_stage = _ints(data["device_of_stage"], "device_of_stage")
    digest = data["graph_digest"]
    recompute = _ints(data.get("recompute", []), "recompute")
    recompute_blocks = data.get("recompute_blocks", [])
    require(is_text(method), "method", method, "a method name")
    require(is_text(digest), "graph_digest", digest, "a digest")
    stages, devices = len(device_of_stage), len(set(device_of_stage))
    require(stages >= 1, "device_of_stage", device_of_stage, "a list of 1 or more ranks")
    for unit, stage in enumerate(stage_of_unit):
        require(
            0 <= stage < stages,
            f"stage_of_unit[{unit}]",
            stage,
            f"a stage of the partition's {stages} (0 .. {stages - 1})",
        )
    empty = sorted(set(range(stages)) - set(stage_of_unit))
    if empty:
        raise ArtifactError(f"stage_of_unit leaves stage(s) {empty} without units")
    for stage, device in enumerate(device_of_stage):
        require(
            0 <= device < devices,
            f"device_of_stage[{stage}]",
            device,
            f"one of the partition's {devices} device ranks, numbered 0 .. {devices - 1}",
        )
    require(
        all(is_int(s) and 0 <= s < stages for s in recompute)
        and len(set(recompute)) == len(recompute),
        "recompute",
        recompute,
        f"a list of distinct stages (0 .. {stages - 1})",
    )
    require(
        isinstance(recompute_blocks, list)
        and all(isinstance(b, str) and b for b in recompute_blocks)
        and len(set(recompute_blocks)) == len(recompute_blocks),
        "recompute_blocks",
        recompute_blocks,
        "a list of distinct block names",
    )
    recomputed_values = data.get("recomputed_values", [])
    require(
        isinstance(recomputed_values, list)
        and all(is_text(v) for v in recomputed_values)
        and len(set(recomputed_values)) == len(recomputed_values),
        "recomputed_values",
        recomputed_values,
        "a list of distinct value names",
    )
    settings = PartitionSettings.from_json(data.get("settings", {}), "settings")
    _check_placement(settings.schedule, device_of_stage)
    costs = costs_from_json(data.get("costs", {}), stages, "costs")
    predicted = PredictedStep.from_json(data.get("predicted", {}), stages, devices, "predicted")
    compared, requested = data.get("compared"), data.get("requested")
    return Partition(
        compared=None if compared is None else Comparison.from_json(compared, "compared"),
        requested=None if requested is None else RequestedSplit.from_json(requested, "requested"),
        method=method,
        stage_of_unit=stage_of_unit,
        device_of_stage=device_of_stage,
        graph_digest=digest,
        settings=settings,
        predicted=predicted,
        costs=costs,
        recompute=recompute,
        recompute_blocks=recompute_blocks,
        recomputed_values=recomputed_values,
    )


def _check_placement(schedule: str | None, device_of_stage: list[int]) -> None:
    """Check that ``schedule`` (when the partition names one) runs the stages' placement."""
    if schedule is None:
        return
    stages, devices = len(device_of_stage), len(set(device_of_stage))
    if schedule in SINGLE_STAGE:
        fits = device_of_stage == list(range(stages))
    elif schedule in MULTI_STAGE:
        fits = stages % devices == 0 and stages > devices
        fits = fits and device_of_stage == torch_placement(schedule, stages, devices)
    else:
        fits = True
    require(
        fits,
        "device_of_stage",
        device_of_stage,
        f"a placement the {schedule} schedule runs (see `autopipe partition --schedule`)",
    )


def _ints(value: Any, field_name: str) -> list[int]:
    require(
        isinstance(value, list) and all(is_int(v, 0) for v in value),
        field_name,
        value,
        "a list of integers of at least 0",
    )
    return value  # type: ignore[no-any-return]


def _numbers(value: Any, field_name: str, length: int) -> tuple[float, ...]:
    require(
        isinstance(value, list) and len(value) == length and all(is_number(v, 0) for v in value),
        field_name,
        value,
        f"a list of {length} numbers of at least 0",
    )
    return tuple(value)
