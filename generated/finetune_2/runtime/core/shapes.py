"""Sizes of a pipeline compiled with dynamic dimensions: formulas of the dimensions' names.

Copied into every generated pipeline as ``runtime/core/shapes.py``; it needs only the standard
library. ``pipeline.json`` writes a dynamic size as a formula (``"seq"``, ``"2 * seq"``,
``"seq - 1"``, ``"max(32, 32 * seq)"``); :func:`evaluate` computes one for a step's values of the
names, reading nothing but integers, ``+ - * // %``, small powers and ``min``/``max``.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable, Mapping

_BINARY: dict[type[ast.operator], Callable[[int, int], int]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_CALLS = {"min": min, "max": max}


class FormulaError(ValueError):
    """A size formula that is not one this module evaluates, or names an unknown dimension."""


def evaluate(formula: str | int, values: Mapping[str, int]) -> int:
    """The size ``formula`` gives for the dimensions' ``values`` (an int is its own size)."""
    if isinstance(formula, int):
        return formula
    return _value(_parse(formula).body, values, formula)


def names_in(formula: str | int) -> set[str]:
    """The dimension names a formula reads."""
    if isinstance(formula, int):
        return set()
    nodes = list(ast.walk(_parse(formula)))
    functions = {id(n.func) for n in nodes if isinstance(n, ast.Call)}
    return {n.id for n in nodes if isinstance(n, ast.Name) and id(n) not in functions}


def _parse(formula: str) -> ast.Expression:
    try:
        return ast.parse(formula, mode="eval")
    except SyntaxError:
        raise FormulaError(f"size formula {formula!r} is not an expression") from None


def _value(node: ast.AST, values: Mapping[str, int], formula: str) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.Name):
        if node.id not in values:
            raise FormulaError(f"size formula {formula!r} names {node.id!r}, no dynamic dimension")
        return int(values[node.id])
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left, values, formula), _value(node.right, values, formula)
        if isinstance(node.op, ast.Pow) and not 0 <= right <= 64:
            raise FormulaError(f"size formula {formula!r} raises to the power {right}")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand, values, formula)
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _CALLS
        and node.args
        and not node.keywords
    ):
        return _CALLS[node.func.id](_value(a, values, formula) for a in node.args)
    raise FormulaError(f"size formula {formula!r} has {ast.dump(node)[:40]}, not an integer size")


def shape(formulas: tuple[str | int, ...], values: Mapping[str, int]) -> tuple[int, ...]:
    """A value's shape for the dimensions' ``values``."""
    return tuple(evaluate(f, values) for f in formulas)
