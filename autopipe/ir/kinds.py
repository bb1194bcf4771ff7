"""The registry of higher-order node kinds: call nodes whose target is no torch operator but a
construct of autopipe's own IR (``torch.cond`` with its branch graphs, a custom autograd
function with its traced forward and backward).

Each kind lives in one module of ``autopipe/ir/`` that registers, by its target, how its nodes
are checked (:attr:`HigherOrderKind.lint`, called by the graph's lint), run (:attr:`~HigherOrderKind.run`,
called by the interpreter) and described to analyses (:attr:`~HigherOrderKind.operator`, whose
``_schema`` says what the node writes and aliases). Code generation keeps its own table of
emitters, by the same targets (``autopipe/codegen/emit.py``). The graph, the interpreter and code
generation look a node's target up here instead of branching on it, so a new kind is one new
module. This module sits below the graph: it imports no module of the IR but :mod:`.types` and
:mod:`.node_graph` (the hooks take the node store the graph extends).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .node_graph import NodeGraph
from .types import Node

__all__ = ["HigherOrderKind", "kind_of", "register", "registered"]

#: checks one node of the kind in its graph: ``lint(graph, node, field)``
LintHook = Callable[[NodeGraph, Node, str], None]
#: runs one node of the kind: ``run(node, env, device, functions)`` -> its value
RunHook = Callable[[Node, Mapping[str, Any], torch.device, Mapping[str, Any] | None], Any]


@dataclass(frozen=True)
class HigherOrderKind:
    """One higher-order node kind: its target and its hooks (see the module docstring)."""

    target: str
    #: what :func:`autopipe.ir.interpreter.resolve_target` gives for the target: an object whose
    #: ``_schema`` (a ``torch._C.FunctionSchema``) says which arguments the node writes/aliases
    operator: Any
    lint: LintHook
    run: RunHook
    #: checks what the kind adds to a whole graph (``Graph.functions``), before its nodes
    lint_graph: Callable[[NodeGraph, str], None] | None = None
    #: reads the definitions the kind keeps beside a graph's nodes (a graph artefact's
    #: ``functions``): ``read_definitions(records, where)`` -> definitions by name
    read_definitions: Callable[[Any, str], dict[str, Any]] | None = None


_KINDS: dict[str, HigherOrderKind] = {}


def register(kind: HigherOrderKind) -> None:
    """Add a kind to the registry (once per target)."""
    if kind.target in _KINDS:
        raise ValueError(f"a node kind with the target {kind.target!r} is registered already")
    _KINDS[kind.target] = kind


def kind_of(target: str) -> HigherOrderKind | None:
    """The higher-order kind of nodes calling ``target``, or None for an operator call."""
    return _KINDS.get(target)


def registered() -> tuple[HigherOrderKind, ...]:
    """Every registered kind, in registration order."""
    return tuple(_KINDS.values())
