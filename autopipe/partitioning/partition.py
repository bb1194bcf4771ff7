"""The partition artefact: which stage each unit runs in, which device each stage runs on."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..artifacts import read_artifact, write_artifact
from ..checks import is_int, is_number, is_text, require
from ..errors import ArtifactError, PartitionError
from ..ir.graph import Graph
from ..ir.ordering import order_edges
from ..profiling.profile import graph_digest, profile_source
from ..runtime.options import MULTI_STAGE, SCHEDULES, SINGLE_STAGE
from ..runtime.options import placement as torch_placement
from ..runtime.pipeline import MEMORY_DETAIL
from ..runtime.schedule import MemoryPeak

PARTITION_KIND = "partition"
#: per-stage cost lists (runtime.schedule.PipelineCosts fields): stage counts less the offset
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
_PREDICTED_STAGE = (
    "forward",
    "backward",
    "comm_forward",
    "comm_backward",
    "memory",
    "parameters",
    "communication",
    "time",
)


@dataclass
class Partition:
    method: str
    stage_of_unit: list[int]
    device_of_stage: list[int]
    graph_digest: str
    settings: dict = field(default_factory=dict)  # schedule, microbatches, optimizer, dp_shard ...
    predicted: dict = field(default_factory=dict)  # Prediction.to_json()
    #: per-stage costs the ``auto`` schedule orders actions by (runtime.schedule.PipelineCosts fields)
    costs: dict = field(default_factory=dict)
    #: stages whose activations are recomputed in backward, to fit device memory
    recompute: list[int] = field(default_factory=list)
    #: blocks (original names) of other stages recomputed one by one, to fit device memory
    recompute_blocks: list[str] = field(default_factory=list)

    @property
    def profile_source(self) -> str:
        """Where the costs came from: ``analytic profile for H100``, or ``measured on cpu (...,
        1 thread), memory and link of H100``."""
        settings = self.settings
        return profile_source(
            settings.get("profile", "?"), settings.get("device"), settings.get("measured_on", "")
        )

    @property
    def num_stages(self) -> int:
        return len(self.device_of_stage)

    def check_graph(self, graph: Graph) -> None:
        """Check that the partition belongs to ``graph`` and that every data edge and every
        in-place write's order goes to the same or a later stage (no cycle between stages)."""
        if self.graph_digest != graph_digest(graph) or len(self.stage_of_unit) != len(graph.units):
            raise ArtifactError(
                "the partition was made for a different graph; run `autopipe partition` on this graph again"
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
        return dataclasses.replace(self, settings=self.settings | settings)

    def validate(self) -> None:
        """Check the partition on its own: stage and device numbers, settings, costs.
        Raises :class:`ArtifactError` naming the first field that is wrong."""
        require(is_text(self.method), "method", self.method, "a method name")
        require(is_text(self.graph_digest), "graph_digest", self.graph_digest, "a digest")
        stages, devices = self.num_stages, len(set(self.device_of_stage))
        require(stages >= 1, "device_of_stage", self.device_of_stage, "a list of 1 or more ranks")
        for unit, stage in enumerate(self.stage_of_unit):
            require(
                0 <= stage < stages,
                f"stage_of_unit[{unit}]",
                stage,
                f"a stage of the partition's {stages} (0 .. {stages - 1})",
            )
        empty = sorted(set(range(stages)) - set(self.stage_of_unit))
        if empty:
            raise ArtifactError(f"stage_of_unit leaves stage(s) {empty} without units")
        for stage, device in enumerate(self.device_of_stage):
            require(
                0 <= device < devices,
                f"device_of_stage[{stage}]",
                device,
                f"one of the partition's {devices} device ranks, numbered 0 .. {devices - 1}",
            )
        require(
            all(is_int(s) and 0 <= s < stages for s in self.recompute)
            and len(set(self.recompute)) == len(self.recompute),
            "recompute",
            self.recompute,
            f"a list of distinct stages (0 .. {stages - 1})",
        )
        require(
            isinstance(self.recompute_blocks, list)
            and all(isinstance(b, str) and b for b in self.recompute_blocks)
            and len(set(self.recompute_blocks)) == len(self.recompute_blocks),
            "recompute_blocks",
            self.recompute_blocks,
            "a list of distinct block names",
        )
        self._validate_settings()
        require(isinstance(self.costs, dict), "costs", self.costs, "an object")
        if self.costs:
            required = {*_STAGE_COSTS, "memory_capacity"}
            require(
                required <= set(self.costs) <= required | set(MEMORY_DETAIL),
                "costs",
                sorted(self.costs),
                f"the per-stage costs {sorted(required)} (and optionally {list(MEMORY_DETAIL)})",
            )
            for key, offset in _STAGE_COSTS.items():
                _require_numbers(self.costs[key], f"costs.{key}", stages - offset)
            for key in MEMORY_DETAIL:
                if key in self.costs:
                    _require_numbers(self.costs[key], f"costs.{key}", stages)
            capacity = self.costs["memory_capacity"]
            require(is_number(capacity, 0, strict=True), "costs.memory_capacity", capacity, "> 0")
        self._validate_predicted()

    def _validate_settings(self) -> None:
        settings = self.settings
        require(isinstance(settings, dict), "settings", settings, "an object")
        microbatches = settings.get("microbatches")
        require(
            microbatches is None or is_int(microbatches, 1),
            "settings.microbatches",
            microbatches,
            "a number of microbatches (1 or more)",
        )
        dp_shard = settings.get("dp_shard", 1)
        require(is_int(dp_shard, 1), "settings.dp_shard", dp_shard, "a number of ranks (1 or more)")
        for key in ("accumulate", "global_batch"):
            value = settings.get(key, 1)
            require(is_int(value, 1), f"settings.{key}", value, "a count (1 or more)")
        margin = settings.get("memory_margin", 0.0)
        require(is_number(margin, 0) and margin < 1, "settings.memory_margin", margin, "in [0, 1)")
        plans = settings.get("plans", [])
        require(
            isinstance(plans, list) and all(isinstance(p, dict) for p in plans),
            "settings.plans",
            plans,
            "a list of plans (objects)",
        )
        for key in ("optimizer", "device", "link", "profile", "measured_on"):
            value = settings.get(key, "")
            require(is_text(value), f"settings.{key}", value, "a one-line text")
        timed_at = settings.get("timed_at", {})
        require(
            isinstance(timed_at, dict) and all(is_int(v, 2) for v in timed_at.values()),
            "settings.timed_at",
            timed_at,
            "sizes of dynamic dimensions by name",
        )
        schedule = settings.get("schedule")
        if schedule is None:
            return
        require(schedule in SCHEDULES, "settings.schedule", schedule, f"one of {SCHEDULES}")
        stages, devices = self.num_stages, len(set(self.device_of_stage))
        if schedule in SINGLE_STAGE:
            fits = self.device_of_stage == list(range(stages))
        elif schedule in MULTI_STAGE:
            fits = stages % devices == 0 and stages > devices
            fits = fits and self.device_of_stage == torch_placement(schedule, stages, devices)
        else:
            fits = True
        require(
            fits,
            "device_of_stage",
            self.device_of_stage,
            f"a placement the {schedule} schedule runs (see `autopipe partition --schedule`)",
        )

    def _validate_predicted(self) -> None:
        predicted = self.predicted
        require(isinstance(predicted, dict), "predicted", predicted, "an object")
        if not predicted:
            return
        for key in ("bottleneck", "lower_bound", "step_time", "bubble"):
            require(
                is_number(predicted.get(key), 0), f"predicted.{key}", predicted.get(key), ">= 0"
            )
        for key in _PREDICTED_OPTIONAL:  # absent from partitions made before them
            if key in predicted:
                value = predicted[key]
                require(is_number(value, 0), f"predicted.{key}", value, ">= 0")
        devices = len(set(self.device_of_stage))
        _require_numbers(predicted.get("device_memory"), "predicted.device_memory", devices)
        peaks = predicted.get("memory_peaks", [])
        require(
            isinstance(peaks, list) and len(peaks) in (0, devices),
            "predicted.memory_peaks",
            peaks,
            f"a list of {devices} device peaks",
        )
        for device, peak in enumerate(peaks):
            where = f"predicted.memory_peaks[{device}]"
            require(
                isinstance(peak, dict) and set(peak) == _MEMORY_PEAK, where, peak, "a memory peak"
            )
            for key in _MEMORY_PEAK - {"moment"}:
                require(is_number(peak[key], 0), f"{where}.{key}", peak[key], ">= 0")
            require(is_text(peak["moment"]), f"{where}.moment", peak["moment"], "an action")
        rows = predicted.get("stages")
        require(
            isinstance(rows, list) and len(rows) == self.num_stages,
            "predicted.stages",
            rows,
            f"a list of {self.num_stages} stage costs",
        )
        for stage, row in enumerate(rows):
            require(isinstance(row, dict), f"predicted.stages[{stage}]", row, "an object")
            for key in _PREDICTED_STAGE:
                value = row.get(key)
                require(is_number(value, 0), f"predicted.stages[{stage}].{key}", value, ">= 0")

    def to_json(self) -> dict:
        return {
            "method": self.method,
            "graph_digest": self.graph_digest,
            "settings": self.settings,
            "device_of_stage": self.device_of_stage,
            "stage_of_unit": self.stage_of_unit,
            "predicted": self.predicted,
            "costs": self.costs,
            "recompute": self.recompute,
            "recompute_blocks": self.recompute_blocks,
        }

    @classmethod
    def from_json(cls, data: dict) -> Partition:
        """The partition a ``autopipe.partition`` payload describes, checked with :meth:`validate`."""
        try:
            part = cls(
                method=data["method"],
                stage_of_unit=_ints(data["stage_of_unit"], "stage_of_unit"),
                device_of_stage=_ints(data["device_of_stage"], "device_of_stage"),
                graph_digest=data["graph_digest"],
                settings=data.get("settings", {}),
                predicted=data.get("predicted", {}),
                costs=data.get("costs", {}),
                recompute=_ints(data.get("recompute", []), "recompute"),
                recompute_blocks=data.get("recompute_blocks", []),
            )
            part.validate()
        except KeyError as exc:
            raise ArtifactError(
                f"the partition artefact has no {exc}; run `autopipe partition` again"
            ) from None
        except ArtifactError as exc:
            raise ArtifactError(
                f"the partition artefact is invalid: {exc}; run `autopipe partition` again"
            ) from None
        return part

    def save(self, path) -> None:
        write_artifact(path, PARTITION_KIND, self.to_json())

    @classmethod
    def load(cls, path) -> Partition:
        data = read_artifact(path, PARTITION_KIND)
        try:
            return cls.from_json(data)
        except ArtifactError as exc:
            raise ArtifactError(f"{path}: {exc}") from None


def _ints(value: Any, field_name: str) -> list[int]:
    require(
        isinstance(value, list) and all(is_int(v, 0) for v in value),
        field_name,
        value,
        "a list of integers of at least 0",
    )
    return value


def _require_numbers(value: Any, field_name: str, length: int) -> None:
    require(
        isinstance(value, list) and len(value) == length and all(is_number(v, 0) for v in value),
        field_name,
        value,
        f"a list of {length} numbers of at least 0",
    )
