"""The partition artefact: which stage each unit runs in, which device each stage runs on."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..artifacts import read_artifact, write_artifact
from ..errors import ArtifactError, PartitionError
from ..graph import Graph
from ..profiling.profile import graph_digest

PARTITION_KIND = "partition"


@dataclass
class Partition:
    method: str
    stage_of_unit: list[int]
    device_of_stage: list[int]
    graph_digest: str
    settings: dict = field(default_factory=dict)  # schedule, microbatches, optimizer, device
    predicted: dict = field(default_factory=dict)  # Prediction.to_json()
    #: per-stage costs the ``auto`` schedule orders actions by (runtime.schedule.PipelineCosts fields)
    costs: dict = field(default_factory=dict)
    #: stages whose activations are recomputed in backward, to fit device memory
    recompute: list[int] = field(default_factory=list)

    @property
    def num_stages(self) -> int:
        return len(self.device_of_stage)

    def check_graph(self, graph: Graph) -> None:
        if self.graph_digest != graph_digest(graph) or len(self.stage_of_unit) != len(graph.units):
            raise ArtifactError(
                "the partition was made for a different graph; run `autopipe partition` on this graph again"
            )
        if sorted(set(self.stage_of_unit)) != list(range(self.num_stages)):
            raise PartitionError(f"the partition leaves some of its {self.num_stages} stages empty")

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
        }

    @classmethod
    def from_json(cls, data: dict) -> Partition:
        try:
            return cls(
                method=data["method"],
                stage_of_unit=[int(s) for s in data["stage_of_unit"]],
                device_of_stage=[int(d) for d in data["device_of_stage"]],
                graph_digest=data["graph_digest"],
                settings=data.get("settings", {}),
                predicted=data.get("predicted", {}),
                costs=data.get("costs", {}),
                recompute=[int(s) for s in data.get("recompute", [])],
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ArtifactError(
                f"partition artefact is malformed ({exc!r}); run `autopipe partition` again"
            ) from exc

    def save(self, path) -> None:
        write_artifact(path, PARTITION_KIND, self.to_json())

    @classmethod
    def load(cls, path) -> Partition:
        return cls.from_json(read_artifact(path, PARTITION_KIND))
