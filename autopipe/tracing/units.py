"""Group graph nodes into units, the pieces a partitioner moves between stages.

As in FTPipe, ``depth`` says how far down the module hierarchy to look (depth 1: the model's
direct children are units; no depth: every module call is one) and ``basic_blocks`` names module
classes kept whole whatever the depth. A unit is a run of consecutive operators (in program order)
with the same grouping key, so units never form cycles and a module called twice gives two units.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses import FakeTensorMode

from ..errors import ArtifactError, TraceError
from ..ir.graph import Graph, Node, Scope, TensorMeta, Unit, map_refs
from ..ir.interpreter import empty_placeholder, run_node


def group_key(
    scope: tuple[Scope, ...], depth: int | None, basic_blocks: frozenset[str]
) -> tuple[str, ...]:
    """The scope prefix a node is grouped by."""
    key: list[str] = []
    for level in scope:
        if depth is not None and len(key) >= depth:
            break
        key.append(level.key)
        if level.class_name in basic_blocks or level.cls in basic_blocks:
            break
    return tuple(key)


def group_units(
    graph: Graph, *, depth: int | None = None, basic_blocks: tuple[str, ...] = ()
) -> list[Unit]:
    """Assign every call node of ``graph`` to a unit (sets ``node.unit``) and return the units."""
    if depth is not None and depth < 0:
        raise TraceError(f"--depth must be 0 or more, got {depth}")
    blocks = frozenset(basic_blocks)
    _check_basic_blocks(graph, blocks)
    units: list[Unit] = []
    previous: tuple[str, ...] | None = None
    for node in graph.calls:
        if node.target == "getitem":  # stays with the operator whose output it unpacks
            key = previous
        else:
            key = group_key(node.scope, depth, blocks)
        if key != previous or not units:
            units.append(Unit(len(units), _label(node, len(key or ())), []))
            previous = key
        units[-1].nodes.append(node.name)
        node.unit = units[-1].index
    return units


def _label(node: Node, levels: int) -> str:
    if levels == 0:
        return type_label(node)
    scope = node.scope[levels - 1]
    return f"{scope.fqn} ({scope.class_name})"


def type_label(node: Node) -> str:
    return f"<{node.target.split('.')[1] if '.' in node.target else node.target}>"


def _check_basic_blocks(graph: Graph, blocks: frozenset[str]) -> None:
    if not blocks:
        return
    present = {level.class_name for node in graph.calls for level in node.scope}
    present |= {level.cls for node in graph.calls for level in node.scope}
    missing = sorted(b for b in blocks if b not in present)
    if missing:
        short = sorted({c.rsplit(".", 1)[-1] for c in present})
        raise TraceError(
            f"basic block class(es) {', '.join(missing)} match no module of the model; "
            f"module classes in the model: {', '.join(short)}"
        )


@dataclass
class UnitWorkload:
    nodes: list[Node]
    inputs: list[str]  # values computed outside the unit (or model inputs)
    state: list[str]  # parameter / buffer / constant placeholders the unit reads
    outputs: list[str]  # values other units (or the model's output) read


def unit_workloads(graph: Graph) -> list[UnitWorkload]:
    unit_of = {n.name: n.unit for n in graph.calls}
    model_outputs = set(graph.outputs)
    workloads = []
    for unit in graph.units:
        nodes = graph.unit_nodes(unit.index)
        inputs: dict[str, None] = {}
        state: dict[str, None] = {}
        for node in nodes:
            for src in node.inputs:
                kind = graph[src].kind
                if kind in ("param", "buffer", "constant"):
                    state[src] = None
                elif unit_of.get(src) != unit.index:
                    inputs[src] = None
        outputs = [
            n.name
            for n in nodes
            if isinstance(n.meta, TensorMeta)
            and (
                n.name in model_outputs
                or any(unit_of.get(u) != unit.index for u in graph.users(n.name))
            )
        ]
        workloads.append(UnitWorkload(nodes, list(inputs), list(state), outputs))
    return workloads


def signature(graph: Graph, work: UnitWorkload) -> str:
    """A key equal for units that compute the same thing on the same shapes (the 48 blocks of
    GPT2-XL, say), whatever their names: operators, arguments with values renumbered locally,
    tensor metadata, grad / autocast modes, and which values leave the unit."""
    local: dict[str, str] = {}
    parts: list = []
    for prefix, names in (("i", work.inputs), ("s", work.state)):
        for i, name in enumerate(names):
            local[name] = f"{prefix}{i}"
            node = graph[name]
            flag = graph.param_of(node.target).requires_grad if node.kind == "param" else None
            parts.append((node.kind, node.meta, flag))
    for j, node in enumerate(work.nodes):
        local[node.name] = f"n{j}"
        rename = lambda ref: local[ref.name]  # noqa: E731
        parts.append(
            (
                node.target,
                map_refs(node.args, rename),
                map_refs(node.kwargs, rename),
                node.meta,
                node.context,
            )
        )
    parts.append(tuple(local[name] for name in work.outputs))
    return repr(parts)


def replay(
    graph: Graph, failure: Callable[[Node, Exception], Exception]
) -> Iterator[tuple[Node, Any]]:
    """Run every unit on fake tensors with autograd, in program order, and yield each operator
    with the metadata of what it produces (a :class:`TensorMeta`, a tuple of them or None).
    Structurally identical units (the layers of a transformer) run once. A unit's inputs carry
    the autograd flags recorded when it starts, so a caller may update them as it goes. A node
    that cannot run raises ``failure(node, exception)``."""
    device = torch.device("cpu")
    known: dict[str, list] = {}
    for work in unit_workloads(graph):
        key = signature(graph, work)
        if key not in known:
            placeholders = [graph[name] for name in work.inputs + work.state]
            env: dict[str, Any] = {}
            with FakeTensorMode(allow_non_fake_inputs=True), _fake_tensor_log_quiet():
                for position, node in enumerate(placeholders + work.nodes):
                    try:
                        env[node.name] = (
                            run_node(node, env, device, graph.functions)
                            if position >= len(placeholders)
                            else _placeholder(graph, node, node.name in work.inputs, device)
                        )
                    except Exception as exc:
                        raise failure(node, exc) from exc
                known[key] = [_produced(env[node.name]) for node in work.nodes]
        yield from zip(work.nodes, known[key])


@contextlib.contextmanager
def _fake_tensor_log_quiet() -> Iterator[None]:
    """Silence the traceback FakeTensorMode logs for an operator that fails: the caller reports
    the failure itself."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    disabled, log.disabled = log.disabled, True
    try:
        yield
    finally:
        log.disabled = disabled


def _placeholder(graph: Graph, node: Node, received: bool, device: torch.device) -> torch.Tensor:
    """An empty tensor for a value a unit reads; a received one is no leaf, so that in-place
    operators on it stay legal."""
    value = empty_placeholder(graph, node, device)
    return value.clone() if received and value.requires_grad else value


def _produced(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return TensorMeta.of(value)
    if isinstance(value, (list, tuple)):
        return tuple(_produced(v) if isinstance(v, torch.Tensor) else None for v in value)
    return None


def check_replay(graph: Graph) -> None:
    """Check that every operator of a graph read from an artefact runs on the values it reads
    and produces the shape, dtype and autograd flag the graph records: an edited artefact must
    not become a pipeline that fails, or trains wrongly, later. Raises :class:`ArtifactError`."""

    def failure(node: Node, exc: Exception) -> ArtifactError:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return ArtifactError(
            f"node {node.name} ({node.target or node.kind}) cannot run on the values the graph "
            f"records: {type(exc).__name__}: {message}"
        )

    for node, produced in replay(graph, failure):
        if _summary(node.meta) != _summary(produced):
            raise ArtifactError(
                f"node {node.name} ({node.target}) produces {_summary(produced)}, but the graph "
                f"records {_summary(node.meta)}"
            )


def _summary(meta: Any) -> Any:
    """Shape, dtype and autograd flag of value metadata (strides may differ between runs)."""
    if isinstance(meta, TensorMeta):
        return (list(meta.shape), str(meta.dtype).removeprefix("torch."), meta.requires_grad)
    if isinstance(meta, tuple):
        return tuple(_summary(m) for m in meta)
    return None
