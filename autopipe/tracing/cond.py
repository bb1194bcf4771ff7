"""``torch.cond`` in an exported program -> one cond node of the graph IR (see
:mod:`autopipe.ir.cond`).

``torch.export`` records ``torch.ops.higher_order.cond(pred, true_graph, false_graph, operands)``
with each branch as a sub-``GraphModule`` whose inputs are the operands (the parameters and
buffers the branches read are lifted into operands). Each branch is converted, operator by
operator as the model's own graph is, into a small :class:`~autopipe.ir.graph.Graph`.
"""

from __future__ import annotations

import contextlib
import functools
import operator
from collections.abc import Iterator
from typing import Any, cast

import torch
from torch import fx

from ..checks import op_overload
from ..errors import TraceError
from ..ir import COND, Graph, ModelFacts, Node, Ref, TensorMeta, Unit
from .converter import Converter
from .passes import drop_dead, move_getitems_after_sources
from .user_line import at_node, on_stack
from .values import constant_literal, scope_of, symbolic_size_error, tensor_meta_of, value_meta_of

__all__ = ["cond_grad_mode_checked", "convert_cond", "cond_location"]


@contextlib.contextmanager
def cond_grad_mode_checked() -> Iterator[None]:
    """Refuse ``torch.cond`` called under another grad mode than the model's forward (inside
    ``torch.no_grad()``) while exporting: torch.export drops such a region around a cond, and
    the pipeline would then train the parameters the branches read."""
    original = torch.cond
    outer = torch.is_grad_enabled()

    @functools.wraps(original)
    def cond(*args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled() != outer:
            line = on_stack()
            where = line.where if line else "the model's forward"
            code = line.code_block if line else ""
            raise TraceError(
                f"the model calls torch.cond under torch.no_grad() at {where}:{code}\n"
                "torch.export drops a no-grad region around a torch.cond, so the pipeline would "
                "train what the branches compute. Call torch.cond outside the region and "
                "detach its results instead."
            )
        return original(*args, **kwargs)

    torch.cond = cond
    try:
        yield
    finally:
        torch.cond = original


def convert_cond(
    converter: Converter, node: fx.Node, owner: torch.nn.Module, context: tuple
) -> None:
    """Add the cond ``node`` of ``owner``'s graph to ``converter`` as one node whose arguments
    hold its two branches as graphs."""
    where = cond_location(node)
    if converter.cond_branch:
        raise TraceError(
            f"the model nests torch.cond inside a branch of torch.cond at {where}; autopipe "
            "compiles a torch.cond whose branches hold torch operators only. Merge the "
            "predicates into one torch.cond, or compute the inner choice with torch.where."
        )
    if converter.symbol_names:
        raise TraceError(
            f"the model calls torch.cond at {where}; autopipe does not compile torch.cond with "
            "--dynamic dimensions yet (its branches are traced for fixed sizes). Compile "
            "without --dynamic, or compute the choice with torch.where"
        )
    error = symbolic_size_error(node)
    if error is not None:
        raise error
    pred, true_node, false_node, operands = node.args
    pred_ref = converter.names.get(pred) if isinstance(pred, fx.Node) else None
    if not isinstance(pred_ref, Ref):
        raise TraceError(
            f"torch.cond at {where} has the predicate {pred!r}; autopipe supports a tensor "
            "predicate (a Python bool chooses its branch when tracing)"
        )
    assert isinstance(operands, (list, tuple))  # torch.cond records its operands as a list
    operand_refs = [converter.names.get(o) if isinstance(o, fx.Node) else o for o in operands]
    if not all(isinstance(ref, Ref) for ref in operand_refs):
        raise TraceError(
            f"torch.cond at {where} has operands that are not tensors ({list(operands)}); "
            "autopipe supports tensor operands only"
        )
    meta = value_meta_of(node)
    if not isinstance(meta, tuple) or not all(isinstance(m, TensorMeta) for m in meta):
        raise TraceError(
            f"torch.cond at {where} returns values that are not tensors; autopipe supports "
            "branches returning tensors only"
        )
    true_branch, false_branch = (
        _branch(converter, _submodule(owner, n), node, side, where)
        for n, side in ((true_node, "true"), (false_node, "false"))
    )
    ir = Node(
        converter.fresh(node.name),
        "call",
        target=COND,
        args=(pred_ref, true_branch, false_branch, operand_refs),
        meta=meta,
        scope=scope_of(node),
        context=context,
    )
    converter.names[node] = Ref(ir.name)
    converter.nodes.append(ir)


def _branch(
    converter: Converter, module: fx.GraphModule, cond: fx.Node, side: str, where: str
) -> Graph:
    """One branch of ``cond`` as a graph of its own: inputs (the operands), tensor constants
    created inside it, and its operators, named apart from the model's values (a branch becomes
    a function of its own in the generated code)."""
    sub = converter.subgraph_converter()  # the same conversion, into fresh tables
    sub.cond_branch = True
    outputs: list[str] = []
    stack = cond.meta.get("nn_module_stack")
    for inner in module.graph.nodes:
        if inner.op == "placeholder":
            name = sub.fresh(inner.name)
            sub.inputs.append(name)
            sub.nodes.append(Node(name, "input", meta=tensor_meta_of(inner)))
            sub.names[inner] = Ref(name)
        elif inner.op == "get_attr":
            value = operator.attrgetter(inner.target)(module)
            if isinstance(value, torch.Tensor):  # a tensor the branch creates from data
                name = sub.fresh(inner.name)
                sub.constants[name] = constant_literal(inner.target, value)
                meta = TensorMeta.of(value, requires_grad=False)
                sub.nodes.append(Node(name, "constant", target=name, meta=meta))
                sub.names[inner] = Ref(name)
        elif inner.op == "call_function":
            if not inner.meta.get("nn_module_stack") and stack:
                inner.meta["nn_module_stack"] = stack  # comment it with the cond's module
            sub.call(inner, module, (), None)
        elif inner.op == "output":
            results = [sub.names.get(r) if isinstance(r, fx.Node) else r for r in inner.args[0]]
            if not all(isinstance(r, Ref) for r in results):
                raise TraceError(
                    f"the {side} branch of torch.cond at {where} returns {inner.args[0]!r}; "
                    "autopipe supports branches returning tensors computed in them"
                )
            outputs = [cast(Ref, r).name for r in results]  # all Refs, checked above
    move_getitems_after_sources(sub.nodes)
    nodes = drop_dead(sub.nodes, set(outputs))
    calls = [n for n in nodes if n.kind == "call"]
    for n in calls:
        n.unit = 0
    foreign = [n.target for n in calls if n.target != "getitem" and op_overload(n.target) is None]
    if foreign:
        raise TraceError(
            f"the {side} branch of torch.cond at {where} calls {foreign[0]}; autopipe supports "
            "branches of torch operators only (no custom autograd function in a branch)"
        )
    if not sub.inputs and any(_needs_device(n) for n in nodes):
        raise TraceError(
            f"the {side} branch of torch.cond at {where} creates tensors but torch.cond has no "
            "operands; pass the tensor it works on as an operand (the generated branch runs on "
            "its operands' device)"
        )
    return Graph(
        nodes,
        inputs=sub.inputs,
        outputs=outputs,
        signature=list(sub.inputs),
        params={},
        buffers={},
        constants=sub.constants,
        model=ModelFacts.of_subgraph(_module_class(stack), where),
        units=[Unit(0, f"{side} branch", [n.name for n in calls])] if calls else [],
    )


def _submodule(owner: torch.nn.Module, node: fx.node.Argument) -> fx.GraphModule:
    """The submodule of ``owner`` a ``get_attr`` node names (a branch of a cond)."""
    assert isinstance(node, fx.Node) and isinstance(node.target, str)  # torch.cond's branches
    return operator.attrgetter(node.target)(owner)


def cond_location(node: fx.Node) -> str:
    """``FILE:LINE`` of the user's ``torch.cond`` call (see :mod:`autopipe.tracing.user_line`),
    else "the model's forward"."""
    return at_node(node)[0]


def _module_class(stack: Any) -> str:
    """The class of the innermost module an ``nn_module_stack`` names."""
    if not stack:
        return "torch.nn.Module"
    _, cls = list(stack.values())[-1]
    return cls if isinstance(cls, str) else f"{cls.__module__}.{cls.__qualname__}"


def _needs_device(node: Node) -> bool:
    def has_device(value: Any) -> bool:
        if isinstance(value, torch.device):
            return True
        if isinstance(value, (list, tuple)):
            return any(map(has_device, value))
        if isinstance(value, dict):
            return any(map(has_device, value.values()))
        return False

    return (
        node.kind == "constant"
        or has_device((node.args, node.kwargs))
        or any(entry[0] == "autocast" for entry in node.context)
    )
