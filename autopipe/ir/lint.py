"""The invariants of the graph IR, in one place: what :meth:`Graph.lint
<autopipe.ir.graph.Graph.lint>` checks before any later step relies on a graph.

Names that become Python identifiers in generated code are identifiers autopipe could have made;
module names are dotted identifiers; operators are real torch operators called with arguments
their schemas accept; nodes come in program order; every value a stage could exchange is a
tensor; units cover the operators exactly once. A higher-order node (``torch.cond``, a custom
autograd function) is checked by the hook its kind registers (:mod:`autopipe.ir.kinds`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..checks import (
    is_class_name,
    is_fqn,
    is_identifier,
    is_int,
    is_text,
    is_value_name,
    op_overload,
    require,
)
from ..errors import ArtifactError
from ..runtime.core.shapes import FormulaError, evaluate
from .codec import decode_tensor, encode, encode_meta
from .eval_mode import lint_eval_args
from .kinds import kind_of, registered
from .node_graph import NodeGraph
from .sizes import planned_sizes
from .types import (
    NODE_KINDS,
    BufferInfo,
    Node,
    ParamInfo,
    Ref,
    TensorMeta,
    iter_refs,
    json_list,
    sizes_in,
)

__all__ = ["lint_graph", "lint_tensor"]

_IDENTIFIER = "a Python identifier autopipe could have made (not a keyword or a reserved name)"
_SIZES = "a list of sizes (integers of at least 0)"


def lint_graph(graph: NodeGraph, where: str = "") -> None:
    """Check the invariants the later steps rely on, in one pass, as ``torch.fx``'s
    ``Graph.lint`` does; raise :class:`ArtifactError` naming the first field that breaks one.

    Names that become Python identifiers in generated code are identifiers autopipe could
    have made; module names are dotted identifiers; operators are real torch operators called
    with arguments their schemas accept; nodes come in program order; every value a stage
    could exchange is a tensor; units cover the operators exactly once."""
    graph.model.lint(where)
    require(
        isinstance(graph.signature, list) and all(map(is_identifier, graph.signature)),
        f"{where}signature",
        graph.signature,
        "a list of argument names",
    )
    for table, kind in ((graph.params, "params"), (graph.buffers, "buffers")):
        for canonical, info in table.items():
            _lint_state(info, f"{where}{kind}[{canonical!r}]")
    states: list[ParamInfo | BufferInfo] = [*graph.params.values(), *graph.buffers.values()]
    held = [n for info in states for n in info.names]
    require(len(set(held)) == len(held), f"{where}params", held, "names of one tensor each")
    require(isinstance(graph.constants, dict), f"{where}constants", graph.constants, "an object")
    for name, value in graph.constants.items():
        require(is_value_name(name), f"{where}constants", name, _IDENTIFIER)
        lint_tensor(value, f"{where}constants[{name!r}]")
    for higher in registered():  # what a higher-order kind adds to the graph
        if higher.lint_graph is not None:
            higher.lint_graph(graph, where)
    seen: set[str] = set()
    planned = planned_sizes(graph)
    for position, node in enumerate(graph.nodes):
        field_name = f"{where}nodes[{position}] ({node.name!r})"
        _lint_node(graph, node, seen, field_name)
        _lint_sizes(node, planned, field_name)
        seen.add(node.name)
    for field_name, names in (("inputs", graph.inputs), ("outputs", graph.outputs)):
        require(isinstance(names, list), f"{where}{field_name}", names, "a list of node names")
        for name in names:
            require(
                isinstance(name, str) and name in graph.dag,
                f"{where}{field_name}",
                name,
                "the name of a node",
            )
            require(
                graph[name].tensor_meta is not None,
                f"{where}{field_name}",
                name,
                "a tensor value with shape and dtype",
            )
    declared = {n.name for n in graph.nodes if n.kind == "input"}
    require(
        set(graph.inputs) == declared and len(graph.inputs) == len(declared),
        f"{where}inputs",
        graph.inputs,
        f"the input nodes, each once ({sorted(declared)})",
    )
    _lint_symbol_sources(graph, where)
    _lint_split_markers(graph, where)
    _lint_units(graph, where)
    if graph.loss is not None:
        require(
            len(graph.loss.outputs) == 1 and len(graph.loss.inputs) == len(graph.outputs) + 1,
            "loss",
            graph.loss.inputs,
            "a graph from the model's outputs and a target to one loss value",
        )


def _lint_symbol_sources(graph: NodeGraph, where: str) -> None:
    """Each dynamic dimension sizes model inputs, whose metadata names it there."""
    for name, symbol in graph.model.symbols.items():
        for source, dim in symbol.sources:
            meta = graph[source].tensor_meta if source in graph.inputs else None
            require(
                meta is not None and dim < len(meta.sizes) and meta.sizes[dim] == name,
                f"{where}model.symbols.{name}.sources",
                [source, dim],
                f"a model input whose dimension {dim} is {name}",
            )


def _lint_split_markers(graph: NodeGraph, where: str) -> None:
    """Each ``pipe_split()`` marker names a call node, the markers in program order."""
    calls = {node.name: index for index, node in enumerate(graph.calls)}
    markers = graph.model.split_markers
    positions = [calls.get(name, -1) for name in markers]
    require(
        all(p >= 0 for p in positions) and positions == sorted(positions),
        f"{where}model.split_markers",
        list(markers),
        "call nodes of the graph, in program order",
    )


def _lint_state(info: ParamInfo | BufferInfo, field: str) -> None:
    require(
        bool(info.names) and all(map(is_fqn, info.names)),
        f"{field}.names",
        list(info.names),
        "a list of module names (dot-separated identifiers or numbers)",
    )
    require(all(is_int(s, 0) for s in info.shape), f"{field}.shape", list(info.shape), _SIZES)
    flag = "requires_grad" if isinstance(info, ParamInfo) else "persistent"
    value = getattr(info, flag)
    require(isinstance(value, bool), f"{field}.{flag}", value, "true or false")
    require(is_class_name(info.owner), f"{field}.owner", info.owner, "a class")
    if isinstance(info, BufferInfo) and info.value is not None:
        tensor = lint_tensor(info.value, f"{field}.value")
        require(
            tuple(tensor.shape) == info.shape and tensor.dtype == info.dtype,
            f"{field}.value",
            info.value,
            f"a tensor of the buffer's shape {list(info.shape)} and dtype",
        )


def lint_tensor(data: Any, field: str) -> torch.Tensor:
    """A tensor literal (:func:`encode_tensor`) checked by decoding it."""
    require(
        isinstance(data, dict) and sorted(data) == ["data", "dtype", "shape"],
        field,
        data,
        "a tensor literal {shape, dtype, data}",
    )
    shape, values = data["shape"], data["data"]
    require(isinstance(shape, list) and all(is_int(s, 0) for s in shape), field, shape, _SIZES)
    count = math.prod(shape)
    require(
        isinstance(values, list) and len(values) == count,
        f"{field}.data",
        values,
        f"a list of {count} values",
    )
    try:
        return decode_tensor(data)
    except (ArtifactError, RuntimeError, TypeError, ValueError, OverflowError) as exc:
        raise ArtifactError(f"{field} is not a tensor literal ({exc})") from None


def _lint_node(graph: NodeGraph, node: Node, seen: set[str], field: str) -> None:
    require(is_value_name(node.name), f"{field}.name", node.name, _IDENTIFIER)
    require(node.kind in NODE_KINDS, f"{field}.kind", node.kind, f"one of {NODE_KINDS}")
    for ref in iter_refs((node.args, node.kwargs)):
        require(ref.name in seen, f"{field}.args", ref.name, "a node defined before this one")
    _lint_meta(node.meta, f"{field}.meta")
    for level in node.scope:
        require(
            is_text(level.key) and is_fqn(level.fqn) and is_class_name(level.cls),
            f"{field}.scope",
            [level.key, level.fqn, level.cls],
            "a [key, module name, class] triple",
        )
    for entry in node.context:
        require(_is_mode(entry), f"{field}.context", entry, "a grad or autocast mode")
    if node.kind == "call":
        _lint_call(graph, node, field)
        lint_eval_args(node, field)
        return
    require(
        not node.args and not node.kwargs and not node.context and not node.eval_args,
        field,
        node.args,
        "a placeholder: it has no arguments",
    )
    require(node.tensor_meta is not None, f"{field}.meta", node.meta, "tensor metadata")
    if node.kind == "param":
        known = any(node.target in info.names for info in graph.params.values())
        require(known, f"{field}.target", node.target, "the name of a parameter in params")
    elif node.kind == "buffer":
        info = next((b for b in graph.buffers.values() if node.target in b.names), None)
        require(info is not None, f"{field}.target", node.target, "a buffer in buffers")
        assert info is not None  # require raised otherwise
        require(
            info.persistent or info.value is not None,
            f"{field}.target",
            node.target,
            "a buffer the pipeline can rebuild (a non-persistent buffer needs its value)",
        )
    elif node.kind == "constant":
        require(
            node.target == node.name and node.name in graph.constants,
            f"{field}.target",
            node.target,
            "the node's own name, a key of constants",
        )


def _lint_call(graph: NodeGraph, node: Node, field: str) -> None:
    require(
        is_int(node.unit, 0) and node.unit < len(graph.units),
        f"{field}.unit",
        node.unit,
        f"a unit index below {len(graph.units)}",
    )
    kind = kind_of(node.target)
    if kind is not None:  # torch.cond, a custom autograd function, ...
        kind.lint(graph, node, field)
        return
    if node.target == "getitem":
        source: Any  # unchecked values from the artefact, checked just below
        index: Any
        source, index = node.args if len(node.args) == 2 else (None, None)
        require(
            isinstance(source, Ref)
            and is_int(index, 0)
            and not node.kwargs
            and isinstance(graph[source.name].meta, tuple)
            and index < len(graph[source.name].meta),
            f"{field}.args",
            list(node.args),
            "[an operator with several outputs, the index of one]",
        )
        return
    op = op_overload(node.target)
    require(
        op is not None,
        f"{field}.target",
        node.target,
        "a torch operator NAMESPACE.NAME.OVERLOAD (a custom one needs its library imported)",
    )
    assert op is not None  # require raised otherwise
    arguments = op._schema.arguments
    positional = [a for a in arguments if not a.kwarg_only]
    given = {a.name for a in positional[: len(node.args)]} | set(node.kwargs)
    missing = [a.name for a in arguments if a.name not in given and not a.has_default_value()]
    require(
        len(node.args) <= len(positional) and not missing,
        f"{field}.args",
        list(node.args),
        f"the arguments of {node.target} ({op._schema})",
    )
    names = {a.name for a in arguments} - {a.name for a in positional[: len(node.args)]}
    for key in node.kwargs:
        require(
            is_identifier(key) and key in names,
            f"{field}.kwargs",
            key,
            f"an argument of {node.target}",
        )
    by_name = {a.name: a for a in arguments}
    for argument, value in [
        *zip(positional, node.args),
        *((by_name[key], value) for key, value in node.kwargs.items()),
    ]:
        require(
            _fits(value, argument.real_type),
            f"{field}.args",
            value,
            f"a value for {argument.name} ({argument.real_type}) of {node.target}",
        )


#: Python types of argument values, by the kind of schema type they are passed as
_SCALAR_TYPES: dict[str, tuple[type, ...]] = {
    "IntType": (int,),
    "SymIntType": (int,),
    "FloatType": (int, float),
    "NumberType": (int, float),
    "BoolType": (bool,),
    "StringType": (str,),
    "DeviceObjType": (torch.device,),
    "ScalarTypeType": (torch.dtype,),
    "LayoutType": (torch.layout,),
    "MemoryFormatType": (torch.memory_format,),
}


def _fits(value: Any, type_: Any) -> bool:
    """Whether ``value`` can be passed where an operator's schema says ``type_`` (a JIT type)."""
    kind = type_.kind()
    if kind == "OptionalType":
        return value is None or _fits(value, type_.getElementType())
    if kind == "ListType":
        element = type_.getElementType()
        return isinstance(value, list) and all(_fits(v, element) for v in value)
    if kind == "TensorType":  # a value, or a Python number torch turns into a tensor
        return isinstance(value, (Ref, int, float))
    if kind not in _SCALAR_TYPES:
        return True  # a type traced graphs do not pass; torch checks it when the code runs
    if isinstance(value, bool) and kind not in ("BoolType", "NumberType"):
        return False
    return isinstance(value, _SCALAR_TYPES[kind])


def _is_mode(entry: tuple[Any, ...]) -> bool:
    """``("grad", enabled)`` or ``("autocast", device_type, dtype or None, enabled)``."""
    if entry[:1] == ("grad",):
        return len(entry) == 2 and isinstance(entry[1], bool)
    return (
        entry[:1] == ("autocast",)
        and len(entry) == 4
        and is_text(entry[1])
        and (entry[2] is None or isinstance(entry[2], torch.dtype))
        and isinstance(entry[3], bool)
    )


def _lint_meta(meta: Any, field: str) -> None:
    if isinstance(meta, tuple):
        for item in meta:
            require(not isinstance(item, tuple), field, item, "tensor metadata")
            _lint_meta(item, field)
    elif meta is not None:
        require(
            all(is_int(s, 0) for s in meta.shape)
            and len(meta.stride) == len(meta.shape)
            and all(is_int(s, 0) for s in meta.stride)
            and isinstance(meta.requires_grad, bool),
            field,
            encode_meta(meta),
            "tensor metadata {shape, dtype, stride, requires_grad}",
        )


def _lint_sizes(node: Node, planned: dict[str, int], field: str) -> None:
    """Every formula, of the value's dimensions and of the sizes among the arguments, reads
    the graph's dynamic dimensions and gives the planned size recorded beside it."""

    def gives(formula: Any, size: int) -> bool:
        try:
            return is_text(formula) and evaluate(formula, planned) == size
        except (FormulaError, ArithmeticError, TypeError):
            return False

    metas = node.meta if isinstance(node.meta, tuple) else (node.meta,)
    for meta in metas:
        if isinstance(meta, TensorMeta) and meta.sizes:
            require(
                len(meta.sizes) == len(meta.shape) and all(map(gives, meta.sizes, meta.shape)),
                f"{field}.meta.sizes",
                list(meta.sizes),
                f"one formula per dimension, giving {list(meta.shape)} for {planned}",
            )
    for size in sizes_in((node.args, node.kwargs)):
        require(
            gives(size.formula, int(size)),
            f"{field}.args",
            encode(size),
            f"a size whose formula gives it for {planned}",
        )


def _lint_units(graph: NodeGraph, where: str) -> None:
    listed: set[str] = set()
    for unit in graph.units:
        field = f"{where}units[{unit.index}]"
        require(is_text(unit.label), f"{field}.label", unit.label, "a one-line label")
        require(bool(json_list(unit.nodes, f"{field}.nodes")), f"{field}.nodes", [], "non-empty")
        for name in unit.nodes:
            require(
                isinstance(name, str)
                and name in graph.dag
                and graph[name].kind == "call"
                and graph[name].unit == unit.index
                and name not in listed,
                f"{field}.nodes",
                name,
                f"an operator of unit {unit.index}, listed once",
            )
            listed.add(name)
    unlisted = [node.name for node in graph.calls if node.name not in listed]
    require(not unlisted, f"{where}units", unlisted[:3], "a list covering every operator")
