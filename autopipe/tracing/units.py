"""Group graph nodes into units, the pieces a partitioner moves between stages.

As in FTPipe, ``depth`` says how far down the module hierarchy to look (depth 1: the model's
direct children are units; no depth: every module call is one) and ``basic_blocks`` names module
classes kept whole whatever the depth. A unit is a run of consecutive operators (in program order)
with the same grouping key, so units never form cycles and a module called twice gives two units.
"""

from __future__ import annotations

from ..errors import TraceError
from ..ir import Graph, Node, Scope, Unit


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
