"""The profile artefact: forward / backward time and memory of every unit of a graph."""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass

from ..artifacts import read_artifact, write_artifact
from ..errors import ArtifactError
from ..graph import Graph
from .devices import DeviceSpec

PROFILE_KIND = "profile"


@dataclass
class UnitCost:
    """Costs of one unit for one microbatch."""

    forward: float  # seconds
    backward: float  # seconds
    flops_forward: float = 0.0
    flops_backward: float = 0.0
    bytes_forward: int = 0  # bytes operators read and write (analytic profile)
    bytes_backward: int = 0
    activations: int = 0  # bytes autograd saves for backward (storage de-duplicated)
    outputs: int = 0  # bytes of the values the unit hands to other units
    parameters: int = (
        0  # bytes of the parameters it reads (gradients and optimizer state scale with it)
    )

    @property
    def time(self) -> float:
        return self.forward + self.backward


@dataclass
class Profile:
    mode: str  # "analytic" | "measured"
    device: DeviceSpec
    units: list[UnitCost]
    graph_digest: str
    measured_on: str = ""  # the local device a measured profile ran on

    def check_graph(self, graph: Graph) -> None:
        if self.graph_digest != graph_digest(graph) or len(self.units) != len(graph.units):
            raise ArtifactError(
                "the profile was made for a different graph (other model, depth or basic blocks); "
                "run `autopipe profile` on this graph again"
            )

    def to_json(self) -> dict:
        return {
            "mode": self.mode,
            "measured_on": self.measured_on,
            "graph_digest": self.graph_digest,
            "device": self.device.to_json(),
            "units": [asdict(u) for u in self.units],
        }

    @classmethod
    def from_json(cls, data: dict) -> Profile:
        try:
            return cls(
                mode=data["mode"],
                device=DeviceSpec.from_json(data["device"]),
                units=[UnitCost(**u) for u in data["units"]],
                graph_digest=data["graph_digest"],
                measured_on=data.get("measured_on", ""),
            )
        except (KeyError, TypeError) as exc:
            raise ArtifactError(
                f"profile artefact is malformed ({exc!r}); run `autopipe profile` again"
            ) from exc

    def save(self, path) -> None:
        write_artifact(path, PROFILE_KIND, self.to_json())

    @classmethod
    def load(cls, path) -> Profile:
        return cls.from_json(read_artifact(path, PROFILE_KIND))


def graph_digest(graph: Graph) -> str:
    """A fingerprint of the graph, so a profile or partition is never applied to another graph."""
    return hashlib.sha256(graph.json_text().encode()).hexdigest()[:16]
