"""Queries on a graph that later layers ask: the blocks a generated stage holds as submodules,
and the workload of each unit (what it reads and produces, its structural signature, a replay of
its operators on fake tensors).

Blocks: the module calls a generated stage holds as real submodules. A block is a module with
submodules of its own that repeats as a sibling in a ``ModuleList`` / ``Sequential`` (two or more
children of one parent named ``0``, ``1``, ... with the same class: transformer layers, ResNet
blocks, not the convolutions of a ``Sequential`` of layers), or one of the classes given as
``--basic-blocks``. Blocks do not nest: the outermost one wins. A module called more than once (a
shared layer) is no block: as a submodule its forward would run once per call, not once per stage.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses import FakeTensorMode

from ..errors import ArtifactError
from .graph import Graph
from .types import Node, Scope, TensorMeta, map_refs
from .interpreter import empty_placeholder, run_node

__all__ = [
    "BlockCall",
    "UnitWorkload",
    "block_calls",
    "block_modules",
    "check_replay",
    "replay",
    "signature",
    "unit_workloads",
]


@dataclass(frozen=True)
class BlockCall:
    """One call of a block module: its scope and the call nodes it runs, in program order."""

    scope: Scope
    nodes: tuple[str, ...]

    @property
    def fqn(self) -> str:
        return self.scope.fqn


def block_modules(graph: Graph) -> set[str]:
    """Fully-qualified names of the graph's block modules (none with ``--inline-blocks``)."""
    if graph.model.inline_blocks:
        return set()
    basic = set(graph.model.basic_blocks)
    class_of: dict[str, Scope] = {}
    calls: dict[str, set[str]] = defaultdict(set)
    parents: set[str] = set()  # modules calling submodules
    for node in graph.calls:
        for level in node.scope:
            class_of.setdefault(level.fqn, level)
            calls[level.fqn].add(level.key)
        parents.update(level.fqn for level in node.scope[:-1])
    siblings = Counter(
        (fqn.rpartition(".")[0], scope.cls)
        for fqn, scope in class_of.items()
        if fqn.rpartition(".")[2].isdigit()
    )
    blocks = set()
    for fqn, scope in class_of.items():
        parent, _, leaf = fqn.rpartition(".")
        repeated = leaf.isdigit() and siblings[parent, scope.cls] > 1 and fqn in parents
        named = scope.class_name in basic or scope.cls in basic
        if fqn and (repeated or named) and len(calls[fqn]) == 1:
            blocks.add(fqn)
    return blocks


def block_calls(graph: Graph) -> list[BlockCall]:
    """Every call of a block module (the outermost block of each node), in program order."""
    blocks = block_modules(graph)
    nodes: dict[Scope, list[str]] = {}
    for node in graph.calls:
        level = next((s for s in node.scope if s.fqn in blocks), None)
        if level is not None:
            nodes.setdefault(level, []).append(node.name)
    return [BlockCall(scope, tuple(names)) for scope, names in nodes.items()]


@dataclass
class UnitWorkload:
    """What one unit computes: its operators, in program order, and the values around them."""

    nodes: list[Node]
    inputs: list[str]  # values computed outside the unit (or model inputs)
    state: list[str]  # parameter / buffer / constant placeholders the unit reads
    outputs: list[str]  # values other units (or the model's output) read


def unit_workloads(graph: Graph) -> list[UnitWorkload]:
    """The workload of each unit of ``graph``, in unit order."""
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
    parts: list[tuple[Any, ...]] = []
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
    known: dict[str, list[Any]] = {}
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
