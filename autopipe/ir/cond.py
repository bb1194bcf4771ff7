"""``torch.cond`` in the graph IR: how a cond node looks, is checked and is run.

A ``torch.cond(pred, true_fn, false_fn, operands)`` call stays ONE call node of the graph, with
target :data:`COND` and the arguments of ``torch.ops.higher_order.cond``: ``(pred, true_branch,
false_branch, [operand, ...])``. ``pred`` is a one-element tensor value; each branch is a small
:class:`~autopipe.ir.graph.Graph` of its own whose inputs are the operands, in order (torch.export
lifts the parameters and buffers a branch reads into operands), and whose outputs are the cond's
outputs, which ``getitem`` nodes unpack. Being one node, a cond is never split across stages.

Branches hold ATen operators (and grad / autocast regions) only: a cond inside a branch is
refused when tracing and when an artefact is read.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from ..checks import require
from .codec import decode_tensor
from .graph import Graph
from .interpreter import node_context, run_node
from .kinds import HigherOrderKind, register
from .node_graph import NodeGraph
from .types import COND, Node, Ref, TensorMeta

__all__ = [
    "COND",
    "CondOperator",
    "branches",
    "forced_branch",
    "has_cond",
    "lint_cond",
    "run_cond",
    "worst_branch",
]

#: The schema :func:`autopipe.ir.interpreter.resolve_target` gives the cond operator: it writes and
#: aliases none of its arguments (torch refuses branches that mutate or return an operand).
SCHEMA = torch._C.parse_schema(
    "higher_order::cond(Tensor pred, Any true_fn, Any false_fn, Tensor[] operands) -> Tensor[]"
)


class CondOperator:
    """``torch.ops.higher_order.cond`` as :func:`~autopipe.ir.interpreter.resolve_target` gives
    it: its schema says it writes and aliases none of its arguments; cond nodes run through
    :func:`run_cond`."""

    def __init__(self, schema: torch._C.FunctionSchema):
        self._schema = schema

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("a cond node runs through autopipe.interpreter.run_node")


#: Names of the functions generated code defines for branches; no value of a graph with a cond
#: may take one (it would hide the function from the stage's forward)
FUNCTION_NAME = re.compile(r"_cond_(true|false)_\d+")

#: The branch every cond runs while set (profiling costs each branch on its own), else None.
_FORCED: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
    "autopipe_forced_branch", default=None
)


def branches(node: Node) -> tuple[Graph, Graph]:
    """The true and false branch of a cond node."""
    return node.args[1], node.args[2]


def has_cond(nodes: Iterable[Node]) -> bool:
    return any(node.target == COND for node in nodes)


# -- invariants -------------------------------------------------------------------------------
def lint_cond(graph: NodeGraph, node: Node, field: str) -> None:
    """Check a cond node of ``graph`` (its branches were checked as graphs when decoded): the
    arguments of ``higher_order.cond``, branches that take the operands and return the node's
    outputs (shapes and dtypes), no state of their own, and no cond inside a branch."""
    args = node.args
    require(
        len(args) == 4
        and isinstance(args[1], Graph)
        and isinstance(args[2], Graph)
        and isinstance(args[3], list)
        and not node.kwargs,
        f"{field}.args",
        "[...]",
        "[pred, true branch, false branch, [operands]] (the arguments of higher_order.cond)",
    )
    pred, true_branch, false_branch, operands = args
    taken = [n for n in graph.dag if n.startswith("_cond_") and FUNCTION_NAME.fullmatch(n)]
    require(not taken, field, taken, "in a graph whose values leave _cond_true_K etc. free")
    require(
        isinstance(pred, Ref)
        and (meta := graph[pred.name].tensor_meta) is not None
        and meta.numel == 1,
        f"{field}.args[0]",
        pred,
        "a one-element tensor value (the predicate)",
    )
    require(
        all(isinstance(o, Ref) and graph[o.name].tensor_meta is not None for o in operands),
        f"{field}.args[3]",
        operands,
        "a list of tensor values (the operands)",
    )
    outputs = node.meta
    require(
        isinstance(outputs, tuple) and all(isinstance(m, TensorMeta) for m in outputs),
        f"{field}.meta",
        outputs,
        "a tuple of tensor metadata, one per output of the branches",
    )
    for side, branch in (("true", true_branch), ("false", false_branch)):
        where = f"{field}.args ({side} branch)"
        require(
            not branch.params and not branch.buffers and branch.loss is None,
            where,
            sorted(branch.params) + sorted(branch.buffers),
            "a branch without state of its own (torch.export lifts it into operands)",
        )
        nested = [n.name for n in branch.calls if n.target == COND]
        require(not nested, where, nested, "a branch without torch.cond inside (nested cond)")
        require(
            len(branch.inputs) == len(operands)
            and all(
                _same_value(branch[i].tensor_meta, graph[o.name].tensor_meta)
                for i, o in zip(branch.inputs, operands)
            ),
            f"{where}.inputs",
            branch.inputs,
            f"one input per operand, of the operand's shape and dtype ({len(operands)})",
        )
        require(
            len(branch.outputs) == len(outputs)
            and all(_same_value(branch[o].tensor_meta, m) for o, m in zip(branch.outputs, outputs)),
            f"{where}.outputs",
            branch.outputs,
            f"one output per value of the cond, of its shape and dtype ({len(outputs)})",
        )
        require(
            len(branch.units) <= 1,
            f"{where}.units",
            len(branch.units),
            "at most one unit (a branch is part of its cond's unit)",
        )


def _same_value(a: TensorMeta | None, b: TensorMeta | None) -> bool:
    return a is not None and b is not None and a.shape == b.shape and a.dtype == b.dtype


# -- running ----------------------------------------------------------------------------------
def run_cond(node: Node, env: Mapping[str, Any], device: torch.device) -> tuple[Any, ...]:
    """Run a cond node on the values in ``env``: through ``torch.ops.higher_order.cond``, as the
    generated code does (on fake tensors it runs both branches and checks they agree; outputs
    need gradients when an operand does), or inline the branch :func:`forced_branch` names."""
    pred, true_branch, false_branch, operands = node.args
    values = tuple(env[o.name] for o in operands)
    true_fn, false_fn = _branch_function(true_branch, device), _branch_function(
        false_branch, device
    )
    forced = _FORCED.get()
    with node_context(node.context, device) if node.context else contextlib.nullcontext():
        if forced is not None:
            return (true_fn if forced else false_fn)(*values)
        return tuple(torch.ops.higher_order.cond(env[pred.name], true_fn, false_fn, values))


def _branch_function(branch: Graph, device: torch.device) -> Callable[..., tuple[Any, ...]]:
    """A Python function running a branch graph's operators on its operands."""

    def run(*operands: torch.Tensor) -> tuple[Any, ...]:
        env: dict[str, Any] = dict(zip(branch.inputs, operands))
        for node in branch.nodes:
            if node.kind == "constant":
                env[node.name] = decode_tensor(branch.constants[node.name], device)
            elif node.kind == "call":
                env[node.name] = run_node(node, env, device)
        return tuple(env[name] for name in branch.outputs)

    return run


@contextlib.contextmanager
def forced_branch(taken: bool) -> Iterator[None]:
    """Run every cond's ``taken`` branch inline, whatever its predicate (fake tensors have no
    value to decide by)."""
    token = _FORCED.set(taken)
    try:
        yield
    finally:
        _FORCED.reset(token)


def worst_branch(nodes: Iterable[Node], cost: Callable[[], Any]) -> Any:
    """``cost()`` of a unit, and for a unit holding a cond, the larger of its costs with every
    cond taking its true and its false branch: field by field for a dataclass of numbers."""
    if not has_cond(nodes):
        return cost()
    with forced_branch(True):
        taken = cost()
    with forced_branch(False):
        other = cost()
    if dataclasses.is_dataclass(taken):
        rebuild: Callable[..., Any] = type(taken)
        return rebuild(
            **{
                f.name: max(getattr(taken, f.name), getattr(other, f.name))
                for f in dataclasses.fields(taken)
            }
        )
    return max(taken, other)


def _run(
    node: Node, env: Mapping[str, Any], device: torch.device, functions: Mapping[str, Any] | None
) -> tuple[Any, ...]:
    """The run hook of the cond kind (a branch graph has no functions of its own)."""
    return run_cond(node, env, device)


register(HigherOrderKind(COND, operator=CondOperator(SCHEMA), lint=lint_cond, run=_run))
