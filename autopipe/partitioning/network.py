"""The cluster's network: nodes of ``gpus_per_node`` GPUs, where ranks sit, what traffic costs.

A cluster is nodes of ``--gpus-per-node`` GPUs. The GPUs of a node share its link (NVLink, PCIe:
the device spec's ``link_bandwidth`` and ``link_latency``); each GPU reaches other nodes through
its own NIC (``network_bandwidth``, ``network_latency``), rail to rail, as NCCL drives a DGX/HGX
node. Global rank ``r`` runs on node ``r // gpus_per_node``; which global rank a pipeline rank
and a data-parallel rank take is the device mesh's order (the runtime's
:class:`~autopipe.runtime.core.mesh.RankMesh`, what train.py builds its mesh by).

Costs, per message of ``n`` bytes:

- *point to point* (a stage's activations to the next stage): ``latency + n / bandwidth`` of the
  link between the two ranks (the node's link within a node, the NICs across);
- *ring all-gather / reduce-scatter* over ``k`` ranks (what FSDP2 runs, ``n`` the gathered
  bytes): ``k - 1`` steps, each moving ``n / k`` bytes from every rank to the next, a chunk
  crossing between nodes once per node of the group and within nodes the other steps:
  ``nodes x network latency + (k - 1 - nodes) x node latency + (k - 1) / k x n / bandwidth``;
- *ring all-reduce*: a reduce-scatter then an all-gather, twice that;
- *tree all-reduce* (NCCL's double binary tree between nodes, a chain within each): every rank
  sends and receives about ``n`` each way, ``2 n / bandwidth``, in ``2 x (log2(nodes) +
  ranks per node - 1)`` latencies; an all-reduce costs the faster of ring and tree, as NCCL's
  tuner picks (the tree wins for small messages over many nodes);
- *measured*: a calibrated spec's ``collectives`` (``autopipe calibrate`` on a CPU times gloo's
  collectives between two processes, which reach a fraction of what their sends and receives
  do) cost a group within one node by the bus bandwidth measured at the bytes each rank sends,
  plus the node's latency for each ring step past the two ranks' own.

The bandwidth of a collective whose ranks span nodes is that of the slowest link its ring
crosses: within a node the node's link; between nodes the NICs of the group's ranks in a node
together (NCCL runs one ring per NIC, each leaving the node through its own), ``g x NIC`` for
``g`` of the group's ranks per node (at most the node's NICs, ``nics_per_node``: one per GPU by
default), at most the node's link when ``g > 1``. A group with one rank per node (a shard group
strided across nodes) moves everything over one NIC per rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from ..profiling.devices import COLLECTIVES, DeviceSpec, RateTable
from ..runtime.core.mesh import RankMesh
from ..runtime.core.pipeline import MESH_DIMENSIONS, PIPELINE_INNERMOST

__all__ = [
    "COLLECTIVES",
    "Network",
    "NetworkLink",
    "RingCost",
    "node_layout",
]


@dataclass(frozen=True)
class NetworkLink:
    """One kind of link: bytes/s one direction per GPU, seconds per message, and its name."""

    bandwidth: float
    latency: float
    name: str

    def transfer(self, nbytes: float) -> float:
        """Seconds to send ``nbytes`` in one message over this link."""
        return self.latency + nbytes / self.bandwidth if nbytes > 0 else 0.0


@dataclass(frozen=True)
class RingCost:
    """What a collective over one group of ranks costs per byte and per message: the group's
    size, its bandwidth and latency per step (the slowest link its ring crosses), whether it
    crosses nodes, and the nodes and ranks per node it spans."""

    ranks: int
    bandwidth: float
    latency: float  # a step between nodes (within a node when the group is in one)
    crosses_nodes: bool
    nodes: int
    per_node: int
    node_latency: float  # a step within a node
    link: str = ""  # the slowest link's name
    #: a group within one node: the bus bandwidth its collectives reached between two ranks
    #: (a calibrated spec's ``collectives``, by kind), used instead of the link's ring
    measured: tuple[tuple[str, RateTable], ...] = ()

    def step_latencies(self) -> float:
        """Seconds of latency of one ring collective's ``k - 1`` steps: a chunk crosses
        between nodes once per node it passes (at most ``k - 1`` times), within a node the
        rest of its steps (NCCL's tuning model splits them the same way)."""
        steps = self.ranks - 1
        between = min(self.nodes, steps) if self.crosses_nodes else 0
        return between * self.latency + (steps - between) * self.node_latency

    def time(self, kind: str, nbytes: float, calls: int = 1) -> float:
        """Seconds of ``kind`` collectives (:data:`COLLECTIVES`) of ``nbytes`` in all (the
        whole gathered or reduced tensors) over the group, in ``calls`` collectives of their
        own, each paying its latencies."""
        if kind not in COLLECTIVES:
            raise ValueError(f"unknown collective {kind!r}; known: {', '.join(COLLECTIVES)}")
        if self.ranks <= 1 or nbytes <= 0:
            return 0.0
        k = self.ranks
        measured = dict(self.measured).get(kind)
        if measured is not None and not self.crosses_nodes:
            # each rank sends 2 (k - 1) / k of an all-reduce's bytes, (k - 1) / k of a gather's;
            # the table's two ranks paid one ring step's latency (two in an all-reduce's), the
            # other k - 2 steps pay the node's
            rounds = 2 if kind == "all_reduce" else 1
            sent = rounds * (k - 1) / k * nbytes / calls
            extra = rounds * (k - 2) * self.node_latency
            # a message below the table's smallest takes that one's time (its latencies)
            return calls * (max(sent, measured.points[0][0]) / measured.at(sent) + extra)
        ring = calls * self.step_latencies() + (k - 1) / k * nbytes / self.bandwidth
        if kind != "all_reduce":
            return ring
        tree_steps = math.ceil(math.log2(self.nodes)) if self.nodes > 1 else 0
        tree = (
            2 * calls * (tree_steps * self.latency + (self.per_node - 1) * self.node_latency)
            + 2 * nbytes / self.bandwidth
        )
        return min(2 * ring, tree)


@dataclass(frozen=True)
class Network:
    """A cluster of nodes of ``gpus_per_node`` devices of ``device``, its ranks laid out in the
    mesh order ``mesh`` (outermost first)."""

    device: DeviceSpec
    gpus_per_node: int = 8
    mesh: tuple[str, ...] = PIPELINE_INNERMOST

    def __post_init__(self) -> None:
        if sorted(self.mesh) != sorted(MESH_DIMENSIONS):
            raise ValueError(f"a mesh orders {', '.join(MESH_DIMENSIONS)}, got {self.mesh}")
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be 1 or more, got {self.gpus_per_node}")

    @cached_property
    def node_link(self) -> NetworkLink:
        """The link between two GPUs of one node."""
        spec = self.device
        return NetworkLink(spec.link_bandwidth, spec.link_latency, spec.link or "the link")

    @cached_property
    def nic(self) -> NetworkLink:
        """Each GPU's link to other nodes (the node's link where the spec has no network)."""
        spec = self.device
        if spec.network_bandwidth is None:
            return self.node_link
        latency = spec.link_latency if spec.network_latency is None else spec.network_latency
        return NetworkLink(spec.network_bandwidth, latency, spec.network or "the network")

    # -- where ranks sit ------------------------------------------------------------------------
    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def rank(self, pp_rank: int, dp_rank: int, pp_size: int, dp_size: int) -> int:
        """The global rank of pipeline rank ``pp_rank`` of data-parallel rank ``dp_rank``
        (``dp_size`` of them: replicas x shards, one replica here), ``pp_size`` pipeline
        ranks."""
        return RankMesh(pp_size, 1, dp_size, self.mesh).global_rank(pp_rank, dp_rank)

    def shard_group(self, pp_rank: int, pp_size: int, dp_size: int) -> list[int]:
        """The global ranks pipeline rank ``pp_rank``'s stages are sharded over."""
        return [self.rank(pp_rank, d, pp_size, dp_size) for d in range(dp_size)]

    # -- costs ----------------------------------------------------------------------------------
    def link_between(self, a: int, b: int) -> NetworkLink:
        """The link a message from global rank ``a`` to ``b`` crosses."""
        return self.node_link if self.node_of(a) == self.node_of(b) else self.nic

    def hop(self, pp_from: int, pp_to: int, pp_size: int, dp_size: int) -> NetworkLink:
        """The link between two pipeline ranks of a data-parallel rank: the slowest over the
        data-parallel ranks (each sends its own activations at once)."""
        links = [
            self.link_between(
                self.rank(pp_from, d, pp_size, dp_size), self.rank(pp_to, d, pp_size, dp_size)
            )
            for d in range(dp_size)
        ]
        return min(links, key=lambda link: (link.bandwidth, -link.latency))

    def hop_crosses_nodes(self, pp_from: int, pp_to: int, pp_size: int, dp_size: int) -> bool:
        """Whether any data-parallel rank's message between these pipeline ranks leaves its
        node."""
        return any(
            self.node_of(self.rank(pp_from, d, pp_size, dp_size))
            != self.node_of(self.rank(pp_to, d, pp_size, dp_size))
            for d in range(dp_size)
        )

    def ring(self, ranks: list[int]) -> RingCost:
        """The cost of collectives over the global ``ranks``."""
        nodes: dict[int, int] = {}
        for rank in ranks:
            nodes[self.node_of(rank)] = nodes.get(self.node_of(rank), 0) + 1
        per_node = min(nodes.values(), default=1)
        if len(nodes) <= 1:
            link = self.node_link
            return RingCost(
                len(ranks),
                link.bandwidth,
                link.latency,
                False,
                1,
                per_node,
                link.latency,
                link.name,
                tuple(sorted(self.device.collectives.items())),
            )
        nics = self.device.nics_per_node or per_node  # one per GPU by default
        bandwidth = min(per_node, nics) * self.nic.bandwidth
        if per_node > 1:
            bandwidth = min(bandwidth, self.node_link.bandwidth)
        return RingCost(
            len(ranks),
            bandwidth,
            self.nic.latency,
            True,
            len(nodes),
            per_node,
            self.node_link.latency,
            self.nic.name,
        )

    def collective(self, kind: str, nbytes: float, ranks: list[int]) -> float:
        """Seconds of one ``kind`` collective of ``nbytes`` over the global ``ranks``."""
        return self.ring(ranks).time(kind, nbytes)

    def transfer(self, nbytes: float, a: int, b: int) -> float:
        """Seconds to send ``nbytes`` from global rank ``a`` to ``b`` (nothing to itself)."""
        return 0.0 if a == b else self.link_between(a, b).transfer(nbytes)


def node_layout(processes: int, gpus_per_node: int, tp: int = 1) -> tuple[int, int]:
    """``(nodes, processes per node)`` for ``processes`` on nodes of ``gpus_per_node`` GPUs: the
    fewest nodes that hold them with the same number on each (torchrun starts as many on every
    node), a multiple of ``tp`` (the tensor-parallel ranks of a place, consecutive, share a
    node)."""
    nodes = -(-processes // gpus_per_node)
    while processes % nodes or (processes // nodes) % tp:
        nodes += 1
    return nodes, processes // nodes
