"""The cost model partitioners optimise and reports quote.

A stage costs its units' forward and backward time, each stretched to the time its transfers take
when those take longer (transfers are asynchronous and overlap compute, as FTPipe charges a stage:
``max(forward, comm_forward) + max(backward, comm_backward)``): activations cross its two
boundaries forward, gradients backward, over the device link; boundaries between two stages on the
same device cost nothing. Values are relayed, so a value produced in stage ``p`` and
read in stage ``c`` crosses every boundary between them. A whole step is simulated under the
schedule (:mod:`.simulator`). Memory per device: parameters, gradients and optimizer state of its
stages (1/N of them each when sharded over ``--dp-shard N``, plus the parameters FSDP2 gathers
at once: a stage's own outside its blocks and its largest block's, with their gradients), plus
the activations the schedule keeps alive.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass

import networkx as nx

from ..errors import PartitionError
from ..graph import Graph, TensorMeta
from ..mutation import order_edges
from ..profiling.devices import DeviceSpec
from ..profiling.profile import Profile
from ..tracing.blocks import block_calls
from ..runtime.options import SPLIT_BACKWARD
from ..runtime.pipeline import default_microbatches
from .simulator import PipelineCosts, Simulation, schedule_orders, simulate

#: Bytes of state per parameter byte: weight + gradient (+ two Adam moments).
STATE_FACTOR = {"sgd": 2, "adamw": 4}


def stage_time(forward: float, backward: float, comm_forward: float, comm_backward: float) -> float:
    """One microbatch through a stage whose transfers overlap its compute."""
    return max(forward, comm_forward) + max(backward, comm_backward)


@dataclass
class StageCost:
    forward: float
    backward: float
    comm_forward: float  # seconds receiving and sending activations off-device
    comm_backward: float  # seconds receiving and sending gradients off-device
    memory: float  # its static memory plus its activations in flight
    parameters: int  # parameter bytes

    @property
    def communication(self) -> float:
        return self.comm_forward + self.comm_backward

    @property
    def time(self) -> float:
        return stage_time(self.forward, self.backward, self.comm_forward, self.comm_backward)


@dataclass
class Prediction:
    stages: list[StageCost]
    device_of_stage: list[int]
    lower_bound: float  # max(total compute / devices, heaviest unit)
    step_time: float  # simulated step under the schedule
    schedule: str
    device_memory: list[float]  # peak bytes per device
    bubble: float  # idle fraction of device time in the simulated step

    @property
    def device_load(self) -> list[float]:
        load = [0.0] * (max(self.device_of_stage) + 1)
        for stage, device in zip(self.stages, self.device_of_stage):
            load[device] += stage.time
        return load

    @property
    def bottleneck(self) -> float:
        """The busiest device's compute + communication for one microbatch."""
        return max(self.device_load)

    def to_json(self) -> dict:
        return {
            "bottleneck": self.bottleneck,
            "lower_bound": self.lower_bound,
            "step_time": self.step_time,
            "schedule": self.schedule,
            "bubble": self.bubble,
            "device_memory": self.device_memory,
            "stages": [
                asdict(s) | {"communication": s.communication, "time": s.time} for s in self.stages
            ],
        }


@dataclass(frozen=True)
class Exchange:
    """A value one unit produces and later units read."""

    producer: int  # unit, or -1 for a model input
    readers: tuple[int, ...]  # units, plus ``num_units`` when it is a model output
    activation: int  # bytes forward
    gradient: int  # bytes backward (0 if it needs no gradient)

    @property
    def last(self) -> int:
        return max(self.readers)


def in_flight(stage: int, num_stages: int, schedule: str, microbatches: int) -> int:
    """Microbatches whose activations a stage holds at its peak under a one-stage-per-device schedule."""
    if schedule == "gpipe":
        return microbatches
    return min(num_stages - stage, microbatches)


@dataclass(frozen=True)
class BlockCost:
    """A block (autopipe/tracing/blocks.py) a stage may recompute on its own: the units it
    consists of, and the bytes of the values it reads from outside, which recomputing keeps."""

    fqn: str
    units: tuple[int, ...]
    inputs: float

    def stage(self, stage_of_unit: list[int]) -> int | None:
        """The stage holding the whole block, or None where a stage boundary cuts it (it is
        inline there, not a submodule)."""
        held = {stage_of_unit[u] for u in self.units}
        return held.pop() if len(held) == 1 else None


def block_costs(graph: Graph) -> dict[str, BlockCost]:
    """The blocks made of whole units (their costs are the units'), by original name."""
    blocks = {}
    for call in block_calls(graph):
        inside = set(call.nodes)
        units = tuple(sorted({graph[name].unit for name in call.nodes}))
        if not all(set(graph.units[u].nodes) <= inside for u in units):
            continue
        read = {
            src
            for name in call.nodes
            for src in graph[name].inputs
            if src not in inside and graph[src].kind in ("call", "input")
        }
        blocks[call.fqn] = BlockCost(call.fqn, units, float(sum(map(graph.value_bytes, read))))
    return blocks


class CostModel:
    """Per-unit costs of one graph under one profile, and what any stage assignment costs."""

    def __init__(
        self,
        graph: Graph,
        profile: Profile,
        *,
        schedule: str = "1f1b",
        microbatches: int | None = None,
        optimizer: str = "adamw",
        dp_shard: int = 1,
    ):
        profile.check_graph(graph)
        self.graph = graph
        self.device: DeviceSpec = profile.device
        self.schedule = schedule
        self.microbatches = microbatches
        self.optimizer = optimizer
        self.dp_shard = dp_shard
        self.forward = [u.forward for u in profile.units]
        self.backward = [u.backward for u in profile.units]
        self.compute = [f + b for f, b in zip(self.forward, self.backward)]
        self.activations = [u.activations for u in profile.units]
        self.num_units = len(graph.units)
        self.param_bytes = self._parameter_bytes(graph)
        self.blocks = block_costs(graph)
        self.exchanges = self._exchanges(graph)
        self.dag = self._unit_dag(graph)
        #: stages -> the best contiguous stage_of_unit (dp.solve_contiguous fills it)
        self.contiguous_optimum: dict[int, list[int]] = {}

    # -- construction -------------------------------------------------------------------------
    def _parameter_bytes(self, graph: Graph) -> list[int]:
        """Parameter bytes per unit, each parameter counted in the first unit that reads it."""
        param_bytes = [0] * self.num_units
        seen: set[str] = set()
        for node in graph.calls:
            for src in node.inputs:
                if graph[src].kind == "param":
                    info = graph.param_of(graph[src].target)
                    if info.names[0] not in seen:
                        seen.add(info.names[0])
                        param_bytes[node.unit] += info.nbytes
        return param_bytes

    def _exchanges(self, graph: Graph) -> list[Exchange]:
        unit_of = {n.name: n.unit for n in graph.calls}
        outputs = set(graph.outputs)
        exchanges = []
        for node in graph.nodes:
            if node.kind not in ("call", "input") or not isinstance(node.meta, TensorMeta):
                continue
            producer = unit_of.get(node.name, -1)
            readers = {
                unit_of[u]
                for u in graph.users(node.name)
                if u in unit_of and unit_of[u] != producer
            }
            if node.name in outputs:
                readers.add(self.num_units)
            if readers:
                meta = node.meta
                exchanges.append(
                    Exchange(
                        producer,
                        tuple(sorted(readers)),
                        meta.nbytes,
                        meta.nbytes if meta.requires_grad else 0,
                    )
                )
        return exchanges

    def _unit_dag(self, graph: Graph) -> nx.DiGraph:
        """Units and the edges no partition may point backwards: data (weighted by the bytes
        moved) and the order of in-place writes."""
        dag = nx.DiGraph()
        dag.add_nodes_from(range(self.num_units))
        for ex in self.exchanges:
            if ex.producer < 0:
                continue
            for reader in ex.readers:
                if reader < self.num_units:
                    weight = dag.get_edge_data(ex.producer, reader, {"bytes": 0})["bytes"]
                    dag.add_edge(ex.producer, reader, bytes=weight + ex.activation + ex.gradient)
        for before, after in order_edges(graph):
            u, v = graph[before].unit, graph[after].unit
            if u != v and not dag.has_edge(u, v):
                dag.add_edge(u, v, bytes=0)
        return dag

    # -- contiguous partitions ----------------------------------------------------------------
    def boundary_bytes(self) -> tuple[list[float], list[float]]:
        """Activation and gradient bytes crossing the cut after unit position ``p``
        (for p in 0 .. N-2) when stages are contiguous in program order."""
        diffs = ([0.0] * (self.num_units + 1), [0.0] * (self.num_units + 1))
        for ex in self.exchanges:
            first = max(ex.producer, 0)
            end = min(ex.last, self.num_units - 1)  # cuts first .. end-1
            if end > first:
                for diff, moved in zip(diffs, (ex.activation, ex.gradient)):
                    diff[first] += moved
                    diff[end] -= moved
        result = []
        for diff in diffs:
            out, running = [], 0.0
            for p in range(self.num_units - 1):
                running += diff[p]
                out.append(running)
            result.append(out)
        return result[0], result[1]

    def state_factor(self) -> float:
        """Bytes of parameters, gradients and optimizer state a rank holds per parameter byte
        (its 1/N share when sharded over ``--dp-shard N``)."""
        return STATE_FACTOR[self.optimizer] / self.dp_shard

    def stage_parameters(self, stage_of_unit: list[int], num_stages: int) -> list[float]:
        """Parameter bytes per stage, unsharded."""
        params = [0.0] * num_stages
        for unit, stage in enumerate(stage_of_unit):
            params[stage] += self.param_bytes[unit]
        return params

    def gathered(self, stage_of_unit: list[int], num_stages: int) -> list[float]:
        """Bytes per stage that FSDP2 holds gathered at once when sharded, each parameter with
        its gradient before the reduce-scatter: under train.py's default ``--gather`` the
        stage's parameters outside blocks and its largest block's, or the whole stage under a
        split-backward schedule (gathered for the step). Nothing when not sharded."""
        if self.dp_shard == 1:
            return [0.0] * num_stages
        params = self.stage_parameters(stage_of_unit, num_stages)
        if self.schedule in SPLIT_BACKWARD:
            return [2 * p for p in params]
        largest, in_blocks = [0.0] * num_stages, [0.0] * num_stages
        for block in self.blocks.values():
            stage = block.stage(stage_of_unit)
            if stage is not None:  # a block cut by a boundary is inline: the stage's own
                size = sum(self.param_bytes[u] for u in block.units)
                in_blocks[stage] += size
                largest[stage] = max(largest[stage], size)
        return [2 * (params[s] - in_blocks[s] + largest[s]) for s in range(num_stages)]

    def lower_bound(self, num_devices: int) -> float:
        return max(sum(self.compute) / num_devices, max(self.compute, default=0.0))

    # -- any assignment -----------------------------------------------------------------------
    def check_monotone(self, stage_of_unit: list[int]) -> None:
        """Every data and write-order edge must go to the same or a later stage."""
        for u, v in self.dag.edges:
            if stage_of_unit[u] > stage_of_unit[v]:
                raise PartitionError(
                    f"unit {self.graph.units[v].label} (stage {stage_of_unit[v]}) depends on unit "
                    f"{self.graph.units[u].label} in the later stage {stage_of_unit[u]}"
                )

    def pipeline_costs(
        self,
        stage_of_unit: list[int],
        device_of_stage: list[int],
        recompute: frozenset[int] = frozenset(),
        recompute_blocks: frozenset[str] = frozenset(),
    ) -> PipelineCosts:
        """Per-stage costs; stages in ``recompute`` keep only their inputs for backward and run
        their forward again there, and so do the blocks in ``recompute_blocks`` (by name) in
        other stages."""
        num_stages = len(device_of_stage)
        forward = [0.0] * num_stages
        backward = [0.0] * num_stages
        activations = [0.0] * num_stages
        for unit, stage in enumerate(stage_of_unit):
            forward[stage] += self.forward[unit]
            backward[stage] += self.backward[unit]
            activations[stage] += self.activations[unit]
        params = self.stage_parameters(stage_of_unit, num_stages)
        gathered = self.gathered(stage_of_unit, num_stages)
        act_cross = [0.0] * max(num_stages - 1, 0)
        grad_cross = [0.0] * max(num_stages - 1, 0)
        for ex in self.exchanges:
            first = stage_of_unit[ex.producer] if ex.producer >= 0 else 0
            last = ex.last
            end = stage_of_unit[last] if last < self.num_units else num_stages - 1
            for s in range(first, end):
                act_cross[s] += ex.activation
                grad_cross[s] += ex.gradient
        for fqn in recompute_blocks:
            block = self.blocks[fqn]
            s = block.stage(stage_of_unit)
            if s is None or s in recompute:
                continue  # cut by a stage boundary, or recomputed with its stage
            backward[s] += sum(self.forward[u] for u in block.units)
            kept = sum(self.activations[u] for u in block.units)
            activations[s] -= max(kept - block.inputs, 0.0)
        for s in recompute:
            backward[s] += forward[s]
            activations[s] = act_cross[s - 1] if s > 0 else 0.0
        bandwidth = self.device.link_bandwidth
        return PipelineCosts(
            forward=forward,
            backward=backward,
            activations=activations,
            static_memory=[p * self.state_factor() + g for p, g in zip(params, gathered)],
            send_forward=[b / bandwidth for b in act_cross],
            send_backward=[b / bandwidth for b in grad_cross],
            device_of_stage=list(device_of_stage),
            memory_capacity=self.device.memory,
        )

    def evaluate(
        self,
        stage_of_unit: list[int],
        device_of_stage: list[int] | None = None,
        schedule: str | None = None,
        recompute: frozenset[int] = frozenset(),
        recompute_blocks: frozenset[str] = frozenset(),
    ) -> Prediction:
        """Stage costs and a simulated step for an assignment of units to stages and devices."""
        num_stages = max(stage_of_unit) + 1
        device_of_stage = (
            device_of_stage if device_of_stage is not None else list(range(num_stages))
        )
        costs = self.pipeline_costs(stage_of_unit, device_of_stage, recompute, recompute_blocks)
        microbatches = self.microbatches or default_microbatches(num_stages)
        schedule = schedule or self.schedule
        simulation = self.simulate(costs, schedule, microbatches)
        params = self.stage_parameters(stage_of_unit, num_stages)
        stages = []
        for s in range(num_stages):
            adjacent = [b for b in (s - 1, s) if 0 <= b < num_stages - 1]
            comm_forward = sum(costs.link(b, costs.send_forward) for b in adjacent)
            comm_backward = sum(costs.link(b, costs.send_backward) for b in adjacent)
            memory = costs.static_memory[s] + costs.activations[s] * _held(s, simulation)
            parameters = int(params[s])
            stages.append(
                StageCost(
                    costs.forward[s],
                    costs.backward[s],
                    comm_forward,
                    comm_backward,
                    memory,
                    parameters,
                )
            )
        return Prediction(
            stages=stages,
            device_of_stage=list(device_of_stage),
            lower_bound=self.lower_bound(max(device_of_stage) + 1),
            step_time=simulation.step_time,
            schedule=schedule,
            device_memory=simulation.peak_memory,
            bubble=simulation.bubble,
        )

    def assuming_recomputation(self) -> CostModel:
        """This model as partitioners see it when every stage may recompute its activations
        (each keeps only its inputs, which its neighbour already counts)."""
        recomputing = copy.copy(self)
        recomputing.activations = [0.0] * self.num_units
        return recomputing

    @staticmethod
    def simulate(costs: PipelineCosts, schedule: str, microbatches: int) -> Simulation:
        return simulate(schedule_orders(schedule, costs, microbatches), costs)


def _held(stage: int, simulation: Simulation) -> int:
    """Most microbatches of ``stage`` alive at once in the simulated step."""
    changes = []
    for _device, action, start, end in simulation.events:
        if action.stage != stage:
            continue
        if action.kind == "F":
            changes.append((start, 1))
        elif action.kind in ("B", "W"):
            changes.append((end, -1))
    live = peak = 0
    for _time, delta in sorted(changes, key=lambda c: (c[0], c[1])):
        live += delta
        peak = max(peak, live)
    return peak
