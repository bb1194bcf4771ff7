"""Dynamic sizes in generated code: a forward reads each dynamic dimension it uses from one of
its arguments (``seq = hidden.size(1)``) before the operators that compute with it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import sympy

from ..errors import AutopipeError
from ..ir import Graph, Node, TensorMeta
from ..ir.types import sizes_in
from ..runtime.core.shapes import names_in


def symbol_names(graph: Graph) -> list[str]:
    """The graph's dynamic dimensions, in declaration order."""
    return list(graph.model.symbols)


def used_symbols(graph: Graph, nodes: Iterable[Node]) -> list[str]:
    """The dynamic dimensions the arguments of ``nodes`` compute with, in declaration order."""
    used: set[str] = set()
    for node in nodes:
        for size in sizes_in((node.args, node.kwargs)):
            used |= names_in(size.formula)
    return [name for name in symbol_names(graph) if name in used]


def size_lines(needed: list[str], arguments: list[tuple[str, Any]], where: str) -> list[str]:
    """``seq = x.size(1)`` for each dimension in ``needed``, read from the first of the forward's
    ``arguments`` (generated name, metadata) that has it as a dimension; a dimension only found
    in a multiple or an offset (``2 * seq``) is solved for (``seq = x.size(0) // 2``)."""
    lines = []
    for symbol in needed:
        line = _direct(symbol, arguments) or _solved(symbol, arguments)
        if line is None:
            raise AutopipeError(
                f"{where} computes with the dynamic dimension {symbol!r} but none of its inputs "
                "has a size it can be read from; please report this model"
            )
        lines.append(line)
    return lines


def _direct(symbol: str, arguments: list[tuple[str, Any]]) -> str | None:
    for name, meta in arguments:
        if isinstance(meta, TensorMeta) and symbol in meta.sizes:
            return f"{symbol} = {name}.size({meta.sizes.index(symbol)})"
    return None


def _solved(symbol: str, arguments: list[tuple[str, Any]]) -> str | None:
    """``symbol`` from a dimension ``a * symbol + b`` (integers a > 0, b) of an argument."""
    variable = sympy.Symbol(symbol, integer=True)
    for name, meta in arguments:
        if not isinstance(meta, TensorMeta):
            continue
        for dim, text in enumerate(meta.sizes):
            if names_in(text) != {symbol}:
                continue
            expr = sympy.sympify(text, locals={symbol: variable})
            poly = sympy.Poly(expr, variable) if expr.is_polynomial(variable) else None
            if poly is None or poly.degree() != 1:
                continue
            if not all(c.is_Integer for c in poly.all_coeffs()) or poly.all_coeffs()[0] < 1:
                continue
            a, b = (int(c) for c in poly.all_coeffs())
            size = f"{name}.size({dim})"
            offset = size if b == 0 else f"({size} {'-' if b > 0 else '+'} {abs(b)})"
            return f"{symbol} = {offset if a == 1 else f'{offset} // {a}'}"
    return None
