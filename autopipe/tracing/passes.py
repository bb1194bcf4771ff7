"""Passes over the nodes a trace produces: getitems placed after their sources, dead calls
dropped, and the autograd flags of every value found by replaying the graph."""

from __future__ import annotations

import dataclasses

from ..errors import TraceError
from ..ir.analysis import replay
from ..ir import Graph, Node, TensorMeta
from ..ir.interpreter import resolve_target

__all__ = ["RUNTIME_CHECKS", "drop_dead", "move_getitems_after_sources", "propagate_requires_grad"]

#: Operators that only check a value at run time (emitted for specialised sizes); kept.
RUNTIME_CHECKS = {"aten._assert_async.msg"}


def move_getitems_after_sources(nodes: list[Node]) -> None:
    """Place each ``getitem`` right after its source (and earlier getitems of it), so that an
    operator returning several tensors is never split from its outputs."""
    position = {n.name: i for i, n in enumerate(nodes)}
    getitems = [n for n in nodes if n.target == "getitem"]
    if all(position[n.name] == position[n.args[0].name] + 1 + int(n.args[1]) for n in getitems):
        return
    by_source: dict[str, list[Node]] = {}
    for n in getitems:
        by_source.setdefault(n.args[0].name, []).append(n)
    ordered: list[Node] = []
    for n in nodes:
        if n.target == "getitem":
            continue
        ordered.append(n)
        ordered.extend(by_source.get(n.name, []))
    nodes[:] = ordered


def drop_dead(nodes: list[Node], outputs: set[str]) -> list[Node]:
    """Remove calls whose values nobody reads, unless they mutate something."""
    used = set(outputs)
    keep: list[Node] = []
    for node in reversed(nodes):
        mutates = node.kind == "call" and (
            node.target in RUNTIME_CHECKS or node.target != "getitem" and _is_mutating(node.target)
        )
        if node.kind != "call" or node.name in used or mutates:
            keep.append(node)
            used.update(node.inputs)
    return list(reversed(keep))


def _is_mutating(target: str) -> bool:
    # OpOverload._schema: torch's internal record of an operator's signature
    schema = resolve_target(target)._schema  # type: ignore[attr-defined]
    return schema.is_mutable or any(
        a.alias_info is not None and a.alias_info.is_write for a in schema.arguments
    )


def _replay_failure(node: Node, exc: Exception) -> TraceError:
    return TraceError(
        f"operator {node.target} (node {node.name}, in {node.scope_label or 'forward'}) "
        f"cannot be re-run from the captured graph: {type(exc).__name__}: {exc}"
    )


def propagate_requires_grad(graph: Graph) -> None:
    """Find which values need gradients by running each unit on fake tensors with autograd, in
    program order (a unit's inputs already carry their flags). Doubles as a check that every
    node of the IR can run outside ``torch.export``."""
    for node, produced in replay(graph, _replay_failure):
        if isinstance(node.meta, TensorMeta):
            node.meta = _with_grad(node.meta, getattr(produced, "requires_grad", False))
        elif isinstance(node.meta, tuple):
            node.meta = tuple(
                (
                    _with_grad(m, getattr(p, "requires_grad", False))
                    if isinstance(m, TensorMeta)
                    else m
                )
                for m, p in zip(node.meta, produced)
            )


def _with_grad(meta: TensorMeta, requires_grad: bool) -> TensorMeta:
    return dataclasses.replace(meta, requires_grad=requires_grad)
