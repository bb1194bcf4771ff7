"""Custom ``torch.autograd.Function``s in the graph IR.

A call of a user's autograd function is one call node, ``autopipe.function.default(NAME,
[inputs])``, returning a tuple of tensors that ``getitem`` nodes unpack. ``NAME`` keys a
:class:`FunctionDef` in ``Graph.functions``: the function's own forward and backward, each traced
into a small :class:`~autopipe.ir.graph.Graph` of torch operators. Generated code turns a definition
into a ``torch.autograd.Function`` subclass of the same name (``autopipe/codegen/autograd_function.py``),
and :func:`call_function` runs it here, so the requires-grad pass and the profilers see the
function's forward and its custom backward.

Protocol of the two graphs:

- ``forward``: inputs are the function's tensor arguments, in order (other arguments are baked
  in); outputs are its ``outputs`` results, then the tensors it saves for backward.
- ``backward``: inputs are the saved tensors, then one gradient per result; outputs are the
  gradients it returns, one for each tensor argument whose ``grads`` flag is set (the others get
  None).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any

import torch

from ..checks import is_class_name, is_identifier, is_int, is_value_name, require
from ..errors import ArtifactError
from .codec import decode_tensor
from .graph import Graph
from .interpreter import node_context, replace_devices, run_nodes
from .kinds import HigherOrderKind, register
from .node_graph import NodeGraph
from .types import (
    FUNCTION_TARGET,
    Node,
    Ref,
    TensorMeta,
    dtype_from_name,
    json_list,
    map_refs,
)

__all__ = [
    "FUNCTION_TARGET",
    "FunctionDef",
    "call_function",
    "is_function_name",
    "lint_call",
    "lint_functions",
    "read_functions",
    "run_call",
]

#: Module-level names of generated stage and loss modules; function classes keep away from them.
MODULE_NAMES = frozenset(
    {
        "PARAMETERS",
        "BUFFERS",
        "OPERATORS",
        "build_state",
        "init_state",
        "require_operators",
        "Loss",
        "ctx",
        "super",
    }
)
_STAGE_CLASS = re.compile(r"Stage\d+")
#: FILE:LINE of a function's class, as autopipe writes it into a docstring
SOURCE = re.compile(r"[\w.\-/]+:\d+")

#: Result metadata of the functions being traced, by name: read by the operator's fake kernel.
TRACING_OUTPUTS: dict[str, list[tuple[tuple[int, ...], tuple[int, ...], torch.dtype]]] = {}


@torch.library.custom_op("autopipe::function", mutates_args=())
def _function_op(name: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Stands for a custom autograd function while torch.export traces the model; the generated
    code calls the function's class instead."""
    raise RuntimeError(
        f"autopipe.function {name!r} runs only while tracing; the interpreter and generated code "
        "run the function's traced graphs"
    )


@_function_op.register_fake
def _function_op_fake(name: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    device = inputs[0].device
    return [
        torch.empty_strided(shape, stride, dtype=dtype, device=device)
        for shape, stride, dtype in TRACING_OUTPUTS[name]
    ]


def is_function_name(name: Any) -> bool:
    """A name a generated function class may have: an identifier no generated module uses."""
    return is_value_name(name) and name not in MODULE_NAMES and not _STAGE_CLASS.fullmatch(name)


@dataclass
class FunctionDef:
    """A user's autograd function, traced: see the module docstring for the graphs' protocol."""

    name: str  # the generated class's name, unique in the graph
    qualname: str  # module and qualified name of the original class
    source: str  # where the original class is defined: FILE:LINE, relative to its package root
    forward: Graph
    backward: Graph
    outputs: int  # the number of results (forward.outputs holds the saved tensors after them)
    grads: list[bool]  # per tensor argument: whether backward returns a gradient for it
    non_differentiable: list[int] = field(default_factory=list)  # results marked so
    #: torch.amp decorators of the original: "forward" -> [device type, cast dtype or None]
    #: (``custom_fwd``), "backward" -> device type (``custom_bwd``)
    amp: dict[str, Any] = field(default_factory=dict)

    @property
    def saved(self) -> list[str]:
        """Names, in the forward graph, of the tensors saved for backward."""
        return self.forward.outputs[self.outputs :]

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "qualname": self.qualname,
            "source": self.source,
            "outputs": self.outputs,
            "grads": self.grads,
            "non_differentiable": self.non_differentiable,
            **({"amp": self.amp} if self.amp else {}),
            "forward": self.forward.to_json(),
            "backward": self.backward.to_json(),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], where: str) -> FunctionDef:
        require(isinstance(data, dict), where, data, "an object")
        name = data["name"]
        return cls(
            name=name,
            qualname=data["qualname"],
            source=data["source"],
            forward=Graph.decode(data["forward"], f"{where}.forward."),
            backward=Graph.decode(data["backward"], f"{where}.backward."),
            outputs=data["outputs"],
            grads=data["grads"],
            non_differentiable=data.get("non_differentiable", []),
            amp=data.get("amp", {}),
        )


def read_functions(records: Any, where: str) -> dict[str, FunctionDef]:
    """The definitions a graph artefact's ``functions`` lists, by name."""
    functions: dict[str, FunctionDef] = {}
    for i, record in enumerate(json_list(records, "functions")):
        function = FunctionDef.from_json(record, f"{where}functions[{i}]")
        require(
            function.name not in functions,
            f"{where}functions[{i}].name",
            function.name,
            "the name of one function",
        )
        functions[function.name] = function
    return functions


# -- invariants (Graph.lint) ------------------------------------------------------------------
def lint_functions(graph: NodeGraph, where: str) -> None:
    """Check ``graph.functions`` (if it has any): each definition on its own, and its name
    against the graph's value names (a stage's forward must not shadow the class it calls)."""
    if not graph.functions:
        return
    require(isinstance(graph.functions, dict), f"{where}functions", graph.functions, "an object")
    for key, fdef in graph.functions.items():
        field_ = f"{where}functions[{key!r}]"
        require(isinstance(fdef, FunctionDef), field_, fdef, "a traced autograd function")
        require(fdef.name == key, f"{field_}.name", fdef.name, f"the function's key {key!r}")
        require(
            is_function_name(key) and key not in graph.dag,
            f"{field_}.name",
            key,
            "a class name no value of the graph and no name of a generated module has",
        )
        _lint_function(fdef, field_)


def _lint_function(fdef: FunctionDef, field_: str) -> None:
    require(is_class_name(fdef.qualname), f"{field_}.qualname", fdef.qualname, "a class name")
    require(
        isinstance(fdef.source, str) and SOURCE.fullmatch(fdef.source) is not None,
        f"{field_}.source",
        fdef.source,
        "a FILE:LINE location (a relative path of letters, digits, _ . - /)",
    )
    forward, backward = fdef.forward, fdef.backward
    for part, sub in (("forward", forward), ("backward", backward)):
        where = f"{field_}.{part}"
        require(
            not sub.params and not sub.buffers and sub.loss is None and not sub.functions,
            where,
            part,
            "a graph of operators on its inputs (no parameters, buffers, loss or functions)",
        )
        for node in sub.nodes:
            require(node.name != "ctx", f"{where}.nodes", node.name, "a name other than ctx")
    outputs = fdef.outputs
    require(
        is_int(outputs, 1) and outputs <= len(forward.outputs),
        f"{field_}.outputs",
        outputs,
        f"a number of results between 1 and {len(forward.outputs)}",
    )
    require(bool(forward.inputs), f"{field_}.forward.inputs", [], "one tensor argument or more")
    saved = fdef.saved
    expected = [_io_meta(forward, n) for n in saved] + [
        _io_meta(forward, n) for n in forward.outputs[:outputs]
    ]
    got = [_io_meta(backward, n) for n in backward.inputs]
    require(
        len(got) == len(expected)
        and all((a.shape, a.dtype) == (b.shape, b.dtype) for a, b in zip(got, expected)),
        f"{field_}.backward.inputs",
        backward.inputs,
        "the saved tensors, then one gradient per result, with their shapes and dtypes",
    )
    grads = fdef.grads
    require(
        isinstance(grads, list)
        and len(grads) == len(forward.inputs)
        and all(isinstance(g, bool) for g in grads)
        and sum(grads) == len(backward.outputs),
        f"{field_}.grads",
        grads,
        f"a flag per tensor argument, as many set as backward has outputs ({len(backward.outputs)})",
    )
    marked = fdef.non_differentiable
    require(
        isinstance(marked, list)
        and all(is_int(i, 0) and i < outputs for i in marked)
        and marked == sorted(set(marked)),
        f"{field_}.non_differentiable",
        marked,
        f"increasing indices of results (below {outputs})",
    )
    _lint_amp(fdef.amp, f"{field_}.amp")


def _io_meta(graph: Graph, name: str) -> TensorMeta:
    """The tensor metadata of an input or output of a function's forward or backward graph."""
    meta = graph[name].tensor_meta
    assert meta is not None  # traced from tensors; Graph.lint checks it when the graph is read
    return meta


def _lint_amp(amp: Any, field_: str) -> None:
    require(
        isinstance(amp, dict) and set(amp) <= {"forward", "backward"},
        field_,
        amp,
        "an object with forward and backward decorators",
    )
    forward = amp.get("forward", ["cpu", None])
    require(
        isinstance(forward, list)
        and len(forward) == 2
        and is_identifier(forward[0])
        and (forward[1] is None or _is_dtype_name(forward[1])),
        f"{field_}.forward",
        forward,
        "[a device type, a dtype name or null]",
    )
    backward = amp.get("backward", "cpu")
    require(is_identifier(backward), f"{field_}.backward", backward, "a device type")


def lint_call(graph: NodeGraph, node: Node, field_: str) -> None:
    """Check a call of a custom function: ``[NAME, [input, ...]]`` with the inputs and results
    the function's forward graph has."""
    args = list(node.args)
    fdef = graph.functions.get(args[0]) if len(args) == 2 and isinstance(args[0], str) else None
    require(
        fdef is not None and isinstance(args[1], list) and not node.kwargs,
        f"{field_}.args",
        args,
        "[the name of a function in functions, a list of its tensor arguments]",
    )
    assert fdef is not None  # require raised otherwise
    inputs = [graph[r.name].tensor_meta if isinstance(r, Ref) else None for r in args[1]]
    wanted = [fdef.forward[n].tensor_meta for n in fdef.forward.inputs]
    require(
        len(inputs) == len(wanted)
        and all(
            a is not None and (a.shape, a.dtype) == (b.shape, b.dtype)
            for a, b in zip(inputs, wanted)
        ),
        f"{field_}.args",
        args,
        f"the tensor arguments of {fdef.name}, with their shapes and dtypes",
    )
    results = [fdef.forward[n].tensor_meta for n in fdef.forward.outputs[: fdef.outputs]]
    meta = node.meta
    require(
        isinstance(meta, tuple)
        and len(meta) == len(results)
        and all(
            m is not None and (m.shape, m.dtype) == (r.shape, r.dtype)
            for m, r in zip(meta, results)
        ),
        f"{field_}.meta",
        node.meta,
        f"the results of {fdef.name}, with their shapes and dtypes",
    )


# -- running a function (requires-grad pass, profiling) ---------------------------------------
def run_call(
    node: Node, env: Mapping[str, Any], device: torch.device, functions: Mapping[str, Any] | None
) -> Any:
    """Run a call of a custom function (the interpreter's hook for the kind): its traced forward,
    and backward for autograd, under the node's grad / autocast modes."""
    args = replace_devices(map_refs(node.args, lambda r: env[r.name]), device)
    name, inputs = args
    fdef = (functions or {})[name]
    if node.context:
        with node_context(node.context, device):
            return call_function(fdef, inputs, device)
    return call_function(fdef, inputs, device)


def call_function(
    fdef: FunctionDef, inputs: list[torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, ...]:
    """Run a traced function forward, with its traced backward for autograd, as the generated
    class does."""
    # torch leaves Function.apply unannotated
    results: tuple[torch.Tensor, ...] = _GraphFunction.apply(  # type: ignore[no-untyped-call]
        fdef, device, *inputs
    )
    return results


def _run_graph(sub: Graph, values: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    env: dict[str, Any] = dict(zip(sub.inputs, values))
    for name, literal in sub.constants.items():
        env[name] = decode_tensor(literal, device)
    run_nodes(sub.calls, env, device)
    return [env[name] for name in sub.outputs]


class _GraphFunction(torch.autograd.Function):
    """The interpreter's counterpart of a generated function class."""

    @staticmethod
    def forward(
        ctx: Any, fdef: FunctionDef, device: torch.device, *inputs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        values = _run_graph(fdef.forward, list(inputs), device)
        results, saved = values[: fdef.outputs], values[fdef.outputs :]
        ctx.save_for_backward(*saved)
        ctx.fdef, ctx.device = fdef, device
        if fdef.non_differentiable:
            ctx.mark_non_differentiable(*(results[i] for i in fdef.non_differentiable))
        return tuple(results)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        fdef: FunctionDef = ctx.fdef
        returned = iter(_run_graph(fdef.backward, [*ctx.saved_tensors, *grads], ctx.device))
        return (None, None, *(next(returned) if flag else None for flag in fdef.grads))


def _is_dtype_name(name: Any) -> bool:
    try:
        dtype_from_name(name)
    except (ArtifactError, TypeError):
        return False
    return True


register(
    HigherOrderKind(
        FUNCTION_TARGET,
        operator=torch.ops.autopipe.function.default,
        lint=lint_call,
        run=run_call,
        lint_graph=lint_functions,
        read_definitions=read_functions,
    )
)
