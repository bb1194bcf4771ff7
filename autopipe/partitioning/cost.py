"""The cost model partitioners optimise and reports quote.

A stage costs its units' forward and backward time, each stretched to the time its transfers take
when those take longer (transfers are asynchronous and overlap compute, as FTPipe charges a stage:
``max(forward, comm_forward) + max(backward, comm_backward)``): activations cross its two
boundaries forward, gradients backward, over the device link; boundaries between two stages on the
same device cost nothing. Values are relayed, so a value produced in stage ``p`` and
read in stage ``c`` crosses every boundary between them. A whole step is simulated under the
schedule (:mod:`.simulator`). Memory per device is walked along its actions in the schedule's
order (``runtime.core.schedules.device_memory``): parameters, gradients and optimizer state of its
stages (1/N of them each when sharded over ``--dp-shard N``, plus the parameters FSDP2 gathers
at once: a stage's own outside its blocks and its largest block's, with their gradients),
receive buffers, the activations and outputs of the microbatches in flight, gradients of
received inputs, and the transient of the action at the peak (forward locals, backward
gradients, the optimizer's temporaries), all from the profile's per-unit bytes. Parameters that
do not require gradients (a frozen base under LoRA adapters, frozen embeddings) count their
weights only: no gradient, no optimizer state, no reduce-scatter, no optimizer step.
"""

from __future__ import annotations

import copy
import dataclasses
import weakref
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import networkx as nx
import numpy as np
import torch

from ..errors import PartitionError
from ..ir import Graph, TensorMeta
from ..ir.ordering import alias_base, order_edges
from ..profiling.devices import DeviceSpec
from ..profiling.precision import AUTOCAST_DTYPE
from ..profiling.profile import Profile
from ..ir.analysis import block_calls, unit_workloads
from ..runtime.core.pipeline import default_microbatches, flops_utilisation
from ..runtime.core.schedules import SPLIT_BACKWARD, MemoryPeak, PipelineCosts
from .partition import PartitionSettings, PredictedStage, PredictedStep, Traffic
from .simulator import Simulation, schedule_memory, simulate_schedule
from .network import Network, NetworkLink, RingCost
from .handed_values import handed_values
from .stage_sums import StageSums
from .recomputed_values import recomputed_values

#: Bytes of state per parameter byte: weight + gradient (+ two Adam moments). A frozen parameter
#: (``requires_grad=False``) holds its weight alone: 1.
STATE_FACTOR = {"sgd": 2, "adamw": 4}
#: Temporaries of torch's (foreach) optimizer step per parameter byte: AdamW builds its update
#: denominator for every parameter at once (measured 0.75 to 1 on CPU), SGD updates in place.
OPTIMIZER_TEMPORARIES = {"sgd": 0.0, "adamw": 1.0}
#: Bytes an optimizer step reads and writes per parameter byte, as train.py's torch optimizers
#: run (foreach on a GPU, tensor by tensor on a CPU: one pass per operator, not one fused pass):
#: AdamW's lerp, mul, addcmul, sqrt, div, add and addcdiv stream 18 (7 fused); SGD without
#: momentum reads the parameter and its gradient and writes the parameter. A calibrated spec's
#: measured step (``DeviceSpec.optimizer_steps``) replaces these.
OPTIMIZER_TRAFFIC = {"sgd": 3, "adamw": 18}
#: the bytes of each all-reduce of a number a step runs (the gradient norm's fp32 sum of
#: squares, the loss's mean; the finite check's two flags are as short)
NORM_BYTES = 4.0


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
    memory_peaks: list[MemoryPeak] = field(default_factory=list)  # what each device's peak holds
    optimizer_time: float = 0.0  # the slowest device's gradients and optimizer step
    data_parallel_time: float = 0.0  # once a step, no compute hiding it: collectives, tied sums
    flops: float = 0.0  # the model's forward + backward FLOPs per microbatch (no recomputation)
    peak_flops: float = 0.0  # one device's peak FLOP/s for the model's parameter dtype
    traffic: list[Traffic] = field(default_factory=list)  # by kind and link, busiest rank

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

    def record(self) -> PredictedStep:
        """The prediction as the partition artefact records it."""
        return PredictedStep(
            bottleneck=self.bottleneck,
            lower_bound=self.lower_bound,
            step_time=self.step_time,
            schedule=self.schedule,
            bubble=self.bubble,
            device_memory=tuple(self.device_memory),
            memory_peaks=tuple(self.memory_peaks),
            optimizer_time=self.optimizer_time,
            data_parallel_time=self.data_parallel_time,
            flops=self.flops,
            peak_flops=self.peak_flops,
            traffic=tuple(self.traffic),
            stages=tuple(
                PredictedStage(**asdict(s), communication=s.communication, time=s.time)
                for s in self.stages
            ),
        )


def iteration_time(predicted: PredictedStep, accumulate: int = 1) -> float:
    """Seconds per optimizer step of a prediction: ``accumulate`` pipeline runs, then the
    collectives and the optimizer step that follow them."""
    return accumulate * predicted.step_time + predicted.once_per_step


@dataclass(frozen=True)
class Throughput:
    """What a partition's plan predicts per optimizer step, over all its devices."""

    step_time: float  # seconds
    microbatches: int  # example microbatches per step, over all data-parallel ranks
    devices: int  # pipeline ranks x data-parallel shards x tensor-parallel ranks
    mfu: float | None  # model FLOPs utilisation: the fraction of the devices' peak FLOP/s

    @classmethod
    def of(cls, predicted: PredictedStep, settings: PartitionSettings, ranks: int) -> Throughput:
        accumulate = 1 if settings.accumulate is None else settings.accumulate
        shards = 1 if settings.dp_shard is None else settings.dp_shard
        step = iteration_time(predicted, accumulate)
        per_run = 1 if settings.microbatches is None else settings.microbatches
        microbatches = per_run * accumulate * shards
        devices = ranks * shards * (settings.tp or 1)
        flops = 0.0 if predicted.flops is None else predicted.flops
        peak = 0.0 if predicted.peak_flops is None else predicted.peak_flops
        return cls(
            step, microbatches, devices, flops_utilisation(flops, peak, step, microbatches, devices)
        )


@dataclass(frozen=True)
class Exchange:
    """A value one unit produces and later units read."""

    producer: int  # unit, or -1 for a model input
    readers: tuple[int, ...]  # units, plus ``num_units`` when it is a model output
    activation: int  # bytes forward
    gradient: int  # bytes backward (0 if it needs no gradient)
    name: str = ""  # the value

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
    """A block (autopipe/ir/analysis.py) a stage may recompute on its own: the units it
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


@dataclass(frozen=True)
class GraphFacts:
    """What a cost model reads of the graph alone, shared by every cost model of one graph
    (a plan search makes one per candidate; a graph is not changed after tracing). Read-only."""

    #: the names of each unit's inputs and outputs, in the order a profile's ``saved_values``
    #: index them
    unit_values: list[list[str]]
    #: the dtype most parameter bytes have: the model's compute dtype, for its peak FLOP/s
    dtype: torch.dtype
    #: the parameters that take no gradient, by first name: weights only
    frozen: frozenset[str]
    #: parameter bytes per unit, each parameter counted in the first unit that reads it, and of
    #: those the bytes of parameters that are trained
    param_bytes: list[int]
    trainable_bytes: list[int]
    #: every unit's own parameters' bytes by first name (a tied parameter is held by every stage
    #: that reads it)
    unit_params: list[dict[str, int]]
    blocks: dict[str, BlockCost]
    #: the units of every call of a block module (whole units or not), in program order
    block_call_units: list[tuple[int, ...]]
    exchanges: list[Exchange]
    #: each exchanged value's storage's owner (itself, or the value it is a view of)
    storage_of: dict[str, str]
    #: units and the edges no partition may point backwards: data (weighted by the bytes moved)
    #: and the order of in-place writes
    dag: nx.DiGraph


#: each graph's facts, while the graph lives
_FACTS: weakref.WeakKeyDictionary[Graph, GraphFacts] = weakref.WeakKeyDictionary()


def graph_facts(graph: Graph) -> GraphFacts:
    """``graph``'s :class:`GraphFacts`, computed once."""
    facts = _FACTS.get(graph)
    if facts is None:
        by_dtype: dict[torch.dtype, int] = {}
        for info in graph.params.values():
            by_dtype[info.dtype] = by_dtype.get(info.dtype, 0) + info.nbytes
        unit_params, param_bytes, trainable_bytes = _parameter_bytes(graph)
        exchanges = _exchanges(graph)
        facts = GraphFacts(
            unit_values=[w.inputs + w.outputs for w in unit_workloads(graph)],
            dtype=max(by_dtype, key=by_dtype.__getitem__) if by_dtype else torch.float32,
            frozen=frozenset(
                info.names[0] for info in graph.params.values() if not info.requires_grad
            ),
            param_bytes=param_bytes,
            trainable_bytes=trainable_bytes,
            unit_params=unit_params,
            blocks=block_costs(graph),
            block_call_units=[
                tuple(sorted({graph[name].unit for name in call.nodes}))
                for call in block_calls(graph)
            ],
            exchanges=exchanges,
            storage_of={e.name: alias_base(graph, e.name) for e in exchanges},
            dag=_unit_dag(graph, exchanges),
        )
        _FACTS[graph] = facts
    return facts


def _parameter_bytes(graph: Graph) -> tuple[list[dict[str, int]], list[int], list[int]]:
    """Each unit's own parameters (bytes by first name), and parameter bytes per unit with, of
    those, the trainable parameters' (that require gradients), each parameter counted in the
    first unit that reads it."""
    num_units = len(graph.units)
    param_bytes, trainable_bytes = [0] * num_units, [0] * num_units
    unit_params: list[dict[str, int]] = [{} for _ in range(num_units)]
    seen: set[str] = set()
    for node in graph.calls:
        for src in node.inputs:
            if graph[src].kind == "param":
                info = graph.param_of(graph[src].target)
                unit_params[node.unit][info.names[0]] = info.nbytes
                if info.names[0] not in seen:
                    seen.add(info.names[0])
                    param_bytes[node.unit] += info.nbytes
                    if info.requires_grad:
                        trainable_bytes[node.unit] += info.nbytes
    return unit_params, param_bytes, trainable_bytes


def _first_reads(unit_params: list[dict[str, int]]) -> list[dict[str, int]]:
    """Per unit, the parameters it is the first unit to read (bytes by name)."""
    seen: set[str] = set()
    firsts: list[dict[str, int]] = []
    for held in unit_params:
        firsts.append({n: b for n, b in held.items() if n not in seen})
        seen.update(held)
    return firsts


def _first_readers(
    unit_params: list[dict[str, int]], frozen: frozenset[str]
) -> tuple[list[int], list[int]]:
    """Parameter bytes per unit, each parameter counted in the first unit that reads it, and
    of those the trainable parameters' (see :func:`_parameter_bytes`)."""
    firsts = _first_reads(unit_params)
    param_bytes = [sum(first.values()) for first in firsts]
    trainable_bytes = [sum(b for n, b in first.items() if n not in frozen) for first in firsts]
    return param_bytes, trainable_bytes


def _divided(exchange: Exchange, degree: int) -> Exchange:
    """``exchange`` as each of ``degree`` tensor-parallel ranks holding ``1/degree`` of it
    passes it."""
    if degree == 1:
        return exchange
    return dataclasses.replace(
        exchange,
        activation=exchange.activation // degree,
        gradient=exchange.gradient // degree,
    )


def _exchanges(graph: Graph) -> list[Exchange]:
    """The values units pass to later units (or out of the model). A model input is none:
    each stage reading it reads it from the batch (autopipe/codegen/plan.py), unless the model
    returns it."""
    num_units = len(graph.units)
    unit_of = {n.name: n.unit for n in graph.calls}
    outputs = set(graph.outputs)
    exchanges = []
    for node in graph.nodes:
        if node.kind not in ("call", "input") or not isinstance(node.meta, TensorMeta):
            continue
        if node.kind == "input" and node.name not in outputs:
            continue
        producer = unit_of.get(node.name, -1)
        readers = {
            unit_of[u] for u in graph.users(node.name) if u in unit_of and unit_of[u] != producer
        }
        if node.name in outputs:
            readers.add(num_units)
        if readers:
            meta = node.meta
            exchanges.append(
                Exchange(
                    producer,
                    tuple(sorted(readers)),
                    meta.nbytes,
                    meta.nbytes if meta.requires_grad else 0,
                    node.name,
                )
            )
    return exchanges


def _unit_dag(graph: Graph, exchanges: list[Exchange]) -> nx.DiGraph:
    """Units and the edges no partition may point backwards: data (weighted by the bytes
    moved) and the order of in-place writes."""
    num_units = len(graph.units)
    dag = nx.DiGraph()
    dag.add_nodes_from(range(num_units))
    for ex in exchanges:
        if ex.producer < 0:
            continue
        for reader in ex.readers:
            if reader < num_units:
                weight = dag.get_edge_data(ex.producer, reader, {"bytes": 0})["bytes"]
                dag.add_edge(ex.producer, reader, bytes=weight + ex.activation + ex.gradient)
    for before, after in order_edges(graph):
        u, v = graph[before].unit, graph[after].unit
        if u != v and not dag.has_edge(u, v):
            dag.add_edge(u, v, bytes=0)
    return dag


def unit_passes(profile: Profile, fsdp: bool = False) -> tuple[list[float], list[float]]:
    """Each unit's forward and backward seconds as a stage runs them: with ``fsdp`` (FSDP2
    manages the stage: the plan's ``--dp-shard`` > 1, or any data parallelism of train.py), a
    bf16 profile's forwards without autocast's casts of the parameters (FSDP2 gathers them in
    bf16, cast shard by shard as it copies them in: on its own stream on a GPU). The backwards
    keep the casts of the gradients to fp32, which FSDP2 makes on the stage's stream."""
    units = profile.units
    forward = [u.forward for u in units]
    if profile.bf16 and fsdp:
        forward = [max(f - u.cast_time, 0.0) for f, u in zip(forward, units)]
    return forward, [u.backward for u in units]


def _held_scale(graph: Graph, name: str, dtypes: dict[str, torch.dtype]) -> float:
    """The bytes of value ``name`` as autocast makes it (``dtypes``) per traced byte."""
    dtype = dtypes.get(name)
    meta = graph[name].tensor_meta if dtype is not None else None
    return dtype.itemsize / meta.dtype.itemsize if dtype and meta else 1.0


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
        network: Network | None = None,
        pipeline_ranks: int | None = None,
    ):
        profile.check_graph(graph)
        self.graph = graph
        self.device: DeviceSpec = profile.device
        #: the cluster: nodes, their links, and the mesh order that places ranks on them
        self.network = network if network is not None else Network(self.device)
        #: the pipeline ranks the partitioners plan for (None: not known, one node's link)
        self.pipeline_ranks = pipeline_ranks
        self.schedule = schedule
        self.microbatches = microbatches
        self.optimizer = optimizer
        self.dp_shard = dp_shard
        #: the link partitioners cost a boundary on before stages have ranks: the slowest link
        #: between two neighbouring pipeline ranks
        self.pipeline_link = self._slowest_hop()
        self.link_bandwidth = self.pipeline_link.bandwidth
        self.forward, self.backward = unit_passes(profile, dp_shard > 1)
        self.activations: list[float] = [u.activations for u in profile.units]
        self.temporaries = [u.temporaries for u in profile.units]
        self.backward_memory = [u.backward_memory for u in profile.units]
        facts = graph_facts(graph)
        #: bytes FSDP2 gathers per byte of parameters it stores: their bf16 copies under
        #: --bf16 (its mixed-precision policy), else the parameters themselves
        self.gather_scale = 1.0
        if profile.bf16:
            self.gather_scale = min(1.0, AUTOCAST_DTYPE.itemsize / facts.dtype.itemsize)
            if dp_shard > 1:  # FSDP2 gathers bf16 parameters: autocast copies none of them
                self.activations = [
                    max(a - u.cast_parameters, 0.0) for a, u in zip(self.activations, profile.units)
                ]
        #: the values each unit saves among its inputs and outputs, by name
        self.saved_values = [
            {names[i] for i in unit.saved_values if i < len(names)}
            for unit, names in zip(profile.units, facts.unit_values)
        ]
        self.flops = sum(u.flops_forward + u.flops_backward for u in profile.units)
        self.dtype = facts.dtype
        #: the dtype products compute in: bf16 under --bf16, else the parameters'
        self.compute_dtype = AUTOCAST_DTYPE if profile.bf16 else facts.dtype
        self.num_units = len(graph.units)
        self.frozen = facts.frozen
        self.param_bytes, self.trainable_bytes = facts.param_bytes, facts.trainable_bytes
        self.unit_params = facts.unit_params
        #: the tensor-parallel degree (1: none)
        self.tp = max(profile.divided.values(), default=1)
        if profile.divided:  # tensor parallelism: each rank's part of the sharded parameters
            self.unit_params = [
                {name: nbytes // profile.divided.get(name, 1) for name, nbytes in held.items()}
                for held in facts.unit_params
            ]
            self.param_bytes, self.trainable_bytes = _first_readers(self.unit_params, self.frozen)
        #: seconds each unit's backward adds the gradients of the trained parameters it reads
        #: first into the step's (``grad += new``, every microbatch): not in a profile's
        #: backward (it takes them from autograd.grad; a traced one's has them taken off)
        self.accumulation = [
            sum(self.accumulation_time(b) for n, b in first.items() if n not in self.frozen)
            for first in _first_reads(self.unit_params)
        ]
        self.backward = [b + a for b, a in zip(self.backward, self.accumulation)]
        self.compute = [f + b for f, b in zip(self.forward, self.backward)]
        #: parameters, gradients and optimizer state per unit, this rank's share when sharded
        self.unit_state = [
            self.state_bytes(p, t) for p, t in zip(self.param_bytes, self.trainable_bytes)
        ]
        self.blocks = facts.blocks
        self.block_call_units = facts.block_call_units
        #: values each stage reading them recomputes instead of receiving (cheaper on this
        #: device than sending them): they cross no boundary
        self.recomputed_values = recomputed_values(graph, self.device, self.link_bandwidth)
        recomputed = set(self.recomputed_values)
        self.exchanges = [
            _divided(e, profile.divided.get(e.name, 1))
            for e in facts.exchanges
            if e.name not in recomputed
        ]
        #: each block's parameter bytes and those of its trained parameters (its gradients')
        block_bytes = {
            block.fqn: (
                float(sum(self.param_bytes[u] for u in block.units)),
                float(sum(self.trainable_bytes[u] for u in block.units)),
            )
            for block in self.blocks.values()
        }
        #: each block's bytes FSDP2 gathers and its gradient bytes
        self.block_state = {
            fqn: params * self.gather_scale + trained
            for fqn, (params, trained) in block_bytes.items()
        }
        #: each exchanged value's bytes as a stage holds it: under --bf16, a product's output
        #: in bf16 (a stage sends its copy in the traced dtype, the activation bytes)
        self.held_bytes = [
            e.activation * _held_scale(graph, e.name, profile.autocast_dtypes)
            for e in self.exchanges
        ]
        #: whether autocast makes it in another dtype than the traced one (then the tensor a
        #: stage sends or receives is not the one its units save)
        self.recast = [e.name in profile.autocast_dtypes for e in self.exchanges]
        savers = [
            [
                unit
                for unit in (e.producer, *e.readers)
                if 0 <= unit < self.num_units and e.name in self.saved_values[unit]
            ]
            for e in self.exchanges
        ]
        #: the values handed between units that none of them keeps: locals of the generated
        #: code, alive until the forward naming them returns (a block's, or the stage's); none
        #: where the profile records nothing saved (what is kept cannot be told)
        self.handed = (
            handed_values(
                [
                    (e.name, e.producer, e.readers, held)
                    for e, held in zip(self.exchanges, self.held_bytes)
                ],
                savers,
                facts.storage_of,
                [block.units for block in self.blocks.values()],
                self.num_units,
            )
            if any(self.saved_values)
            else []
        )
        #: of those, the bytes each block makes and reads alone (its own locals), by name
        self.block_locals = {fqn: 0.0 for fqn in self.blocks}
        fqns = list(self.blocks)
        for value in self.handed:
            if value.block >= 0:
                self.block_locals[fqns[value.block]] += value.nbytes
        self.sums = StageSums(
            num_units=self.num_units,
            forward=self.forward,
            backward=self.backward,
            activations=self.activations,
            temporaries=self.temporaries,
            backward_memory=self.backward_memory,
            trainable_bytes=self.trainable_bytes,
            dp_shard=dp_shard,
            gather_scale=self.gather_scale,
            unit_params=self.unit_params,
            frozen=self.frozen,
            step_time=self.parameter_step_time,
            norm_time=self.norm_time,
            accumulation_time=self.accumulation_time,
            exchanges=[(e.producer, e.last, e.activation, e.gradient) for e in self.exchanges],
            savers=savers,
            handed=self.handed,
            held=list(zip(self.held_bytes, self.recast)),
            blocks=[block.units for block in self.blocks.values()],
            block_gathers=(
                list(block_bytes.values())
                if dp_shard > 1 and schedule not in SPLIT_BACKWARD
                else None
            ),
        )
        self.dag = facts.dag
        #: stages -> the best contiguous stage_of_unit (dp.solve_contiguous fills it)
        self.contiguous_optimum: dict[int, list[int]] = {}
        #: whether it counts every stage as recomputing its activations (no activations kept)
        self.recomputes_all = False
        #: whether partitioners may recompute activations to balance the stages, judged by the
        #: step; else a split must fit without, and recomputation is only the last resort
        self.recomputes_to_balance = True

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

    @property
    def training_state_bytes(self) -> float:
        """The whole model's parameters, gradients and optimizer state, unsharded (the
        gradients and optimizer state of its trainable parameters only)."""
        trainable = sum(self.trainable_bytes)
        frozen = sum(self.param_bytes) - trainable
        return float(trainable * STATE_FACTOR[self.optimizer] + frozen)

    def state_factors(self) -> tuple[float, float]:
        """Bytes of parameters, gradients and optimizer state a rank holds per byte of a
        trainable parameter, and per byte of a frozen one (its weight alone): its 1/N share
        when sharded over ``--dp-shard N``."""
        return STATE_FACTOR[self.optimizer] / self.dp_shard, 1 / self.dp_shard

    def state_bytes(self, params: float, trainable: float) -> float:
        """Bytes of parameters, gradients and optimizer state a rank holds of ``params``
        parameter bytes of which ``trainable`` require gradients (see :meth:`state_factors`)."""
        trained, frozen = self.state_factors()
        return trainable * trained + (params - trainable) * frozen

    def stage_parameters(
        self, stage_of_unit: list[int], num_stages: int, trainable: bool = False
    ) -> list[float]:
        """Parameter bytes per stage, unsharded (a tied parameter in each stage reading it);
        ``trainable``: of the parameters that require gradients only."""
        params, trained = self.sums.parameters(self.sums.assignment(stage_of_unit), num_stages)
        held: list[float] = (trained if trainable else params).tolist()
        return held

    def gathered(
        self, stage_of_unit: list[int], params: list[float], trainable: list[float]
    ) -> list[float]:
        """Bytes per stage that FSDP2 holds gathered at once when sharded, each parameter with
        its gradient (trainable ones) before the reduce-scatter: under train.py's default
        ``--gather`` the stage's parameters outside blocks and its largest block's, or the whole
        stage under a split-backward schedule (gathered for the step). Nothing when not sharded.
        ``params``, ``trainable``: each stage's parameter bytes, and those of its trainable
        parameters (``stage_parameters``)."""
        blocks = self.sums.block_stages(self.sums.assignment(stage_of_unit))
        return self._gathered(blocks, params, trainable)

    def _gathered(
        self, block_stages: np.ndarray, params: list[float], trainable: list[float]
    ) -> list[float]:
        """:meth:`gathered` with the stage of each block (:meth:`StageSums.block_stages`)."""
        num_stages = len(params)
        if self.dp_shard == 1:
            return [0.0] * num_stages
        gathered = self.gathered_bytes(params)
        if self.schedule in SPLIT_BACKWARD:
            return [g + t for g, t in zip(gathered, trainable)]
        largest, in_blocks = [0.0] * num_stages, [0.0] * num_stages
        for block, stage in zip(self.blocks.values(), block_stages.tolist()):
            if stage >= 0:  # a block cut by a boundary is inline: the stage's own
                size = self.block_state[block.fqn]
                in_blocks[stage] += size
                largest[stage] = max(largest[stage], size)
        return [gathered[s] + trainable[s] - in_blocks[s] + largest[s] for s in range(num_stages)]

    def gathered_bytes(self, params: list[float]) -> list[float]:
        """The bytes FSDP2 gathers of parameters of ``params`` bytes (per stage): half under
        --bf16 for fp32 parameters."""
        return [p * self.gather_scale for p in params]

    # -- the network ----------------------------------------------------------------------------
    def _slowest_hop(self) -> NetworkLink:
        """The slowest link between two neighbouring pipeline ranks (the last and the first
        too: looped placements wrap), or the node's link when the ranks are not known."""
        ranks = self.pipeline_ranks
        if ranks is None or ranks == 1:
            return self.network.node_link
        return min(
            (self.network.hop(p, (p + 1) % ranks, ranks, self.dp_shard) for p in range(ranks)),
            key=lambda link: (link.bandwidth, -link.latency),
        )

    def _pipeline_size(self, device_of_stage: list[int]) -> int:
        """The pipeline ranks ranks are placed for: the partition's (even where a split
        leaves a rank without a stage), else those the stages use."""
        return max(self.pipeline_ranks or 0, max(device_of_stage) + 1)

    def hop_crosses_nodes(self, pp_size: int, a: int, b: int) -> bool:
        """Whether messages between pipeline ranks ``a`` and ``b`` leave a node (cached)."""
        known: dict[tuple[int, int, int], bool] = self.__dict__.setdefault("_crossing_hops", {})
        key = (pp_size, a, b)
        if key not in known:
            known[key] = self.network.hop_crosses_nodes(a, b, pp_size, self.dp_shard)
        return known[key]

    def hop(self, pp_size: int, a: int, b: int) -> NetworkLink:
        """The link between pipeline ranks ``a`` and ``b`` of ``pp_size`` (cached)."""
        known: dict[tuple[int, int, int], NetworkLink] = self.__dict__.setdefault("_hops", {})
        key = (pp_size, a, b)
        if key not in known:
            known[key] = self.network.hop(a, b, pp_size, self.dp_shard)
        return known[key]

    def shard_rings(self, pp_size: int) -> list[RingCost]:
        """The cost of FSDP2's collectives over each pipeline rank's shard group (cached)."""
        known = self.__dict__.setdefault("_rings", {})
        if pp_size not in known:
            known[pp_size] = [
                self.network.ring(self.network.shard_group(p, pp_size, self.dp_shard))
                for p in range(pp_size)
            ]
        rings: list[RingCost] = known[pp_size]
        return rings

    def send_times(self, crossing: list[float], device_of_stage: list[int]) -> list[float]:
        """Seconds to send ``crossing[b]`` bytes over each boundary ``b`` (stage b to b + 1):
        the link between the two stages' ranks, nothing on one rank."""
        links = self.boundary_links(tuple(device_of_stage))
        return [
            0.0 if link is None else link.transfer(moved) for link, moved in zip(links, crossing)
        ]

    def boundary_links(self, device_of_stage: tuple[int, ...]) -> list[NetworkLink | None]:
        """The link over each boundary of a placement, None where both stages share a rank
        (cached: the partitioners evaluate one placement many times)."""
        known: dict[tuple[int, ...], list[NetworkLink | None]]
        known = self.__dict__.setdefault("_links_by_placement", {})
        links = known.get(device_of_stage)
        if links is None:
            ranks = self._pipeline_size(list(device_of_stage))
            links = [
                self.hop(ranks, a, b) if a != b else None
                for a, b in zip(device_of_stage, device_of_stage[1:])
            ]
            known[device_of_stage] = links
        return links

    def tie_rings(
        self, stage_of_unit: list[int], device_of_stage: list[int]
    ) -> list[tuple[float, list[int], RingCost]]:
        """The trained parameters that stages on several pipeline ranks hold (GPT-2's tied
        embedding and head), each summed once per step: the bytes each rank's sum moves (its
        shard when sharded), the pipeline ranks holding it, and the ring over their ranks."""
        ranks = self._pipeline_size(device_of_stage)
        ties = []
        for nbytes, copies in self._tied_copies(stage_of_unit, device_of_stage):
            if len(copies) > 1:
                held = sorted(copies)
                group = [self.network.rank(p, 0, ranks, self.dp_shard) for p in held]
                ties.append((nbytes / self.dp_shard, held, self.network.ring(group)))
        return ties

    def _tied_copies(
        self, stage_of_unit: list[int], device_of_stage: list[int]
    ) -> list[tuple[int, dict[int, int]]]:
        """Each trained parameter's bytes and the copies of it each pipeline rank holds (one
        per stage holding it)."""
        stages: dict[str, set[int]] = {}
        sizes: dict[str, int] = {}
        for unit, owned in enumerate(self.unit_params):
            for name, nbytes in owned.items():
                if name not in self.frozen:
                    stages.setdefault(name, set()).add(stage_of_unit[unit])
                    sizes[name] = nbytes
        found = []
        for name, held in stages.items():
            copies: dict[int, int] = {}
            for stage in held:
                copies[device_of_stage[stage]] = copies.get(device_of_stage[stage], 0) + 1
            found.append((sizes[name], copies))
        return found

    def scalar_reduce_time(self, device_of_stage: list[int]) -> float:
        """Seconds of the all-reduces of a number or two every step runs after its pipeline
        runs, one after another, each as slow as its slowest group: the gradient norm's squares
        over the tensor-parallel group (a node holds whole groups), the pipeline ranks and the
        shard group; the loss's mean over the last stage's shard group; the finite check over
        every rank. Their latencies, over the links each group crosses."""
        ranks, last = self._pipeline_size(device_of_stage), device_of_stage[-1]
        known: dict[tuple[int, int], float] = self.__dict__.setdefault("_scalar_reduces", {})
        if (ranks, last) in known:
            return known[ranks, last]
        network, shards = self.network, self.dp_shard
        rings: list[list[RingCost]] = []  # each all-reduce's groups, in the order they run
        if self.tp > 1:
            rings.append([network.ring(list(range(self.tp)))])
        pipelines = [
            [network.rank(p, d, ranks, shards) for p in range(ranks)] for d in range(shards)
        ]
        shard_rings = self.shard_rings(ranks)  # the norm's, then the loss's on the last stage
        rings += [
            [network.ring(group) for group in pipelines],
            shard_rings,
            [shard_rings[last]],
            [network.ring(sum(pipelines, []))],
        ]
        seconds = sum(max(ring.time("all_reduce", NORM_BYTES) for ring in each) for each in rings)
        known[ranks, last] = seconds
        return seconds

    def tied_local_times(self, stage_of_unit: list[int], device_of_stage: list[int]) -> list[float]:
        """Seconds each pipeline rank spends summing the copies of a tied parameter it holds
        more than one of (a V-shaped schedule's first and last stages): train.py stacks them,
        sums the stack (by the roofline, as :meth:`norm_time` sums: the ``sum`` table is of
        reductions to few elements) and copies the sum back into each (a rank's one copy is
        all-reduced where it lies, :meth:`tie_times`)."""
        times = [0.0] * self._pipeline_size(device_of_stage)
        for nbytes, copies in self._tied_copies(stage_of_unit, device_of_stage):
            share = nbytes / self.dp_shard
            elements = share / self.dtype.itemsize
            for rank, count in copies.items():
                if count > 1 and share > 0:
                    times[rank] += (
                        self.device.operator_seconds(
                            "stack", self.dtype, count * elements, 2 * count * share
                        )
                        + self.device.operator_seconds(
                            None, self.dtype, elements, (count + 1) * share
                        )
                        + count
                        * self.device.operator_seconds(None, self.dtype, elements, 2 * share)
                    )
        return times

    @staticmethod
    def tie_times(ties: list[tuple[float, list[int], RingCost]], ranks: int) -> list[float]:
        """Seconds each of ``ranks`` pipeline ranks spends summing the tied parameters'
        gradients it holds (``tie_rings``): an all-reduce of each over its holders."""
        times = [0.0] * ranks
        for nbytes, holders, ring in ties:
            seconds = ring.time("all_reduce", nbytes)
            for p in holders:
                times[p] += seconds
        return times

    def collective_time(
        self,
        params: list[float],
        device_of_stage: list[int],
        kind: str = "all_gather",
        calls: list[int] | None = None,
    ) -> list[float]:
        """Seconds per stage of FSDP2 gathering its parameters once (``kind`` all_gather) or
        reduce-scattering its gradients once (reduce_scatter: pass the trainable parameters'
        bytes) over its ``dp_shard`` ranks, ring over the links the group crosses
        (:mod:`.network`), in ``calls[s]`` collectives (one per FSDP2 unit: each block and the
        rest; default 1) each paying the ring's latencies."""
        if self.dp_shard == 1:
            return [0.0] * len(params)
        rings = self.shard_rings(self._pipeline_size(device_of_stage))
        times = []
        for s, nbytes in enumerate(params):
            ring = rings[device_of_stage[s]]
            times.append(ring.time(kind, nbytes, 1 if calls is None else max(calls[s], 1)))
        return times

    def optimizer_step_time(self, nbytes: float) -> float:
        """Seconds of the optimizer step over a trained parameter of ``nbytes``, this rank's
        share of it (``1/dp_shard``): at the rate the spec's calibrated step reaches on tensors
        of that size, else its traffic (:data:`OPTIMIZER_TRAFFIC`) at the memory rate."""
        share = nbytes / self.dp_shard
        table = self.device.optimizer_steps.get(self.optimizer)
        if table is not None:  # a tensor below the table's smallest costs that one's launches
            return max(share, table.points[0][0]) / table.at(share) if share > 0 else 0.0
        speed = self.device.memory_bandwidth * self.device.memory_efficiency
        return share * OPTIMIZER_TRAFFIC[self.optimizer] / speed

    def scale_time(self, nbytes: float) -> float:
        """Seconds train.py spends scaling a trained parameter's gradient of ``nbytes`` (this
        rank's share, ``1/dp_shard``) to the mean over the step's microbatches, after the step's
        last backward: one ``mul_`` (timed by the spec's ``mul`` table, the kernel an in-place
        ``mul_`` runs), every copy of a tied parameter. A run's ``--clip-grad-norm``, which no
        plan knows, scales each gradient once more."""
        share = nbytes / self.dp_shard
        if share <= 0:
            return 0.0
        return self.device.operator_seconds(
            "mul", self.dtype, share / self.dtype.itemsize, 2 * share
        )

    def norm_time(self, nbytes: float) -> float:
        """Seconds train.py spends adding a trained parameter's gradient of ``nbytes`` (this
        rank's share) into the global norm, a tied parameter's first copy alone: the gradient
        in fp32 (a cast of a lower-precision one), squared (``pow``) and summed (``sum``: a
        reduction, which no table keyed by the elements it writes times), a launch each."""
        share = nbytes / self.dp_shard
        if share <= 0:
            return 0.0
        elements = share / self.dtype.itemsize
        single = elements * torch.float32.itemsize
        cast = (
            self.device.operator_seconds("_to_copy", self.dtype, elements, share + single)
            if self.dtype.itemsize < torch.float32.itemsize
            else 0.0
        )
        return (
            cast
            + self.device.operator_seconds("pow", torch.float32, elements, 2 * single)
            + self.device.operator_seconds(None, torch.float32, 1.0, single)
        )

    def parameter_step_time(self, nbytes: float) -> float:
        """Seconds a step spends once on every copy of a trained parameter of ``nbytes`` after
        its pipeline runs: its gradient scaled (:meth:`scale_time`) and its optimizer step
        (:meth:`optimizer_step_time`); its norm (:meth:`norm_time`) is once per parameter."""
        return self.scale_time(nbytes) + self.optimizer_step_time(nbytes)

    def accumulation_time(self, nbytes: float) -> float:
        """Seconds a backward spends adding a trained parameter's gradient of ``nbytes`` into
        the one the step accumulates (autograd's ``grad += new``: two bytes read and one
        written per byte). A step's first backward takes its gradient as it is: charged too,
        one addition per step more than run. Where FSDP2 shards the stage and reduces every
        microbatch's gradients, it adds the reduced shards on its own stream: nothing here
        (under a split-backward schedule it reduces once a step, and autograd accumulates the
        whole gradients until then)."""
        if nbytes <= 0 or (self.dp_shard > 1 and self.schedule not in SPLIT_BACKWARD):
            return 0.0
        elements = nbytes / self.dtype.itemsize
        return self.device.operator_seconds("add_", self.dtype, elements, 3 * nbytes)

    def optimizer_time(self, stage_of_unit: list[int], device_of_stage: list[int]) -> float:
        """The slowest device's step after its pipeline runs: its stages' trained parameters,
        each as :meth:`parameter_step_time` costs it (its gradient scaled, then the optimizer's
        step), and each one's norm (:meth:`norm_time`) in the first stage holding it."""
        steps = self.sums.optimizer_steps(self.sums.assignment(stage_of_unit), len(device_of_stage))
        times = [0.0] * (max(device_of_stage) + 1)
        for seconds, device in zip(steps.tolist(), device_of_stage):
            times[device] += seconds
        return max(times)

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
        sums = self.sums
        stages = sums.assignment(stage_of_unit)
        forward = sums.per_stage(sums.forward, stages, num_stages).tolist()
        # a tied parameter's copy in a later stage adds its gradients too
        backward = (
            sums.per_stage(sums.backward, stages, num_stages)
            + sums.tied_accumulations(stages, num_stages)
        ).tolist()
        saved = (
            sums.per_stage(sums.activations, stages, num_stages)
            - sums.counted_twice(stages, num_stages)
        ).tolist()
        param_array, trainable_array = sums.parameters(stages, num_stages)
        params, trainable = param_array.tolist(), trainable_array.tolist()
        block_stages = sums.block_stages(stages)
        gathered = self._gathered(block_stages, params, trainable)
        act_array, grad_array = sums.crossing(stages, num_stages)
        act_cross, grad_cross = act_array.tolist(), grad_array.tolist()
        outputs = [*act_cross, sums.model_outputs]
        inputs = [0.0, *act_cross]
        forward_array, backward_array = sums.transients(
            stages, num_stages, block_stages, (param_array, trainable_array)
        )
        transient_forward, transient_backward = forward_array.tolist(), backward_array.tolist()
        alone = []  # blocks recomputed on their own, each with its stage
        for fqn in recompute_blocks:
            block = self.blocks[fqn]
            s = block.stage(stage_of_unit)
            if s is not None and s not in recompute:  # not cut by a boundary, nor in its stage's
                alone.append((block, s))
        if alone:  # they save their inputs alone: what the stage saves after a block is less
            lighter = sums.with_activations(self._inputs_only(block for block, _ in alone))
            forward_array = lighter.transients(
                stages, num_stages, block_stages, (param_array, trainable_array)
            )[0]
            transient_forward = forward_array.tolist()
        for block, s in alone:
            backward[s] += sum(self.forward[u] for u in block.units)
            kept = sum(self.activations[u] for u in block.units)
            saved[s] -= max(kept - block.inputs, 0.0)
            again = sum(self.activations[u] + self.temporaries[u] for u in block.units)
            again += self.block_locals[block.fqn]
            transient_backward[s] = max(transient_backward[s], again)  # its forward, rerun
        for s in recompute:
            backward[s] += forward[s]
            transient_backward[s] += saved[s] + transient_forward[s]
            saved[s] = inputs[s]
        microbatches = self.microbatches or default_microbatches(num_stages)
        shard = 1 / self.dp_shard
        if self.dp_shard > 1 and self.schedule not in SPLIT_BACKWARD:
            # FSDP2 gathers a stage's parameters for each forward and backward and
            # reduce-scatters its (trainable parameters') gradients after it, prefetching while
            # the stage computes
            calls = self._fsdp_units(block_stages, num_stages)
            gather = self.collective_time(
                self.gathered_bytes(params), device_of_stage, "all_gather", calls
            )
            reduce = self.collective_time(trainable, device_of_stage, "reduce_scatter", calls)
            for s in range(num_stages):
                forward[s] = max(forward[s], gather[s])
                backward[s] = max(backward[s], gather[s] + reduce[s])
        waits = self._receive_waits(act_cross, grad_cross, device_of_stage)
        return PipelineCosts(
            forward=forward,
            backward=backward,
            activations=[a + o for a, o in zip(saved, outputs)],
            static_memory=[
                self.state_bytes(p, t) + g for p, t, g in zip(params, trainable, gathered)
            ],
            send_forward=self.send_times(act_cross, device_of_stage),
            send_backward=self.send_times(grad_cross, device_of_stage),
            device_of_stage=list(device_of_stage),
            memory_capacity=self.device.memory,
            gradients=[t * shard for t in trainable],
            buffers=[microbatches * (i + g) for i, g in zip(inputs, [*grad_cross, 0.0])],
            input_gradients=[0.0, *grad_cross],  # freed as the simulated schedule frees them
            transient_forward=transient_forward,
            transient_backward=transient_backward,
            transient_optimizer=[
                t * shard * OPTIMIZER_TEMPORARIES[self.optimizer] for t in trainable
            ],
            receive_forward=waits[0],
            receive_backward=waits[1],
        )

    def _inputs_only(self, blocks: Iterable[BlockCost]) -> list[float]:
        """Each unit's saved bytes where ``blocks`` save their inputs alone (on their first
        unit), recomputing the rest in their backward."""
        activations = list(self.activations)
        for block in blocks:
            kept = sum(self.activations[u] for u in block.units)
            for u in block.units:
                activations[u] = 0.0
            activations[block.units[0]] = min(block.inputs, kept)
        return activations

    def _receive_waits(
        self, act_cross: list[float], grad_cross: list[float], device_of_stage: list[int]
    ) -> tuple[list[float], list[float]]:
        """The spec's ``receive_overhead`` for each stage whose forward receives tensors from
        another rank, and for each whose backward receives gradients: a receive posted when the
        action needs it waits for the transfer's handshake on that rank, however early the
        tensors were sent. Once per action: torch posts an action's receives as one batch,
        whose handshakes wait together (T5's four tensors into its last stage cost one wait,
        measured). Empty where the spec has none."""
        overhead = self.device.receive_overhead
        if not overhead:
            return [], []
        num_stages = len(device_of_stage)
        forward, backward = [0.0] * num_stages, [0.0] * num_stages
        for b, link in enumerate(self.boundary_links(tuple(device_of_stage))):
            if link is not None:
                forward[b + 1] = overhead if act_cross[b] > 0 else 0.0
                backward[b] = overhead if grad_cross[b] > 0 else 0.0
        return forward, backward

    @staticmethod
    def _fsdp_units(block_stages: np.ndarray, num_stages: int) -> list[int]:
        """FSDP2 units per stage: each whole block in it, and the rest of the stage."""
        whole = block_stages[block_stages >= 0]
        units: list[int] = (np.bincount(whole, minlength=num_stages)[:num_stages] + 1).tolist()
        return units

    def _crossing(
        self, stage_of_unit: list[int], num_stages: int
    ) -> tuple[list[float], list[float], list[float]]:
        """Activation and gradient bytes crossing each boundary between stages, and the bytes
        each stage outputs (to later stages or as the model's outputs) and keeps until its
        backward."""
        act, grad = self.sums.crossing(self.sums.assignment(stage_of_unit), num_stages)
        act_cross = act.tolist()
        return act_cross, grad.tolist(), [*act_cross, self.sums.model_outputs]

    def _counted_twice(self, stage_of_unit: list[int], num_stages: int) -> list[float]:
        """Bytes per stage that the units' saved activations count more than once: a value
        its producer and its readers in one stage all save (one tensor), or that a stage
        saves and also holds as an output (until its backward) or a receive buffer."""
        twice: list[float] = self.sums.counted_twice(
            self.sums.assignment(stage_of_unit), num_stages
        ).tolist()
        return twice

    def _transients(
        self, stage_of_unit: list[int], num_stages: int
    ) -> tuple[list[float], list[float]]:
        """The most a stage's forward holds beyond its microbatch's activations (the
        generated code's locals: the stage's own until it returns, a block's while it runs,
        when the activations after it are not saved yet), and the most a backward holds beyond
        them and the stage's gradients (:meth:`StageSums.transients`)."""
        forward, backward = self.sums.transients(self.sums.assignment(stage_of_unit), num_stages)
        return forward.tolist(), backward.tolist()

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
        schedule = schedule or self.schedule
        costs, microbatches, simulation = self._simulated(
            stage_of_unit, device_of_stage, schedule, recompute, recompute_blocks
        )
        param_array, trainable_array = self.sums.parameters(
            self.sums.assignment(stage_of_unit), num_stages
        )
        params, trainable = param_array.tolist(), trainable_array.tolist()
        held = simulation.held
        stages = []
        for s in range(num_stages):
            adjacent = [b for b in (s - 1, s) if 0 <= b < num_stages - 1]
            comm_forward = sum(costs.link(b, costs.send_forward) for b in adjacent)
            comm_backward = sum(costs.link(b, costs.send_backward) for b in adjacent)
            memory = (
                costs.static_memory[s]
                + costs.buffers[s]
                + costs.activations[s] * held[s]
                + max(costs.transient_forward[s], costs.transient_backward[s])
            )
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
        peaks = simulation.memory_peaks
        once = 0.0  # under split-backward schedules FSDP2 gathers and reduces once per step
        calls = self._fsdp_units(
            self.sums.block_stages(self.sums.assignment(stage_of_unit)), num_stages
        )
        if self.dp_shard > 1 and schedule in SPLIT_BACKWARD:
            per_device = [0.0] * (max(device_of_stage) + 1)
            gather = self.collective_time(
                self.gathered_bytes(params), device_of_stage, "all_gather", calls
            )
            reduce = self.collective_time(trainable, device_of_stage, "reduce_scatter", calls)
            for s in range(num_stages):
                per_device[device_of_stage[s]] += gather[s] + reduce[s]
            once = max(per_device)
        ties = self.tie_rings(stage_of_unit, device_of_stage)
        tied = zip(
            self.tie_times(ties, self._pipeline_size(device_of_stage)),
            self.tied_local_times(stage_of_unit, device_of_stage),
        )
        once += max((summed + local for summed, local in tied), default=0.0)
        once += self.scalar_reduce_time(device_of_stage)
        traffic = self._traffic(
            stage_of_unit, device_of_stage, schedule, microbatches, params, trainable, calls, ties
        )
        return Prediction(
            stages=stages,
            device_of_stage=list(device_of_stage),
            lower_bound=self.lower_bound(max(device_of_stage) + 1),
            step_time=simulation.step_time,
            schedule=schedule,
            device_memory=[peak.total for peak in peaks],
            bubble=simulation.bubble,
            memory_peaks=peaks,
            optimizer_time=self.optimizer_time(stage_of_unit, device_of_stage),
            data_parallel_time=once,
            flops=self.flops,
            peak_flops=self.device.utilisation_peak(self.compute_dtype),
            traffic=traffic,
        )

    def _traffic(
        self,
        stage_of_unit: list[int],
        device_of_stage: list[int],
        schedule: str,
        microbatches: int,
        params: list[float],
        trainable: list[float],
        calls: list[int],
        ties: list[tuple[float, list[int], RingCost]],
    ) -> list[Traffic]:
        """A pipeline run's traffic by kind and link, on the rank that moves the most of each:
        activations and gradients between stages on other ranks, FSDP2's gathers and
        reductions (per microbatch, or once under a split-backward schedule), and the sums of
        tied parameters' gradients (once per step)."""
        ranks = self._pipeline_size(device_of_stage)
        num_stages = len(device_of_stage)
        # (kind, link, crosses nodes) -> per rank [bytes, seconds]
        found: dict[tuple[str, str, bool], list[list[float]]] = {}

        def add(key: tuple[str, str, bool], rank: int, moved: float, seconds: float) -> None:
            per_rank = found.setdefault(key, [[0.0, 0.0] for _ in range(ranks)])
            per_rank[rank][0] += moved
            per_rank[rank][1] += seconds

        act, grad, _ = self._crossing(stage_of_unit, num_stages)
        for b in range(num_stages - 1):
            a, c = device_of_stage[b], device_of_stage[b + 1]
            if a == c:
                continue
            link = self.hop(ranks, a, c)
            crosses = self.hop_crosses_nodes(ranks, a, c)
            moved = (act[b] + grad[b]) * microbatches
            seconds = (link.transfer(act[b]) + link.transfer(grad[b])) * microbatches
            for rank in (a, c):
                add(("pipeline", link.name, crosses), rank, moved, seconds)
        for nbytes, holders, ring in ties:  # tie_rings: summed once per step
            seconds = ring.time("all_reduce", nbytes)
            moved = 2 * (ring.ranks - 1) / ring.ranks * nbytes
            for p in holders:
                add(("tied", ring.link, ring.crosses_nodes), p, moved, seconds)
        if self.dp_shard > 1:
            rings = self.shard_rings(ranks)
            share = (self.dp_shard - 1) / self.dp_shard
            once = schedule in SPLIT_BACKWARD
            gathered = self.gathered_bytes(params)
            for s in range(num_stages):
                ring = rings[device_of_stage[s]]
                times = 1 if once else microbatches
                gathers = 1 if once else 2  # each forward and each backward gathers
                moved = share * (gathers * gathered[s] + trainable[s]) * times
                seconds = (
                    gathers * ring.time("all_gather", gathered[s], calls[s])
                    + ring.time("reduce_scatter", trainable[s], calls[s])
                ) * times
                add(("fsdp2", ring.link, ring.crosses_nodes), device_of_stage[s], moved, seconds)
        return [
            Traffic(kind, link, crosses, *max(per_rank, key=lambda totals: totals[0]))
            for (kind, link, crosses), per_rank in sorted(found.items())
        ]

    def step_and_memory(
        self, stage_of_unit: list[int], device_of_stage: list[int], schedule: str | None = None
    ) -> tuple[float, list[float]]:
        """The simulated step time and each device's peak bytes of an assignment, equal to
        :meth:`evaluate`'s, without the rest of its prediction (what a partitioner comparing
        many splits reads)."""
        _, _, simulation = self._simulated(stage_of_unit, device_of_stage, schedule)
        return simulation.step_time, simulation.peak_memory

    def _simulated(
        self,
        stage_of_unit: list[int],
        device_of_stage: list[int],
        schedule: str | None,
        recompute: frozenset[int] = frozenset(),
        recompute_blocks: frozenset[str] = frozenset(),
    ) -> tuple[PipelineCosts, int, Simulation]:
        """An assignment's pipeline costs, microbatches and simulated step under ``schedule``
        (None: the model's)."""
        costs = self.pipeline_costs(stage_of_unit, device_of_stage, recompute, recompute_blocks)
        microbatches = self.microbatches or default_microbatches(max(stage_of_unit) + 1)
        return costs, microbatches, self.simulate(costs, schedule or self.schedule, microbatches)

    def device_memory(
        self,
        stage_of_unit: list[int],
        device_of_stage: list[int],
        schedule: str | None = None,
        recompute: frozenset[int] = frozenset(),
        recompute_blocks: frozenset[str] = frozenset(),
    ) -> list[float]:
        """Each device's peak bytes of an assignment, equal to :meth:`evaluate`'s, without
        simulating the step's times (what the recomputation planner bisects on)."""
        num_stages = max(stage_of_unit) + 1
        costs = self.pipeline_costs(stage_of_unit, device_of_stage, recompute, recompute_blocks)
        microbatches = self.microbatches or default_microbatches(num_stages)
        peaks = schedule_memory(schedule or self.schedule, costs, microbatches)
        return [peak.total for peak in peaks]

    def assuming_recomputation(self) -> CostModel:
        """This model as partitioners see it when every stage may recompute its activations
        (each keeps only its inputs, which its neighbour already counts)."""
        recomputing = copy.copy(self)
        recomputing.activations = [0.0] * self.num_units
        recomputing.sums = self.sums.with_activations(recomputing.activations)
        recomputing.recomputes_all = True
        return recomputing

    def without_balancing_recomputation(self) -> CostModel:
        """This model for partitioners that must fit without recomputing (the comparison the
        summary draws)."""
        plain = copy.copy(self)
        plain.recomputes_to_balance = False
        plain.contiguous_optimum = {}
        return plain

    @staticmethod
    def simulate(costs: PipelineCosts, schedule: str, microbatches: int) -> Simulation:
        return simulate_schedule(schedule, costs, microbatches)
