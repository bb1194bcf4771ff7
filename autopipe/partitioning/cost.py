"""The cost model partitioners optimise and reports quote.

A stage costs its units' forward + backward time plus the time to move what crosses its two
boundaries (activations forward, gradients backward) over the device link. Values are relayed,
so a value produced in stage ``p`` and read in stage ``c`` crosses every boundary between them.
Memory per device: parameters, gradients and optimizer state of the stage, plus activations of the
microbatches in flight under the schedule.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..graph import Graph, TensorMeta
from ..profiling.devices import DeviceSpec
from ..profiling.profile import Profile

#: Bytes of state per parameter byte: weight + gradient (+ two Adam moments).
STATE_FACTOR = {"sgd": 2, "adamw": 4}


@dataclass
class StageCost:
    forward: float
    backward: float
    communication: float  # seconds sending / receiving its boundaries, forward and backward
    memory: float  # peak bytes on its device
    parameters: int  # parameter bytes

    @property
    def time(self) -> float:
        return self.forward + self.backward + self.communication


@dataclass
class Prediction:
    stages: list[StageCost]
    lower_bound: float  # max(total compute / stages, heaviest unit)
    step_time: float  # sum of stage times + (microbatches - 1) x bottleneck

    @property
    def bottleneck(self) -> float:
        return max(s.time for s in self.stages)

    def to_json(self) -> dict:
        return {
            "bottleneck": self.bottleneck,
            "lower_bound": self.lower_bound,
            "step_time": self.step_time,
            "stages": [asdict(s) | {"time": s.time} for s in self.stages],
        }


def in_flight(stage: int, num_stages: int, schedule: str, microbatches: int) -> int:
    """Microbatches whose activations a stage holds at its peak."""
    if schedule == "gpipe":
        return microbatches
    return min(num_stages - stage, microbatches)


class CostModel:
    """Per-unit costs of one graph under one profile, and what any stage assignment costs."""

    def __init__(self, graph: Graph, profile: Profile, *, schedule: str = "1f1b", microbatches: int | None = None, optimizer: str = "adamw"):
        profile.check_graph(graph)
        self.graph = graph
        self.device: DeviceSpec = profile.device
        self.schedule = schedule
        self.microbatches = microbatches
        self.optimizer = optimizer
        self.forward = [u.forward for u in profile.units]
        self.backward = [u.backward for u in profile.units]
        self.compute = [f + b for f, b in zip(self.forward, self.backward)]
        self.activations = [u.activations for u in profile.units]
        self.num_units = len(graph.units)
        # parameters: counted in the first unit that reads them
        self.param_bytes = [0] * self.num_units
        seen: set[str] = set()
        for node in graph.calls:
            for src in node.inputs:
                placeholder = graph[src]
                if placeholder.kind == "param":
                    info = graph.param_of(placeholder.target)
                    if info.names[0] not in seen:
                        seen.add(info.names[0])
                        self.param_bytes[node.unit] += info.nbytes
        # values exchanged between units: (producer unit or -1, last reader unit or num_units, bytes)
        unit_of = {n.name: n.unit for n in graph.calls}
        outputs = set(graph.outputs)
        self.values: list[tuple[int, int, float]] = []
        for node in graph.nodes:
            if node.kind not in ("call", "input") or not isinstance(node.meta, TensorMeta):
                continue
            producer = unit_of.get(node.name, -1)
            readers = [unit_of[u] for u in graph.users(node.name) if u in unit_of]
            last = max(readers, default=producer)
            if node.name in outputs:
                last = self.num_units
            if last > producer:
                meta = node.meta
                moved = meta.nbytes * (2 if meta.requires_grad else 1)  # activation + its gradient
                self.values.append((producer, last, moved))

    # -- contiguous partitions ----------------------------------------------------------------
    def boundary_bytes(self) -> list[float]:
        """Bytes crossing the cut after unit position ``p`` (for p in 0 .. N-2), both directions."""
        diff = [0.0] * (self.num_units + 1)
        for producer, last, moved in self.values:
            first = max(producer, 0)
            end = min(last, self.num_units - 1)  # cuts first .. end-1
            if end > first:
                diff[first] += moved
                diff[end] -= moved
        out, running = [], 0.0
        for p in range(self.num_units - 1):
            running += diff[p]
            out.append(running)
        return out

    def state_factor(self) -> int:
        return STATE_FACTOR[self.optimizer]

    # -- any assignment -----------------------------------------------------------------------
    def evaluate(self, stage_of_unit: list[int], num_stages: int) -> Prediction:
        forward = [0.0] * num_stages
        backward = [0.0] * num_stages
        activations = [0.0] * num_stages
        params = [0] * num_stages
        for unit, stage in enumerate(stage_of_unit):
            forward[stage] += self.forward[unit]
            backward[stage] += self.backward[unit]
            activations[stage] += self.activations[unit]
            params[stage] += self.param_bytes[unit]
        crossing = [0.0] * max(num_stages - 1, 0)  # bytes over boundary s -> s + 1
        for producer, last, moved in self.values:
            first = stage_of_unit[producer] if producer >= 0 else 0
            end = stage_of_unit[last] if last < self.num_units else num_stages - 1
            for s in range(first, end):
                crossing[s] += moved
        microbatches = self.microbatches or 2 * num_stages
        stages = []
        for s in range(num_stages):
            moved = (crossing[s - 1] if s > 0 else 0.0) + (crossing[s] if s < num_stages - 1 else 0.0)
            memory = params[s] * self.state_factor() + activations[s] * in_flight(s, num_stages, self.schedule, microbatches)
            stages.append(StageCost(forward[s], backward[s], moved / self.device.link_bandwidth, memory, params[s]))
        times = [s.time for s in stages]
        return Prediction(stages, self.lower_bound(num_stages), sum(times) + (microbatches - 1) * max(times))

    def lower_bound(self, num_stages: int) -> float:
        return max(sum(self.compute) / num_stages, max(self.compute, default=0.0))
