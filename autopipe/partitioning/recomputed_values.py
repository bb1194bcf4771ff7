"""Values a stage recomputes instead of receiving them (issue 43, item 3).

A value computed from sizes and constants alone (a Llama's rotary tables ``cos`` and ``sin``:
``arange``, the ``inv_freq`` buffer, ``cat``, ``cos``) can be computed again by every stage that
reads it, where sending it costs every boundary between its producer and its last reader a
transfer per microbatch. It is recomputed when the cost model says that is cheaper: the
operators that compute it (each a kernel launch, each writing its output once) take less time
on the device than the transfer takes on the link between two stages (the sender's and the
receiver's share of the step, :meth:`CostModel.stage_costs`). Without a gradient, nothing goes
back either way.

A value qualifies when every operator computing it, walked back, is a deterministic torch
operator that writes nothing in place and reads only constants, other such values and buffers
that are not persistent (what a checkpoint does not hold: each stage holds its own copy, as the
original model has one) and nothing writes into; none reads a model input, a parameter or
random numbers, and no size is dynamic (a stage could not always derive it).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

from ..ir import Graph, Node, TensorMeta
from ..ir.ordering import alias_chain, computes_from_arguments, written_values
from ..ir.types import sizes_in
from ..profiling.devices import DeviceSpec

__all__ = ["closures", "recompute_time", "recomputed_values", "transfer_time"]

#: the most operators a recomputed value's closure may hold (beyond, it is sent)
MAX_OPERATORS = 64


def recomputed_values(
    graph: Graph, device: DeviceSpec, bandwidth: float | None = None
) -> list[str]:
    """The values of ``graph`` read by more than the unit computing them that every stage
    reading them recomputes rather than receives on ``device`` (in program order), its stages
    joined by links of ``bandwidth`` bytes/s (default: the device's link within a node)."""
    bandwidth = device.link_bandwidth if bandwidth is None else bandwidth
    candidates, found = _candidates(graph)
    return [
        node.name
        for node in candidates
        if (nodes := found[node.name]) is not None
        and recompute_time(graph, nodes, device) < transfer_time(node.meta, bandwidth)
    ]


#: each graph's candidates and their closures, while the graph lives (a plan search builds a
#: cost model per candidate; the graph alone decides them)
_CANDIDATES: weakref.WeakKeyDictionary[Graph, tuple[list[Node], dict[str, list[str] | None]]] = (
    weakref.WeakKeyDictionary()
)


def _candidates(graph: Graph) -> tuple[list[Node], dict[str, list[str] | None]]:
    """The values computed from constants that another unit reads (they may cross a
    boundary), and their closures (:func:`closures`), computed once per graph."""
    known = _CANDIDATES.get(graph)
    if known is None:
        derived = _from_constants(graph)
        unit_of = {node.name: node.unit for node in graph.calls}
        candidates = [
            node
            for node in graph.calls
            if node.name in derived
            and isinstance(node.meta, TensorMeta)
            and node.name not in graph.outputs
            # read by another unit: it may cross a boundary
            and any(unit_of.get(user) != node.unit for user in graph.users(node.name))
        ]
        known = candidates, _closures(graph, [node.name for node in candidates], derived)
        _CANDIDATES[graph] = known
    return known


def closures(graph: Graph, names: Iterable[str]) -> dict[str, list[str] | None]:
    """For each of ``names``, the call nodes computing it from constants and unwritten
    non-persistent buffers alone, in program order; None if it reads anything else (see the
    module's docstring) or takes more than :data:`MAX_OPERATORS` operators."""
    return _closures(graph, names, _from_constants(graph))


def _closures(graph: Graph, names: Iterable[str], derived: set[str]) -> dict[str, list[str] | None]:
    """:func:`closures`, given what :func:`_from_constants` found."""
    order = {n: i for i, n in enumerate(graph.dag.nodes)}
    return {name: _closure(graph, name, derived, order) for name in names}


def _closure(graph: Graph, name: str, derived: set[str], order: dict[str, int]) -> list[str] | None:
    if name not in derived:
        return None
    found: set[str] = set()
    stack = [name]
    while stack:
        current = stack.pop()
        if current in found or graph[current].kind != "call":
            continue  # a constant or a buffer: held, not computed
        found.add(current)
        if len(found) > MAX_OPERATORS:
            return None
        stack += graph[current].inputs
    return sorted(found, key=order.__getitem__)


def _from_constants(graph: Graph) -> set[str]:
    """The call nodes whose values are computed from constants and unwritten non-persistent
    buffers alone, by deterministic operators writing nothing, at static sizes."""
    written = _written(graph)
    derived: set[str] = set()
    for node in graph.nodes:  # in program order: a node's arguments come first
        if node.kind in ("constant", "buffer"):
            unwritten = node.name not in written
            if node.kind == "constant" or (_holds_no_state(graph, node) and unwritten):
                derived.add(node.name)
            continue
        if (
            node.kind == "call"
            and node.name not in written
            and computes_from_arguments(node)
            and next(sizes_in((node.args, node.kwargs)), None) is None
            and not _dynamic(node)
            and all(src in derived for src in node.inputs)
        ):
            derived.add(node.name)
    return derived


def recompute_time(graph: Graph, nodes: Iterable[str], device: DeviceSpec) -> float:
    """Seconds ``nodes`` take on ``device``: a kernel launch each, and their outputs written
    (and read again) at the memory bandwidth streaming kernels reach."""
    bandwidth = device.memory_bandwidth * device.memory_efficiency
    total = 0.0
    for name in nodes:
        meta = graph[name].meta
        written_bytes = meta.nbytes if isinstance(meta, TensorMeta) else 0
        total += device.kernel_overhead + 2 * written_bytes / bandwidth
    return total


def transfer_time(meta: TensorMeta, bandwidth: float) -> float:
    """Seconds a transfer of a value costs the step on one boundary: its sender's and its
    receiver's time on a link of ``bandwidth`` bytes/s (the cost model adds it to both
    stages)."""
    return 2 * meta.nbytes / bandwidth


def _holds_no_state(graph: Graph, buffer: Node) -> bool:
    """A buffer no checkpoint holds (not persistent)."""
    return any(
        buffer.target in info.names and not info.persistent for info in graph.buffers.values()
    )


def _written(graph: Graph) -> set[str]:
    """Every value an in-place operator writes, with the values it aliases."""
    written: set[str] = set()
    for node in graph.calls:
        for name in written_values(node):
            written.update(alias_chain(graph, name))
    return written


def _dynamic(node: Node) -> bool:
    metas = node.meta if isinstance(node.meta, tuple) else (node.meta,)
    return any(isinstance(m, TensorMeta) and m.sizes for m in metas)
