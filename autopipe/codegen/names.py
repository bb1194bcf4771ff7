"""Names of values in generated code: for what they are, not trace counters.

Values a stage receives or sends, and the outputs of block calls, are named for where they come
from: ``transformer_h_11_out`` (the output of the block ``transformer.h.11``), ``transformer_expand``
(an ``expand`` in the code of ``transformer`` itself); model inputs and outputs keep their names.
Names depend on the graph alone, so they are stable across regenerations.
"""

from __future__ import annotations

import builtins
import keyword
import re
from collections.abc import Iterable

from ..checks import RESERVED, Namespace
from ..ir import Graph, Node

#: names generated code uses for other things, and Python's builtins (never shadowed)
UNAVAILABLE = RESERVED | set(dir(builtins))


def namespace(taken: Iterable[str] = ()) -> Namespace:
    """Fresh names for generated code, away from ``taken`` and :data:`UNAVAILABLE`."""
    return Namespace(UNAVAILABLE | set(taken))


def identifier(text: str) -> str:
    """``text`` made a Python identifier that is no keyword (``transformer.h.3`` ->
    ``transformer_h_3``)."""
    name = re.sub(r"\W", "_", text) or "_"
    if name[0].isdigit():
        name = f"_{name}"
    return f"{name}_" if keyword.iskeyword(name) else name


def operator_name(node: Node) -> str:
    """``layer_norm`` for the node ``layer_norm_3``: its name without the trace counter."""
    return identifier(re.sub(r"_\d+$", "", node.name))


def value_names(
    graph: Graph, outputs_of_calls: list[tuple[str, list[str]]], boundary: list[str]
) -> dict[str, str]:
    """Graph value -> generated name, for the outputs of submodule calls (``(fqn, outputs)`` in
    program order) and the values crossing stage boundaries. Other values keep their names, so
    the new ones avoid every name of the graph."""
    kept = set(graph.inputs) | set(graph.outputs)
    space = namespace([node.name for node in graph.nodes] + list(graph.model.symbols))
    names: dict[str, str] = {}
    for fqn, outputs in outputs_of_calls:
        base = f"{identifier(fqn)}_out"
        for i, value in enumerate(outputs):
            if value not in kept:
                names[value] = space.claim(base if len(outputs) == 1 else f"{base}_{i}")
    last = _last_nodes(graph)
    for value in boundary:
        if value not in kept and value not in names:
            names[value] = space.claim(_origin(graph, graph[value], last))
    return names


def _last_nodes(graph: Graph) -> dict[str, str]:
    """Module call (scope key) -> the last operator it runs (unpacking ``getitem``\\ s aside)."""
    last: dict[str, str] = {}
    for node in graph.calls:
        if node.target != "getitem":
            for level in node.scope:
                last[level.key] = node.name
    return last


def _origin(graph: Graph, node: Node, last: dict[str, str]) -> str:
    """``fqn_out`` for the output of a module call (the outermost one it ends), ``fqn_op`` for
    another value computed in a module's own code, ``op`` in the model's own code."""
    if node.target == "getitem":
        source, index = node.args
        return f"{_origin(graph, graph[source.name], last)}_{index}"
    for level in node.scope:
        if last.get(level.key) == node.name:
            return f"{identifier(level.fqn)}_out"
    if not node.scope:
        return operator_name(node)
    return f"{identifier(node.scope[-1].fqn)}_{operator_name(node)}"
