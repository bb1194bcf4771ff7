"""The graph IR's node store: a :class:`NodeGraph` is the model's forward pass as a list of nodes
(:mod:`autopipe.ir.types`) in program order, held in a ``networkx.DiGraph`` whose edges are data
dependencies, with the model state the nodes read and the units a partitioner moves, and the
read access every step uses.

It sits below what checks and sizes a graph (:mod:`.lint`, :mod:`.sizes`, the hooks a
higher-order kind registers in :mod:`.kinds`), which take a :class:`NodeGraph`;
:class:`~autopipe.ir.graph.Graph` extends it with what needs those modules: ``lint``, the JSON
artefact and ``rebound``. This module imports no module of the IR but :mod:`.types` and
:mod:`.model`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Self

import networkx as nx

from ..errors import ArtifactError
from .model import ModelFacts
from .types import BufferInfo, Node, ParamInfo, TensorMeta, Unit

__all__ = ["NodeGraph"]


class NodeGraph:
    """Nodes in program order inside a ``networkx.DiGraph``, with the tables they refer to."""

    def __init__(
        self,
        nodes: Iterable[Node],
        *,
        inputs: list[str],
        outputs: list[str],
        signature: list[str],
        params: dict[str, ParamInfo],
        buffers: dict[str, BufferInfo],
        constants: dict[str, Any],
        model: ModelFacts,
        units: list[Unit] | None = None,
        loss: Self | None = None,
        functions: dict[str, Any] | None = None,
    ):
        self.dag = nx.DiGraph()
        for node in nodes:
            if node.name in self.dag:
                raise ArtifactError(f"two nodes are named {node.name!r}")
            self.dag.add_node(node.name, node=node)
        for node in self.nodes:
            for src in node.inputs:
                if src not in self.dag:
                    raise ArtifactError(f"node {node.name!r} reads unknown node {src!r}")
                self.dag.add_edge(src, node.name)
        self.inputs = inputs
        self.outputs = outputs
        self.signature = signature
        self.params = params
        self.buffers = buffers
        self.constants = constants
        self.model = model
        self.units = units or []
        #: the traced user loss function (output leaves and target -> scalar), if one was given
        self.loss = loss
        #: custom autograd functions the graph calls, by name (:class:`autopipe.ir.autograd_function.FunctionDef`)
        self.functions = functions if functions is not None else {}

    @property
    def nodes(self) -> Iterator[Node]:
        for name in self.dag.nodes:
            node: Node = self.dag.nodes[name]["node"]
            yield node

    def __getitem__(self, name: str) -> Node:
        node: Node = self.dag.nodes[name]["node"]
        return node

    def __len__(self) -> int:
        count: int = self.dag.number_of_nodes()
        return count

    @property
    def calls(self) -> list[Node]:
        return [n for n in self.nodes if n.kind == "call"]

    def users(self, name: str) -> list[str]:
        return list(self.dag.successors(name))

    def param_of(self, name: str) -> ParamInfo:
        """The parameter a name (any of its tied aliases) refers to."""
        for info in self.params.values():
            if name in info.names:
                return info
        raise KeyError(name)

    def unit_nodes(self, unit: int) -> list[Node]:
        return [self[n] for n in self.units[unit].nodes]

    def value_bytes(self, name: str) -> int:
        meta = self[name].meta
        return meta.nbytes if isinstance(meta, TensorMeta) else 0

    @property
    def unused_inputs(self) -> list[str]:
        """Model inputs no operator reads (an optional mask the model ignores)."""
        return [
            name
            for name in self.inputs
            if self.dag.out_degree(name) == 0 and name not in self.outputs
        ]
