"""What a report shows, read back from a compiled pipeline directory.

Everything comes from the files ``autopipe compile`` leaves behind: ``pipeline.json`` (stage
inputs and outputs) and the artefacts under ``artifacts/`` (graph, partition, and the profile
when there is one). The predicted timeline is simulated again from the partition's per-stage
costs with the same event engine the partitioner judged the partition by.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from ..artifacts import read_artifact
from ..errors import ArtifactError
from ..ir import Graph
from ..partitioning import Partition
from ..partitioning.partition import PartitionSettings, PredictedStep
from ..partitioning.simulator import Simulation, schedule_orders, simulate
from ..profiling import Profile
from ..runtime.core.pipeline import Pipeline, PipelineFormatError
from ..runtime.core.schedules import MemoryPeak, PipelineCosts

ARTIFACTS = "artifacts"
PIPELINE_KIND = "pipeline"
#: the kinds of compute action, by their letter
KIND_NAMES = {"F": "forward", "B": "backward", "I": "input backward", "W": "weight backward"}
#: bytes of state per parameter byte (weight, gradient, optimizer state); see partitioning.cost
STATE_FACTOR = {"sgd": 2, "adamw": 4}


@dataclass
class StageRow:
    """One stage as the report tables show it (times in seconds, memory in bytes)."""

    stage: int
    device: int
    units: int
    parameters: int  # parameter count (tied weights counted once, in their first stage)
    forward: float
    backward: float
    communication: float
    time: float
    memory: float
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    first_unit: str = ""
    last_unit: str = ""
    recompute: bool = False  # activations recomputed in backward to fit device memory


@dataclass
class ReportData:
    """A compiled pipeline: its description, artefacts, and what the cost model predicts."""

    directory: Path
    pipeline: Pipeline
    graph: Graph
    partition: Partition
    profile: Profile | None = None

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> ReportData:
        """Read the pipeline in ``directory`` (the ``--out`` of ``autopipe compile``)."""
        directory = Path(directory)
        if not (directory / "pipeline.json").is_file():
            raise ArtifactError(
                f"{directory} is not a compiled pipeline (no pipeline.json); "
                "give the --out directory of `autopipe compile`"
            )
        artifacts = directory / ARTIFACTS
        profile_path = artifacts / "profile.json"
        try:
            pipeline = Pipeline.from_json(read_artifact(directory / "pipeline.json", PIPELINE_KIND))
        except PipelineFormatError as exc:
            raise ArtifactError(f"{directory / 'pipeline.json'}: {exc}") from None
        data = cls(
            directory=directory,
            pipeline=pipeline,
            graph=Graph.load(artifacts / "graph.json"),
            partition=Partition.load(artifacts / "partition.json"),
            profile=Profile.load(profile_path) if profile_path.is_file() else None,
        )
        data.partition.check_graph(data.graph)
        return data

    # -- settings -----------------------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return self.partition.num_stages

    @property
    def num_devices(self) -> int:
        return max(self.partition.device_of_stage) + 1

    @property
    def settings(self) -> PartitionSettings:
        return self.partition.settings

    @property
    def predicted(self) -> PredictedStep | None:
        """The cost model's prediction (None for a partition without one)."""
        return self.partition.predicted

    @property
    def schedule(self) -> str:
        if self.settings.schedule:
            return self.settings.schedule
        if self.predicted is None or self.predicted.schedule is None:
            return "1f1b"
        return self.predicted.schedule

    @property
    def microbatches(self) -> int:
        return int(self.settings.microbatches or self.pipeline.default_microbatches)

    @property
    def model_name(self) -> str:
        return self.pipeline.model

    def stages_on(self, device: int) -> list[int]:
        return [s for s, d in enumerate(self.partition.device_of_stage) if d == device]

    # -- cost model ---------------------------------------------------------------------------
    @cached_property
    def costs(self) -> PipelineCosts:
        """Per-stage costs of one microbatch, as the partitioner stored them."""
        stored = self.partition.costs or self.pipeline.schedule.costs
        return PipelineCosts(
            **stored.to_json(), device_of_stage=list(self.partition.device_of_stage)
        ).for_schedule(self.schedule)

    @cached_property
    def simulation(self) -> Simulation:
        """One training step under the pipeline's schedule, simulated event by event."""
        orders = schedule_orders(self.schedule, self.costs, self.microbatches)
        return simulate(orders, self.costs)

    @property
    def memory_capacity(self) -> float:
        """Each rank's memory: its device's (a CPU's share of the node's, as it was planned)."""
        if self.profile is not None:
            return float(self.profile.device.shared_by(self.partition.processes_per_node).memory)
        return float(self.costs.memory_capacity)

    def device_static_memory(self) -> list[float]:
        """Parameters, gradients and optimizer state per device, in bytes."""
        static = [0.0] * self.num_devices
        for stage, device in enumerate(self.partition.device_of_stage):
            static[device] += self.costs.static_memory[stage]
        return static

    def device_peak_memory(self) -> list[float]:
        """Predicted peak bytes per device (what ``memory_peaks`` breaks down, when present)."""
        predicted = self.predicted.device_memory if self.predicted is not None else ()
        return list(predicted or self.simulation.peak_memory)

    @property
    def state_factor(self) -> int:
        optimizer = self.settings.optimizer
        return STATE_FACTOR.get("adamw" if optimizer is None else optimizer, 4)

    @property
    def dp_shard(self) -> int:
        """The data-parallel ranks per stage the partition sharded training state over."""
        return int(self.settings.dp_shard or 1)

    def device_memory_parts(self) -> dict[str, list[float]]:
        """Static bytes per device in parts: the device's share of its stages' parameters,
        gradients and optimizer state (1/N each with --dp-shard N), and what FSDP2 holds
        gathered at once (the largest block's and the stage's own parameters, with gradients)."""
        parts = {k: [0.0] * self.num_devices for k in ("parameters", "gradients", "optimizer")}
        parts["gathered"] = [0.0] * self.num_devices
        factor, shards = self.state_factor, self.dp_shard
        stages = self.predicted.stages if self.predicted is not None else ()
        for s, device in enumerate(self.partition.device_of_stage):
            static = self.costs.static_memory[s]
            share = stages[s].parameters / shards if s < len(stages) else static / factor
            # gradients (and optimizer state) of the trainable parameters only, where known
            grads = self.costs.gradients[s] if self.costs.gradients else share
            parts["parameters"][device] += share
            parts["gradients"][device] += grads
            parts["optimizer"][device] += grads * (factor - 2)
            parts["gathered"][device] += max(static - share - grads * (factor - 1), 0.0)
        return parts

    def device_peak_parts(self) -> dict[str, list[float]]:
        """Bytes per device at its peak, in parts: the static parts (gradients only once the
        peak comes after the first backward), then what the memory model adds at the peak;
        partitions from before that model: static parts and activations."""
        parts = self.device_memory_parts()
        peaks = self.memory_peaks
        if not peaks:
            static, peak = self.device_static_memory(), self.device_peak_memory()
            parts["activations"] = [max(p - s, 0.0) for p, s in zip(peak, static)]
            return parts
        for key in ("buffers", "activations", "input_gradients", "transient"):
            parts[key] = [getattr(p, key) for p in peaks]
        for device, (static_bytes, at_peak) in enumerate(zip(self.device_static_memory(), peaks)):
            # not allocated yet
            parts["gradients"][device] -= max(static_bytes - at_peak.state, 0.0)
        return parts

    @property
    def memory_peaks(self) -> tuple[MemoryPeak, ...]:
        """What each device holds at its predicted peak (none for partitions before them)."""
        if self.predicted is None or self.predicted.memory_peaks is None:
            return ()
        return self.predicted.memory_peaks

    @property
    def lower_bound(self) -> float:
        """The predicted lower bound of a microbatch's time (0 without a prediction)."""
        return 0.0 if self.predicted is None else self.predicted.lower_bound

    # -- per-stage rows -----------------------------------------------------------------------
    def parameter_counts(self) -> list[int]:
        """Parameters per stage, each counted in the first stage that reads it."""
        counts = [0] * self.num_stages
        seen: set[str] = set()
        for node in self.graph.calls:
            for src in node.inputs:
                if self.graph[src].kind != "param":
                    continue
                info = self.graph.param_of(self.graph[src].target)
                if info.names[0] not in seen:
                    seen.add(info.names[0])
                    counts[self.partition.stage_of_unit[node.unit]] += math.prod(info.shape)
        return counts

    @cached_property
    def stages(self) -> list[StageRow]:
        part = self.partition
        costs = self.predicted.stages if self.predicted is not None else ()
        descriptions = self.pipeline.stages
        params = self.parameter_counts()
        rows = []
        for s in range(self.num_stages):
            cost = costs[s] if s < len(costs) else None
            units = [u for u, stage in enumerate(part.stage_of_unit) if stage == s]
            described = descriptions[s] if s < len(descriptions) else None
            rows.append(
                StageRow(
                    stage=s,
                    device=part.device_of_stage[s],
                    units=len(units),
                    parameters=params[s],
                    forward=self.costs.forward[s] if cost is None else cost.forward,
                    backward=self.costs.backward[s] if cost is None else cost.backward,
                    communication=0.0 if cost is None else cost.communication,
                    time=(
                        self.costs.forward[s] + self.costs.backward[s]
                        if cost is None
                        else cost.time
                    ),
                    memory=self.costs.static_memory[s] if cost is None else cost.memory,
                    inputs=list(described.inputs) if described else [],
                    outputs=list(described.outputs) if described else [],
                    first_unit=self.graph.units[units[0]].label if units else "",
                    last_unit=self.graph.units[units[-1]].label if units else "",
                    recompute=s in part.recompute,
                )
            )
        return rows

    def value_shape(self, name: str) -> str:
        """``2x64x128`` for a value crossing stages (``batch x seq x 128`` with dynamic
        dimensions), ``""`` when pipeline.json does not say."""
        value = self.pipeline.values.get(name)
        if value is None or not value.shape:
            return ""
        if value.sizes is None:
            return "x".join(map(str, value.shape))
        return " x ".join(map(str, value.sizes))


# -- formatting -------------------------------------------------------------------------------
def format_bytes(value: float) -> str:
    """``1.5 GiB``, ``12.0 MiB``, ``512 B``."""
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(value) >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value:.0f} B"


def format_count(value: float) -> str:
    """``1.35M``, ``12.0k``, ``512``."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= size:
            return f"{value / size:.2f}{unit}"
    return f"{value:.0f}"
