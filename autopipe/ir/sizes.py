"""Dynamic sizes in the graph IR: the sizes a graph is planned for, and the same graph at other
sizes of its dynamic dimensions.

With dynamic dimensions (``--dynamic``), metadata and :class:`~autopipe.ir.types.Size` arguments
hold the sizes at the planned size of each dimension, beside the formula of the dimensions'
names that generated code writes.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ..runtime.core.shapes import evaluate
from .node_graph import NodeGraph
from .types import SYMBOLIC_SIZE, Node, Size, TensorMeta, map_sizes

__all__ = ["planned_sizes", "rebound_nodes", "same_layout", "symbolic_sizes"]


@contextlib.contextmanager
def symbolic_sizes(reader: Callable[[Any], int]) -> Iterator[None]:
    """Within this block, :meth:`TensorMeta.of` reads symbolic sizes with ``reader``."""
    token = SYMBOLIC_SIZE.set(reader)
    try:
        yield
    finally:
        SYMBOLIC_SIZE.reset(token)


def planned_sizes(graph: NodeGraph) -> dict[str, int]:
    """The size of each dynamic dimension that the graph's metadata and sizes are for: its
    upper bound, or the example's size when it has none."""
    return graph.model.planned_sizes()


def same_layout(meta: TensorMeta, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Strides for ``shape`` that order dimensions in memory as ``meta``'s do (broadcast
    dimensions keep stride 0)."""
    order = sorted(range(len(shape)), key=lambda d: (meta.stride[d], meta.shape[d]))
    strides, step = [0] * len(shape), 1
    for d in order:
        if meta.stride[d] != 0:
            strides[d] = step
            step *= shape[d]
    return tuple(strides)


def rebound_nodes(nodes: Iterable[Node], values: dict[str, int]) -> list[Node]:
    """Copies of ``nodes`` whose metadata and sizes are for the dynamic dimensions' sizes
    ``values``; strides keep each value's memory layout."""

    def meta(m: Any) -> Any:
        if isinstance(m, tuple):
            return tuple(meta(item) for item in m)
        if not isinstance(m, TensorMeta) or not m.sizes:
            return m
        shape = tuple(evaluate(f, values) for f in m.formulas)
        return dataclasses.replace(m, shape=shape, stride=same_layout(m, shape))

    def args(value: Any) -> Any:
        return map_sizes(value, lambda s: Size(evaluate(s.formula, values), s.formula))

    return [
        dataclasses.replace(n, meta=meta(n.meta), args=args(n.args), kwargs=args(n.kwargs))
        for n in nodes
    ]
