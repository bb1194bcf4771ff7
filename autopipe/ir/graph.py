"""The graph IR's container: a :class:`Graph` is the model's forward pass as a list of nodes
(:mod:`autopipe.ir.types`) in program order, held in a ``networkx.DiGraph`` whose edges are data
dependencies, with the model state the nodes read and the units a partitioner moves. The node
store and its read access live one layer down, in :class:`~autopipe.ir.node_graph.NodeGraph`,
which the modules the graph uses (:mod:`.lint`, :mod:`.sizes`, :mod:`.kinds`) take; this module
adds what needs them.

The graph round-trips through JSON (``autopipe.ir.graph`` artefact, values through
:mod:`autopipe.ir.codec`), checked by :mod:`autopipe.ir.lint` when read, so every later step can
start from the file ``autopipe trace`` wrote.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from ..artifacts import artifact_text, atomic_write_text, check_replaceable, read_artifact
from ..checks import is_int, require
from ..errors import ArtifactError
from .codec import ValueCodec, decode, decode_meta, encode, encode_meta, register_value_codec
from .kinds import HigherOrderKind, kind_of
from .lint import lint_graph
from .model import ModelFacts
from .node_graph import NodeGraph
from .sizes import planned_sizes, rebound_nodes
from .types import (
    FUNCTION_TARGET,
    BufferInfo,
    Node,
    ParamInfo,
    Scope,
    Unit,
    dtype_from_name,
    dtype_name,
    json_list,
)

__all__ = ["GRAPH_KIND", "Graph"]

GRAPH_KIND = "graph"


class Graph(NodeGraph):
    """The traced model: nodes in program order inside a ``networkx.DiGraph``
    (:class:`~autopipe.ir.node_graph.NodeGraph`), checked, saved and read as an artefact."""

    #: the artefact's text, once computed (:meth:`json_text`)
    _json_text: str | None = None

    # -- invariants ---------------------------------------------------------------------------
    def lint(self, where: str = "") -> None:
        """Check the invariants the later steps rely on (:mod:`autopipe.ir.lint`), in one pass,
        as ``torch.fx``'s ``Graph.lint`` does; raise :class:`ArtifactError` naming the first
        field that breaks one."""
        lint_graph(self, where)

    # -- JSON ---------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        scopes: dict[tuple[Scope, ...], int] = {}
        nodes = []
        for node in self.nodes:
            record: dict[str, Any] = {"name": node.name, "kind": node.kind}
            if node.target:
                record["target"] = node.target
            if node.args:
                record["args"] = encode(list(node.args))
            if node.kwargs:
                record["kwargs"] = {k: encode(v) for k, v in node.kwargs.items()}
            if node.meta is not None:
                record["meta"] = encode_meta(node.meta)
            if node.scope:
                record["scope"] = scopes.setdefault(node.scope, len(scopes))
            if node.context:
                record["context"] = encode(list(node.context))
            if node.eval_args:
                record["eval_args"] = {k: encode(v) for k, v in node.eval_args.items()}
            if node.kind == "call":
                record["unit"] = node.unit
            nodes.append(record)
        return {
            "model": self.model.to_json(),
            "signature": self.signature,
            "inputs": self.inputs,
            "outputs": self.outputs,
            "params": [
                {
                    "names": list(p.names),
                    "shape": list(p.shape),
                    "dtype": dtype_name(p.dtype),
                    "requires_grad": p.requires_grad,
                    "owner": p.owner,
                }
                for p in self.params.values()
            ],
            "buffers": [
                {
                    "names": list(b.names),
                    "shape": list(b.shape),
                    "dtype": dtype_name(b.dtype),
                    "persistent": b.persistent,
                    "owner": b.owner,
                    **({"value": b.value} if b.value is not None else {}),
                }
                for b in self.buffers.values()
            ],
            "constants": self.constants,
            "scopes": [[[s.key, s.fqn, s.cls] for s in scope] for scope in scopes],
            "units": [{"label": u.label, "nodes": u.nodes} for u in self.units],
            "nodes": nodes,
            **(
                {"functions": [f.to_json() for f in self.functions.values()]}
                if self.functions
                else {}
            ),
            **({"loss": self.loss.to_json()} if self.loss is not None else {}),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Graph:
        """The graph an ``autopipe.ir.graph`` payload describes, checked with :meth:`lint`."""
        try:
            return cls.decode(data)
        except KeyError as exc:
            problem = f"malformed (a field {exc} is missing)"
        except (TypeError, ValueError, IndexError, AttributeError) as exc:
            problem = f"malformed ({type(exc).__name__}: {exc})"
        except ArtifactError as exc:
            problem = f"invalid: {exc}"
        raise ArtifactError(
            f"the graph artefact is {problem}; write it again with `autopipe trace`"
        )

    @classmethod
    def decode(cls, data: dict[str, Any], where: str = "") -> Graph:
        """The graph a payload describes, checked with :meth:`lint`; ``where`` prefixes the
        fields errors name (a graph inside another: ``"loss."``, ``"branch."``). Malformed data
        raises what reading it raises (:meth:`from_json` says it is malformed)."""
        scopes = [tuple(Scope(*s) for s in json_list(scope, "scope")) for scope in data["scopes"]]
        nodes = [
            Node(
                name=r["name"],
                kind=r["kind"],
                target=r.get("target", ""),
                args=tuple(decode(json_list(r.get("args", []), "a node's args"))),
                kwargs={k: decode(v) for k, v in r.get("kwargs", {}).items()},
                meta=decode_meta(r.get("meta")),
                scope=scopes[_index(r["scope"])] if "scope" in r else (),
                context=tuple(tuple(c) for c in decode(r.get("context", []))),
                unit=r.get("unit", -1),
                eval_args={k: decode(v) for k, v in r.get("eval_args", {}).items()},
            )
            for r in json_list(data["nodes"], "nodes")
        ]
        params = {
            p["names"][0]: ParamInfo(
                tuple(json_list(p["names"], "a parameter's names")),
                tuple(json_list(p["shape"], "a parameter's shape")),
                dtype_from_name(p["dtype"]),
                p["requires_grad"],
                p["owner"],
            )
            for p in data["params"]
        }
        buffers = {
            b["names"][0]: BufferInfo(
                tuple(json_list(b["names"], "a buffer's names")),
                tuple(json_list(b["shape"], "a buffer's shape")),
                dtype_from_name(b["dtype"]),
                b["persistent"],
                b["owner"],
                b.get("value"),
            )
            for b in data["buffers"]
        }
        units = [
            Unit(i, u["label"], u["nodes"]) for i, u in enumerate(json_list(data["units"], "units"))
        ]
        functions: dict[str, Any] = {}
        if "functions" in data:
            read_definitions = _function_kind().read_definitions
            assert read_definitions is not None  # _function_kind checked it
            functions = read_definitions(data["functions"], where)
        inputs, outputs, signature = data["inputs"], data["outputs"], data["signature"]
        constants, model = data["constants"], data["model"]
        loss = cls.decode(data["loss"], "loss.") if "loss" in data else None
        graph = cls(
            nodes,
            inputs=inputs,
            outputs=outputs,
            signature=signature,
            params=params,
            buffers=buffers,
            constants=constants,
            model=ModelFacts.from_json(model, where),
            units=units,
            loss=loss,
            functions=functions,
        )
        graph.lint(where)
        return graph

    def rebound(self, sizes: dict[str, int]) -> Graph:
        """A copy whose metadata and sizes are for other ``sizes`` of the dynamic dimensions
        (those not given stay at their planned sizes): for profiling time at the sizes a run
        expects. Strides keep each value's memory layout. Not for saving: lint checks the upper
        bounds."""
        nodes = rebound_nodes(self.nodes, planned_sizes(self) | sizes)
        return Graph(
            nodes,
            inputs=self.inputs,
            outputs=self.outputs,
            signature=self.signature,
            params=self.params,
            buffers=self.buffers,
            constants=self.constants,
            model=self.model,
            units=self.units,
            loss=self.loss,
            functions=self.functions,
        )

    def json_text(self) -> str:
        """The text of the graph artefact, computed once: a graph is not changed after tracing."""
        if self._json_text is None:
            self._json_text = artifact_text(GRAPH_KIND, self.to_json())
        return self._json_text

    def save(self, path: str | Path) -> None:
        check_replaceable(path, GRAPH_KIND)
        atomic_write_text(path, self.json_text())

    @classmethod
    def load(cls, path: str | Path) -> Graph:
        data = read_artifact(path, GRAPH_KIND)
        try:
            return cls.from_json(data)
        except ArtifactError as exc:
            raise ArtifactError(f"{path}: {exc}") from None


def _index(value: Any) -> int:
    require(is_int(value, 0), "a node's scope", value, "an index into scopes")
    return cast(int, value)  # checked to be an int just above


def _function_kind() -> HigherOrderKind:
    """The kind whose definitions a graph artefact's ``functions`` holds."""
    kind = kind_of(FUNCTION_TARGET)
    if kind is None or kind.read_definitions is None:
        raise ArtifactError(
            "custom autograd functions are not available (autopipe.ir.autograd_function)"
        )
    return kind


#: a branch of ``torch.cond`` inside a node's arguments, checked as a graph of its own
register_value_codec(
    ValueCodec("graph", Graph, Graph.to_json, lambda data: Graph.decode(data, "branch."))
)
