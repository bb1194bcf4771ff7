"""The graph IR shared by every step of the compiler: its types (:mod:`.types`), container
(:mod:`.graph`, over the node store of :mod:`.node_graph`), JSON codec (:mod:`.codec`),
invariants (:mod:`.lint`), model facts (:mod:`.model`), dynamic sizes (:mod:`.sizes`),
interpreter and in-place ordering, and the higher-order node kinds (:mod:`.kinds`: ``torch.cond``
in :mod:`.cond`, custom autograd functions in :mod:`.autograd_function`, torch modules kept whole
in :mod:`.kept_module`), which register themselves when the package is imported.

Layers, lowest first: types; codec, model; node_graph; eval_mode, sizes, kinds; lint; graph;
interpreter; the kinds' modules; analysis, batch_dims and ordering. A module imports only modules
below it: what checks and sizes a graph takes the node store, which the graph extends.
"""

from __future__ import annotations

from . import (
    autograd_function,
    cond,
    kept_module,
)  # noqa: F401 - register the higher-order node kinds
from .graph import GRAPH_KIND, Graph
from .kinds import HigherOrderKind
from .model import DynamicSymbol, ModelFacts
from .types import (
    COND,
    FUNCTION_TARGET,
    MODULE_TARGET,
    NODE_KINDS,
    PLACEHOLDER_KINDS,
    BufferInfo,
    Node,
    ParamInfo,
    Ref,
    Scope,
    Size,
    TensorMeta,
    Unit,
)

__all__ = [
    "BufferInfo",
    "COND",
    "DynamicSymbol",
    "FUNCTION_TARGET",
    "GRAPH_KIND",
    "MODULE_TARGET",
    "Graph",
    "HigherOrderKind",
    "ModelFacts",
    "NODE_KINDS",
    "Node",
    "PLACEHOLDER_KINDS",
    "ParamInfo",
    "Ref",
    "Scope",
    "Size",
    "TensorMeta",
    "Unit",
]
