"""Python source for ``torch.cond`` nodes: each branch as a module-level function of the stage
file, and the ``torch.cond`` call of the stage's forward.

.. code-block:: python

    def _cond_true_0(linear, p_f_lin_bias, p_f_lin_weight):
        # true branch of torch.cond at tests/cond_models.py:31
        # CondNet (model)
        linear_1 = aten.linear.default(linear, p_f_lin_weight, p_f_lin_bias)
        relu = aten.relu.default(linear_1)
        return (relu,)

    ...
        cond = torch.cond(gt, _cond_true_0, _cond_false_0, (linear, self.f.lin.bias, ...))

A branch reads parameters as operands, so the stage passes its own (original-name) parameters to
``torch.cond`` and autograd gives them their gradients.
"""

from __future__ import annotations

from collections.abc import Callable

from ..ir import COND, Graph, Node, Ref
from ..ir.cond import branches
from . import emit

__all__ = ["branch_functions", "cond_statement"]


def _function_names(graph: Graph, node: Node) -> tuple[str, str]:
    """``_cond_true_K`` / ``_cond_false_K`` for the K-th cond of the graph (program order): the
    same names in whichever stage the cond lands (no value takes them: Graph.lint)."""
    index = [n.name for n in graph.calls if n.target == COND].index(node.name)
    return f"_cond_true_{index}", f"_cond_false_{index}"


def cond_statement(
    graph: Graph, node: Node, ref: Callable[[Ref], str], indent: int, target: str
) -> list[str]:
    """``target = torch.cond(pred, _cond_true_K, _cond_false_K, (operands...))`` as black lays
    it out at ``indent`` spaces."""
    pred, _, _, operands = node.args
    true_name, false_name = _function_names(graph, node)
    values = [ref(o) for o in operands]
    tuple_src = f"({values[0]},)" if len(values) == 1 else f"({', '.join(values)})"
    call = f"torch.cond({ref(pred)}, {true_name}, {false_name}, {tuple_src})"
    return emit.black_statement(f"{target} = {call}", indent)


emit.register_emitter(COND, cond_statement)


def branch_functions(graph: Graph, nodes: list[Node], model_class: str) -> list[str]:
    """Source of the branch functions of the conds among ``nodes``, one string per function."""
    functions = []
    for node in nodes:
        if node.target != COND:
            continue
        names = _function_names(graph, node)
        for branch, name, side in zip(branches(node), names, ("true", "false")):
            functions.append(_function(branch, name, side, model_class))
    return functions


def _function(branch: Graph, name: str, side: str, model_class: str) -> str:
    calls = branch.calls
    constants = [n.name for n in branch.nodes if n.kind == "constant"]
    lines = [
        f"def {name}({', '.join(branch.inputs)}):",
        f"    # {side} branch of torch.cond at {branch.model.source}",
    ]
    if constants or emit.uses_device(calls):
        lines.append(f"    device = {branch.inputs[0]}.device")
    for constant in constants:
        expression = f"{emit.tensor_expression(branch.constants[constant])}.to(device)"
        lines += [f"    {line}" for line in emit.assignment(constant, expression, None, 4)]
    label = lambda node: emit.scope_label(node, model_class)  # noqa: E731
    body = emit.forward_body(branch, calls, lambda r: r.name, label, base=4)
    lines += [f"    {line}" for line in body]
    outputs = branch.outputs
    returned = f"({outputs[0]},)" if len(outputs) == 1 else f"({', '.join(outputs)})"
    lines.append(f"    return {returned}")
    return "\n".join(lines) + "\n"
