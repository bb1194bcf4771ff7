"""In-place operators: which values they write, and the order they impose on other operators.

``torch.export`` training graphs keep in-place operators (``relu_``, ``add_``, ``copy_``, ...).
Readers of a tensor must stay on the same side of a write to it as in the original program, even
when no data edge says so, and operators that draw random numbers (dropout) keep their program
order, so that each draws what it drew from the generator in the original model; partitioners
that reorder units honour these *order edges*.
"""

from __future__ import annotations

from typing import Protocol, cast

import torch

from ..checks import op_overload
from .graph import Graph
from .interpreter import resolve_target
from .kinds import kind_of
from .types import Node


class _Operator(Protocol):
    """An operator with a schema: a torch ``OpOverload`` or a higher-order kind's operator."""

    _schema: torch._C.FunctionSchema


def alias_chain(graph: Graph, name: str) -> list[str]:
    """``name`` and the values it aliases, following views and in-place operators back to the
    value that owns the storage (the last one)."""
    node = graph[name]
    chain = [node.name]
    while node.kind == "call":
        if node.target == "getitem":
            source = graph[node.args[0].name]
            if source.kind != "call" or not _returns_alias(source.target):
                break
            node = source
        else:
            arg = _aliased_argument(node)
            if arg is None:
                break
            node = graph[arg]
        chain.append(node.name)
    return chain


def alias_base(graph: Graph, name: str) -> str:
    """The value whose storage ``name`` shares, following views and in-place operators."""
    return alias_chain(graph, name)[-1]


def written_values(node: Node) -> list[str]:
    """Names of the values an operator writes in place (as it names them in its arguments)."""
    if node.kind != "call" or node.target == "getitem":
        return []
    schema = _schema(node.target)
    return [
        value.name
        for arg, value in zip(schema.arguments, node.args)
        if arg.alias_info is not None and arg.alias_info.is_write and hasattr(value, "name")
    ]


def order_edges(graph: Graph) -> list[tuple[str, str]]:
    """``(before, after)`` pairs of call nodes: every read of a tensor written in place stays
    on its side of the write, and each operator that draws random numbers after the one before
    it. All pairs point forward in program order."""
    base_of: dict[str, str] = {}

    def base(name: str) -> str:
        if name not in base_of:
            base_of[name] = alias_base(graph, name)
        return base_of[name]

    readers: dict[str, list[str]] = {}
    for node in graph.calls:
        for src in node.inputs:
            readers.setdefault(base(src), []).append(node.name)
    position = {name: i for i, name in enumerate(graph.dag.nodes)}
    edges: set[tuple[str, str]] = set()
    for node in graph.calls:
        for written in written_values(node):
            for reader in readers.get(base(written), []):
                if reader == node.name:
                    continue
                pair = (
                    (reader, node.name)
                    if position[reader] < position[node.name]
                    else (node.name, reader)
                )
                if not graph.dag.has_edge(*pair):
                    edges.add(pair)
    drawn: str | None = None  # the last operator that drew random numbers
    for node in graph.calls:
        if _draws_random_numbers(node):
            if drawn is not None and not graph.dag.has_edge(drawn, node.name):
                edges.add((drawn, node.name))
            drawn = node.name
    return sorted(edges, key=lambda e: (position[e[0]], position[e[1]]))


def computes_from_arguments(node: Node) -> bool:
    """Whether a call's value follows from its arguments alone: a deterministic torch operator
    (or an output of one) that writes nothing in place and returns initialised memory (a
    higher-order kind's call does not count)."""
    if node.target == "getitem":
        return True
    if kind_of(node.target) is not None:
        return False
    op = op_overload(node.target)
    return (
        op is not None
        and torch.Tag.nondeterministic_seeded not in op.tags
        and not op._schema.is_mutable
        and not written_values(node)
        and "empty" not in op._schema.name  # uninitialised memory
    )


def _draws_random_numbers(node: Node) -> bool:
    """Whether an operator call draws from the random number generator (torch tags such
    operators ``nondeterministic_seeded``: dropout, ``rand``, ``bernoulli``, ...)."""
    if node.target == "getitem":
        return False
    tags = getattr(resolve_target(node.target), "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


def _returns_alias(target: str) -> bool:
    schema = _schema(target)
    return bool(schema.returns) and schema.returns[0].alias_info is not None


def _aliased_argument(node: Node) -> str | None:
    schema = _schema(node.target)
    if not schema.returns or schema.returns[0].alias_info is None:
        return None
    sets = schema.returns[0].alias_info.before_set
    for arg, value in zip(schema.arguments, node.args):
        if (
            arg.alias_info is not None
            and arg.alias_info.before_set & sets
            and hasattr(value, "name")
        ):
            name: str = value.name
            return name
    return None


def _schema(target: str) -> torch._C.FunctionSchema:
    """The schema of the operator a call node's ``target`` names."""
    return cast(_Operator, resolve_target(target))._schema
