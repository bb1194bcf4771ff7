"""Generated ``torch.autograd.Function`` classes: a user's custom autograd function as traced.

A stage module defines the classes its forward calls (``GeLUFunction.apply(x)``), each with
``forward`` and ``backward`` staticmethods whose bodies are the operators traced from the
original function's own forward and backward (see ``autopipe/ir/autograd_function.py`` for the graphs).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ..ir import FUNCTION_TARGET, Graph, Node, Ref
from ..ir.autograd_function import FunctionDef
from . import emit

__all__ = ["call_statement", "class_source", "function_classes"]

#: indentation of a method body in a class
_BODY = 8


def function_classes(graph: Graph, nodes: Iterable[Node]) -> list[str]:
    """Source of the classes of the custom functions ``nodes`` call, one string per class in
    order of first call; black formats them with the module they go into."""
    names = dict.fromkeys(n.args[0] for n in nodes if n.target == FUNCTION_TARGET)
    return [class_source(graph.functions[name]) for name in names]


def call_statement(
    graph: Graph, node: Node, ref: Callable[[Ref], str], indent: int, target: str
) -> list[str]:
    """``target = GeLUFunction.apply(x)``: a call of a custom function's generated class, as
    black lays it out at ``indent`` spaces."""
    name, inputs = node.args
    return emit.assignment(target, f"{name}.apply", [ref(r) for r in inputs], indent)


emit.register_emitter(FUNCTION_TARGET, call_statement)


def class_source(fdef: FunctionDef) -> str:
    forward, backward = fdef.forward, fdef.backward
    saved = fdef.saved
    results = forward.outputs[: fdef.outputs]
    forward_lines = _body(forward)
    if saved:
        forward_lines.append(f"ctx.save_for_backward({', '.join(saved)})")
    if fdef.non_differentiable:
        marked = ", ".join(results[i] for i in fdef.non_differentiable)
        forward_lines.append(f"ctx.mark_non_differentiable({marked})")
    forward_lines.append(f"return {_tuple(results)}")
    received = backward.inputs[: len(saved)]
    grads = backward.inputs[len(saved) :]
    backward_lines = [f"{_tuple(received)} = ctx.saved_tensors"] if received else []
    backward_lines += _body(backward)
    returned = iter(backward.outputs)
    backward_lines.append(
        f"return {_tuple([next(returned) if flag else 'None' for flag in fdef.grads])}"
    )
    lines = [
        f"class {fdef.name}(torch.autograd.Function):",
        f'    """The custom autograd function {fdef.qualname} ({fdef.source}):',
        '    its own forward and backward, traced into torch operators on the shapes of this pipeline."""',
        "",
        "    @staticmethod",
        *_decorator(fdef, "forward"),
        f"    def forward(ctx, {', '.join(forward.inputs)}):",
        *(f"        {line}" if line else "" for line in forward_lines),
        "",
        "    @staticmethod",
        *_decorator(fdef, "backward"),
        f"    def backward(ctx, {', '.join(grads)}):",
        *(f"        {line}" if line else "" for line in backward_lines),
    ]
    return "\n".join(lines) + "\n"


def _decorator(fdef: FunctionDef, part: str) -> list[str]:
    """The original's ``torch.amp.custom_fwd`` / ``custom_bwd`` decorator, if it had one."""
    if part not in fdef.amp:
        return []
    if part == "backward":
        return [f'    @torch.amp.custom_bwd(device_type="{fdef.amp[part]}")']
    device_type, cast = fdef.amp[part]
    cast_src = f", cast_inputs=torch.{cast}" if cast is not None else ""
    return [f'    @torch.amp.custom_fwd(device_type="{device_type}"{cast_src})']


def _tuple(names: list[str]) -> str:
    return f"({names[0]},)" if len(names) == 1 else f"({', '.join(names)})"


def _body(sub: Graph) -> list[str]:
    """Statements computing a function graph's operators (lines relative to a method body)."""
    calls = sub.calls
    lines: list[str] = []
    if emit.uses_device(calls) or sub.constants:
        lines.append(f"device = {sub.inputs[0]}.device")
    for name, value in sub.constants.items():
        expression = f"{emit.tensor_expression(value)}.to(device)"
        lines.extend(emit.assignment(name, expression, None, _BODY))

    def ref(r: Ref) -> str:
        return r.name

    context: tuple = ()
    for node in calls:
        if node.context != context:
            context = node.context
            if context:
                lines.append(f"with {emit.context_managers(context)}:")
        indent = "    " if context else ""
        fn, args = emit.operator_call(node, ref)
        call_args = args if node.target != "getitem" else None
        statement = emit.assignment(node.name, fn, call_args, _BODY + len(indent))
        lines.extend(indent + line for line in statement)
    return lines
