"""Blocks: the module calls a generated stage holds as real submodules.

A block is a module with submodules of its own that repeats as a sibling in a ``ModuleList`` /
``Sequential`` (two or more children of one parent named ``0``, ``1``, ... with the same class:
transformer layers, ResNet blocks, not the convolutions of a ``Sequential`` of layers), or one of
the classes given as ``--basic-blocks``. Blocks do not nest: the outermost
one wins. A module called more than once (a shared layer) is no block: as a submodule its forward
would run once per call, not once per stage.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass

from .graph import Graph, Scope


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
    if graph.model.get("inline_blocks"):
        return set()
    basic = set(graph.model.get("basic_blocks", ()))
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
